"""torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) with bfloat16, float16 and float32 activations
(and scales in the same dtype), on smollm2-135m's layer shapes and its LM head as two 4-bit halves.

Prints ms per call (medians of interleaved calls) for M rows. specdec's q4 mode feeds the kernel
bfloat16; this shows what the other dtypes would cost on this machine.

    .venv/bin/python benchmarks/int4_activations.py [--threads 1] [--rows 1,4,8] [--repeats 5]
    SPECDEC_ISA=avx2 .venv/bin/python benchmarks/int4_activations.py     # the portable AVX2 kernels
"""
from __future__ import annotations

import argparse
import statistics
import time

import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
import torch

from specdec.machine import cpu_model, probe

GROUP = 32
SHAPES = {"wqkv [960 x 576]": (960, 576), "w13 [3072 x 576]": (3072, 576), "wo [576 x 576]": (576, 576),
          "w2 [576 x 1536]": (576, 1536), "LM head halves [49152 x 1152]": (49152, 1152)}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    m = probe()
    print(f"CPU: {cpu_model()}, torch {torch.__version__} kernels {m.torch_capability}"
          f"{', ISA limit ' + m.isa_limit if m.isa_limit else ''}, {a.threads} thread(s); ms per call, medians")
    print("| weight | activations | " + " | ".join(f"M = {r}" for r in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for name, (n, k) in SHAPES.items():
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), generator=g,
                                                                                  dtype=torch.int32), 1)
        sz = torch.stack([torch.rand(k // GROUP, n, generator=g) * 0.01, torch.randn(k // GROUP, n, generator=g) * 0.01], -1)
        x = torch.randn(max(rows), k, generator=g)
        args = {dt: (x.to(dt), sz.to(dt).contiguous()) for dt in DTYPES}
        times = {dt: {r: [] for r in rows} for dt in DTYPES}
        with torch.inference_mode():
            for dt, (xd, szd) in args.items():
                torch.ops.aten._weight_int4pack_mm_for_cpu(xd[:1], packed, GROUP, szd)
            for _ in range(a.repeats):
                for r in rows:
                    for dt, (xd, szd) in args.items():
                        t = time.perf_counter()
                        torch.ops.aten._weight_int4pack_mm_for_cpu(xd[:r], packed, GROUP, szd)
                        times[dt][r].append(time.perf_counter() - t)
        for dt in DTYPES:
            cells = " | ".join(f"{statistics.median(times[dt][r]) * 1000:.3f}" for r in rows)
            print(f"| {name} | {str(dt).removeprefix('torch.')} | {cells} |")


if __name__ == "__main__":
    main()
