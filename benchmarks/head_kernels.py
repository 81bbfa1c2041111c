"""The LM head's candidate kernels on this machine: ms per call for M rows, and the one specdec chose.

In q4 an 8-bit (Q8_0) head can run as two 4-bit halves through torch's int4 kernel, as stored through
the native kernels (`native-q8`, and `native-q8x8` with 8-bit inputs, where a C compiler built them), or
dense (prepacked oneDNN, in the model's dtype). `Transformer.pack` times them once per machine for 1, 4 and 8 rows and keeps the fastest (`kernels.fastest`); this prints the full picture, medians of
interleaved calls.

    .venv/bin/python benchmarks/head_kernels.py [--model smollm2-135m] [--threads 1] [--rows 1,2,4,5,8,16]
    .venv/bin/python benchmarks/head_kernels.py --decode 128     # and plain decoding with each head, interleaved
    SPECDEC_ISA=avx2 .venv/bin/python benchmarks/head_kernels.py      # the portable AVX2 kernels
"""
from __future__ import annotations

import argparse
import statistics
import time

import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
import torch

from specdec.api import load_model
from specdec.machine import cpu_model, probe
from specdec.models.kernels import check_inputs, linear, pack


def decode_times(model, kernels: dict, n: int) -> dict[str, list[float]]:
    """Seconds of `n` one-token forwards (decoder + head + argmax) per head kernel, in interleaved blocks of 8."""
    from profile_token import Run                                          # benchmarks/profile_token.py

    runs = {name: Run(model, 64, 1, n + 8) for name in kernels}
    out: dict[str, list[float]] = {name: [] for name in kernels}
    for block in range(-1, n // 8):                                         # block -1: warm-up
        for name, k in kernels.items():
            model.packed["lm_head"] = k
            for _ in range(8):
                t = time.perf_counter()
                runs[name].step()
                if block >= 0:
                    out[name].append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", default="1,2,4,5,8,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--decode", type=int, default=0,
                    help="also time this many one-token decoding forwards (model + head) per head kernel, interleaved")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, _, _ = load_model(a.model, "q4")
    w = model.output if model.output.numel() else model.embed
    kernels = {f"dense {str(w.dtype).removeprefix('torch.')} (oneDNN)": pack(w)}
    kernels.update({(f"{n} halves" if n == "int4" else n): k for n, k in model.head_kernels.items()})
    rows = [int(r) for r in a.rows.split(",")]
    x = check_inputs(w.shape[1], w.dtype)
    times = {n: {m: [] for m in rows} for n in kernels}
    with torch.inference_mode():
        for n, k in kernels.items():
            linear(x[:1], w, {n: k}, n)
        for _ in range(a.repeats):
            for m in rows:
                for n, k in kernels.items():
                    t = time.perf_counter()
                    linear(x[:m], w, {n: k}, n)
                    times[n][m].append(time.perf_counter() - t)
    chosen = model.packed["lm_head"]
    decode = decode_times(model, kernels, a.decode) if a.decode else {}
    m = probe()
    print(f"{a.model} LM head [{w.shape[0]} x {w.shape[1]}], {a.threads} thread(s); CPU: {cpu_model()}, "
          f"torch {torch.__version__} kernels {m.torch_capability}{', ISA limit ' + m.isa_limit if m.isa_limit else ''}")
    print(f"chosen here: {type(chosen).__name__} ({str(chosen.dtype).removeprefix('torch.')})")
    print("| kernel | " + " | ".join(f"M = {r}" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for n, by_m in times.items():
        print(f"| {n} | " + " | ".join(f"{statistics.median(by_m[r]) * 1000:.2f} ms" for r in rows) + " |")
    for n, ts in decode.items():
        med = statistics.median(ts)
        print(f"decoding with the {n} head: median {med * 1000:.2f} ms per token ({1 / med:.1f} tokens/s), "
              f"fastest {min(ts) * 1000:.2f} ms, {len(ts)} tokens")


if __name__ == "__main__":
    main()

