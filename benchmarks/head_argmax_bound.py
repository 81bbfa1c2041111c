"""Could greedy decoding find the LM head's argmax from a cheaper copy of the head, exactly?

For a b-bit copy Wb of the head W (per 32 weights a scale and a minimum, from W's dequantized values), every
logit obeys |x.W_n - x.Wb_n| <= ||x|| ||W_n - Wb_n|| (Cauchy-Schwarz). The exact argmax is among the rows whose
upper bound reaches the best lower bound; only those would need the exact head. This counts them over the
final hidden states of a real text (the repository's README, prefilled in float32), per bit width:

    .venv/bin/python benchmarks/head_argmax_bound.py [--model smollm2-135m] [--tokens 700] [--threads 1]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specdec.api import load_model

README = Path(__file__).resolve().parents[1] / "README.md"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok, _ = load_model(a.model, dtype="float32")
    w = (model.output if model.output.numel() else model.embed).float()            # [V, H]
    V, H = w.shape
    ids = tok.encode(README.read_text(), False)[:a.tokens]
    T = len(ids)
    with torch.inference_mode():
        hidden = model.prefill(torch.tensor([ids]), torch.arange(T)[None], model.new_cache(1, T), torch.tensor([0]))
        x = hidden[0, :, :H].float()                                                # [T, H]
        exact = x @ w.T                                                             # [T, V]
        for bits in (4, 5, 6):
            wb = w.view(V, H // 32, 32)
            lo, hi = wb.amin(-1, keepdim=True), wb.amax(-1, keepdim=True)
            sc = (hi - lo) / (2 ** bits - 1)
            approx_w = (torch.round((wb - lo) / torch.where(sc > 0, sc, 1)) * sc + lo).view(V, H)
            approx = x @ approx_w.T
            bound = x.norm(dim=-1, keepdim=True) * (w - approx_w).norm(dim=-1)[None]   # [T, V]
            floor = (approx - bound).amax(-1, keepdim=True)
            cand = (approx + bound >= floor).sum(-1).float()                        # [T] rows left to compute
            err = (approx - exact).abs().amax(-1)
            agree = (approx.argmax(-1) == exact.argmax(-1)).float().mean()
            print(f"{a.model} [{V} x {H}], {T} positions, {bits}-bit copy: rows left median {cand.median():.0f} "
                  f"(p90 {cand.quantile(0.9):.0f}, max {cand.max():.0f}); bound median {bound.median():.2f}, "
                  f"largest actual error median {err.median():.2f}; the copy's argmax right {agree:.3f}")


if __name__ == "__main__":
    main()
