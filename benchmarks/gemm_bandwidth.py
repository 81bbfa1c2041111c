"""Weight bandwidth of the decoder's linear layers on this CPU: bf16 vs fp32, prepacked vs F.linear.

Decoding a small model is bound by reading weights, so this explains most of a machine's plain
decoding speed. 64 distinct [1536, 576] weights (larger than the L2 cache), 2 rows, as in a decode
step. Usage: python benchmarks/gemm_bandwidth.py [--threads N]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=3000, help="timed calls per variant (default: %(default)s)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, 576, dtype=dtype)                                     # [2, in]
        ws = [torch.randn(1536, 576, dtype=dtype) for _ in range(64)]            # [out, in] each
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws]
        variants = {"F.linear": lambda i: F.linear(x, ws[i % 64]),
                    "prepacked": lambda i: torch.ops.mkldnn._linear_pointwise(x, packed[i % 64], None, "none", [], "")}
        for name, f in variants.items():
            for i in range(200):
                f(i)
            t = time.perf_counter()
            for i in range(a.iters):
                f(i)
            dt = (time.perf_counter() - t) / a.iters
            gbs = ws[0].numel() * ws[0].element_size() / dt / 1e9
            print(f"{str(dtype):15s} {name:10s} {dt * 1e6:7.1f} us/call  {gbs:5.1f} GB/s  ({a.threads} threads)")


if __name__ == "__main__":
    main()
