"""What the q4 mode's kernels cost in model quality: the mean negative log-likelihood of a text under the
float32 mode (the GGUF's weights dequantized) and under q4 (its decoding kernels: torch's int4 kernel with
bfloat16 activations, or the native 4-bit kernel with 8-bit activations, whichever this machine chose).

The text is scored in chunks of 32 tokens through decoding forwards (prefills run other kernels), so every
token's logits come from the kernels that decode.

    .venv/bin/python benchmarks/q4_activation_loss.py [--model smollm2-135m] [--tokens 600] [--threads 1]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
from specdec.api import load_model
from specdec.machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 32


def mean_nll(model, ids: torch.Tensor) -> float:
    """Mean negative log-likelihood (nats) of ids[1:] given the tokens before, in decoding forwards of CHUNK."""
    cache = model.new_cache(1, len(ids) + CHUNK)
    rows = torch.arange(1)
    total, n = 0.0, 0
    with torch.inference_mode():
        for s in range(0, len(ids) - 1, CHUNK):
            chunk = ids[s:s + CHUNK]
            hidden = model(chunk[None], torch.arange(s, s + len(chunk))[None], cache, rows)
            cache.commit(rows, torch.arange(len(chunk))[None], torch.tensor([len(chunk)]))
            logp = model.lm_head(hidden)[0].log_softmax(-1)
            target = ids[s + 1:s + 1 + len(chunk)]
            total -= float(logp[torch.arange(len(target)), target].sum())
            n += len(target)
    return total / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=600, help="tokens of README.md then docs/design.md to score")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    text = (ROOT / "README.md").read_text()[:3000] + (ROOT / "docs" / "design.md").read_text()[:3000]
    results = {}
    for dtype in ("float32", "q4"):
        model, tok, _ = load_model(a.model, dtype)
        ids = torch.tensor(tok.encode(text, False)[:a.tokens])
        kinds = sorted({k.label for layer in model.layers for k in layer.packed.values()})
        results[dtype] = mean_nll(model, ids)
        print(f"{dtype:8s} mean NLL {results[dtype]:.4f} nats over {len(ids) - 1} tokens (layers: {', '.join(kinds)})")
    print(f"q4 - float32: {results['q4'] - results['float32']:+.4f} nats; {cpu_model()}, "
          f"torch kernels {torch.backends.cpu.get_cpu_capability()}")


if __name__ == "__main__":
    main()
