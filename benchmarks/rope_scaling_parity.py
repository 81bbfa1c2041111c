"""RoPE scaling on real models: specdec against transformers, both in float32.

Writes copies of the shipped GGUFs that declare RoPE scaling (smollm2-135m with linear scaling by 8, smollm2-135m
with a Llama 3 style `rope_freqs.weight` of 32 factors from 1 to 8, gemma3-270m with linear scaling by 8), loads
each into specdec, and compares the logits of a prompt's last 32 positions with transformers' forward of the
unmodified file whose rotary inverse frequencies are scaled the same way (Gemma 3: its global layers only).
Usage:

    .venv/bin/python benchmarks/rope_scaling_parity.py [--tokens 700] [--out DIR] [--threads 1]
"""
from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from specdec.api import load_model
from specdec.models.gguf_loader import load_gguf
from specdec.models.registry import resolve

FACTORS = np.linspace(1.0, 8.0, 32, dtype=np.float32)          # smollm2's 32 rotary frequencies


def scaled_copy(model: str, out: Path, freqs: bool) -> Path:
    """A copy of `model`'s GGUF with linear scaling by 8 in its metadata, or with `rope_freqs.weight`."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    path = out / f"{model}-{'rope-freqs' if freqs else 'linear8'}.gguf"
    if path.exists():
        return path
    reader = gguf.GGUFReader(resolve(model)[1])
    arch = reader.get_field("general.architecture").contents()
    keys = {} if freqs else {
        f"{arch}.rope.scaling.type": MetadataDetails(gguf.GGUFValueType.STRING, "linear"),
        f"{arch}.rope.scaling.factor": MetadataDetails(gguf.GGUFValueType.FLOAT32, 8.0)}
    source = reader
    if freqs:
        extra = SimpleNamespace(name="rope_freqs.weight", data=FACTORS, n_bytes=FACTORS.nbytes,
                                tensor_type=gguf.GGMLQuantizationType.F32)
        source = SimpleNamespace(fields=reader.fields, tensors=[*reader.tensors, extra], endianess=reader.endianess)
    copy_with_new_metadata(source, gguf.GGUFWriter(path, arch=arch, endianess=reader.endianess), keys, [])
    return path


@torch.no_grad()
def specdec_logits(path: Path, ids: list[int], keep: int) -> torch.Tensor:
    m = load_gguf(path, torch.float32, use_cache=False)
    cache, rows = m.new_cache(1, len(ids) + 8), torch.tensor([0])
    hidden = m.prefill(torch.tensor([ids]), torch.arange(len(ids))[None], cache, rows)    # [1, N, H]
    return m.lm_head(hidden[0, -keep:])                                                    # [keep, V]


@torch.no_grad()
def reference_logits(model: str, ids: list[int], keep: int, freqs: bool) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    path = resolve(model)[1]
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    rot = hf.model.rotary_emb
    name = "full_attention_inv_freq" if hasattr(rot, "full_attention_inv_freq") else "inv_freq"   # Gemma 3: global
    setattr(rot, name, getattr(rot, name) / (torch.from_numpy(FACTORS) if freqs else 8.0))
    return hf(torch.tensor([ids]), logits_to_keep=keep).logits[0].float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=700, help="prompt length (default: 700)")
    p.add_argument("--out", type=Path, default=Path("runs/rope-scaling"), help="where the copies go")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(a.tokens))
    for model, freqs in (("smollm2-135m", False), ("smollm2-135m", True), ("gemma3-270m", False)):
        tok = load_model(model, "float32")[1]
        ids = tok.encode(text, chat=False)[:a.tokens]
        got = specdec_logits(scaled_copy(model, a.out, freqs), ids, 32)
        ref = reference_logits(model, ids, 32, freqs)
        plain = specdec_logits(resolve(model)[1], ids, 32)
        print(f"{model} {'rope_freqs 1..8' if freqs else 'linear x8'}: max |specdec - transformers| "
              f"{(got - ref).abs().max():.3g}, argmax equal {int((got.argmax(-1) == ref.argmax(-1)).sum())}/32; "
              f"the scaling moves the logits by up to {(got - plain).abs().max():.3g}", flush=True)


if __name__ == "__main__":
    main()
