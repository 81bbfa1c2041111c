"""Plain (non-speculative) decoding speed: the lean decoder vs transformers' own `generate`.

Same GGUF model, same prompts, greedy, N new tokens (EOS ignored so every run
produces exactly N), repeats interleaved so machine noise hits all alike;
prints the median tokens/s of each, the ratios, and the weight bytes the lean
decoder streams per second.

    .venv/bin/python benchmarks/plain_decode.py [--model smollm2-135m] [--repeats 3] [--new-tokens 128]
    SPECDEC_ISA=avx2 .venv/bin/python benchmarks/plain_decode.py      # the portable AVX2 kernels

bfloat16 runs only where oneDNN computes it on this CPU, q4 where torch's int4 kernel runs (`specdec info`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
import torch

from specdec.api import Generator, load_model
from specdec.engine import Request
from specdec.machine import cpu_model, probe
from specdec.models.registry import resolve
from specdec.proposers.base import NoProposer

PROMPTS = [
    "Explain how a hash table works and when to use one.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Summarize the causes of the French Revolution in a few paragraphs.",
]


def lean_run(gen: Generator, ids: list[int], n: int) -> float:
    eng = gen.engine(1, len(ids) + n + 8)
    eng.eos_ids = frozenset()                                   # exactly n tokens
    seq = eng.add(Request(ids, n))
    t = time.perf_counter()
    with torch.inference_mode():
        while eng.busy:
            eng.step()
    dt = time.perf_counter() - t
    assert len(seq.generated) == n
    return n / dt


def hf_run(model, ids: list[int], n: int) -> float:
    inp = torch.tensor([ids])
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t
    assert out.shape[1] - len(ids) == n
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    name, path = resolve(a.model)
    lean = {}
    m = probe()
    for dt in ("float32", *(("bfloat16",) if m.onednn_bf16 else ()), *(("q4",) if m.int4_kernel else ())):
        model, tok, _ = load_model(a.model, dt)
        lean[f"lean {dt}"] = Generator(model, tok, NoProposer(), name=name)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = lean["lean float32"].tokenizer
    prompts = [tok.encode(p, chat=tok.has_chat_template) for p in PROMPTS]
    runs: dict[str, list[float]] = {**{k: [] for k in lean}, "transformers float32": []}
    for ids in prompts:                                          # warm-up
        for g in lean.values():
            lean_run(g, ids, 8)
        hf_run(hf, ids, 8)
    for r in range(a.repeats):
        for ids in prompts:                                      # interleaved: every system sees the same noise
            for k, g in lean.items():
                runs[k].append(lean_run(g, ids, a.new_tokens))
            runs["transformers float32"].append(hf_run(hf, ids, a.new_tokens))
    med = {k: statistics.median(v) for k, v in runs.items()}
    base = med["transformers float32"]
    report = {
        "model": name, "new_tokens": a.new_tokens, "repeats": a.repeats, "threads": a.threads,
        "torch": torch.__version__, "cpu": cpu_model(), "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "tokens_per_second": med, "ratio_vs_transformers": {k: v / base for k, v in med.items()},
        "weight_GB_per_s": {k: sum(p.numel() * p.element_size() for p in g.target.parameters()) * med[k] / 1e9
                            for k, g in lean.items()},
    }
    if a.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{name}, greedy, {a.new_tokens} new tokens, {len(PROMPTS)} prompts x {a.repeats} repeats, "
          f"{a.threads} threads, torch {torch.__version__}, {report['cpu']}, {report['torch_capability']}")
    print("| decoder | tokens/s (median) | vs transformers |")
    print("|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.1f} | {v / base:.2f}x |")
    for k, v in report["weight_GB_per_s"].items():
        print(f"{k} streams {v:.1f} GB/s of weights")


if __name__ == "__main__":
    main()
