"""Throughput of the decoder's linear layers on this CPU: bf16 vs fp32, prepacked vs F.linear.

Decoding a small model is bound by reading weights (2 rows per GEMM, as in a decode step: GB/s),
prefilling by arithmetic (many rows: GFLOP/s); together they explain most of a machine's plain
decoding and prefill speed, and whether float32 prefill linears pay (`float32_prefill_pays`).
64 distinct [1536, 576] weights (larger than the L2 cache).
Usage: python benchmarks/gemm_bandwidth.py [--threads N] [--rows 2,24,128]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: %(default)s)")
    ap.add_argument("--rows", default="2,24,128", help="input rows per GEMM, comma-separated (default: %(default)s)")
    ap.add_argument("--flops", type=float, default=2e9, help="work per variant and row count, in FLOPs (default: %(default)s)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    for rows in (int(r) for r in a.rows.split(",")):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(rows, 576, dtype=dtype)                                  # [M, in]
            ws = [torch.randn(1536, 576, dtype=dtype) for _ in range(64)]            # [out, in] each
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
            variants = {"F.linear": lambda i: F.linear(x, ws[i % 64]),
                        "prepacked": lambda i: torch.ops.mkldnn._linear_pointwise(x, packed[i % 64], None, "none", [], "")}
            flops = 2 * rows * 576 * 1536
            iters = max(50, int(a.flops / flops))
            for name, f in variants.items():
                for i in range(min(200, iters)):
                    f(i)
                t = time.perf_counter()
                for i in range(iters):
                    f(i)
                dt = (time.perf_counter() - t) / iters
                gbs = ws[0].numel() * ws[0].element_size() / dt / 1e9
                print(f"rows {rows:4d} {str(dtype):15s} {name:10s} {dt * 1e6:8.1f} us/call  {gbs:5.1f} GB/s  "
                      f"{flops / dt / 1e9:6.1f} GFLOP/s  ({a.threads} threads)")


if __name__ == "__main__":
    main()
