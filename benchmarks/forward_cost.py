"""What one target forward costs as it scores more tokens: a chain of T tokens vs a token tree of T nodes.

This is the price side of speculation: K drafts are free only while a forward of K+1 tokens costs about
what a forward of one does. On a small model and a 2-core CPU the linear layers turn compute-bound after a
few rows, and an exact tree forward pays, on top, for the per-node tail key blocks (see the decoder's
`tree_tail_scores`). Target forwards with the LM head on every scored token (as verification needs),
after a context of --context tokens, medians of interleaved repeats, as multiples of the one-token forward.

    .venv/bin/python benchmarks/forward_cost.py [--model smollm2-135m] [--dtype auto|float32|bfloat16|q4] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
from specdec.api import load_model
from specdec.tree import TokenTree


def random_tree(n: int, gen: torch.Generator) -> TokenTree:
    """n nodes (root included), each node's parent drawn among the earlier nodes, at most 3 children deep."""
    parents = [-1] + [int(torch.randint(max(0, i - 3), i, (1,), generator=gen)) for i in range(1, n)]
    return TokenTree(torch.randint(0, 1000, (1, n), generator=gen), torch.tensor([parents]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or q4")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--context", type=int, default=300, help="committed tokens before the scored ones")
    ap.add_argument("--sizes", default="1,2,3,5,8,12,16,17,24,32", help="tokens (chain) / nodes (tree) per forward")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    if not sizes or min(sizes) < 1:
        raise SystemExit("--sizes: positive integers, e.g. 1,5,17")
    target = load_model(args.model, args.dtype)[0]
    cache = target.new_cache(1, args.context + max(sizes) + 1)
    rows = torch.zeros(1, dtype=torch.long)
    cache.commit(rows, torch.arange(args.context)[None], torch.tensor([args.context]))
    g = torch.Generator().manual_seed(0)
    trees = {n: random_tree(n, g) for n in sizes}
    times: dict[tuple[str, int], list[float]] = {}

    def timed(kind: str, n: int) -> None:
        tokens = torch.randint(0, 1000, (1, n), generator=g)
        if kind == "chain":
            positions, mask = args.context + torch.arange(n)[None], None
        else:
            tree = trees[n]
            positions, mask, tokens = args.context + tree.depth(), tree.mask(), tree.tokens
        t = time.perf_counter()
        target.lm_head(target(tokens, positions, cache, rows, mask))     # writes scratch rows only
        times.setdefault((kind, n), []).append(time.perf_counter() - t)

    with torch.inference_mode():
        for n in sizes:                                                       # warm-up
            timed("chain", n)
        times.clear()
        for _ in range(args.repeats):
            for n in sizes:
                timed("chain", n)
                if n > 1:
                    timed("tree", n)
    one = statistics.median(times[("chain", 1)])
    from specdec.machine import cpu_model

    print(f"{args.model} {target.compute} ({args.dtype}), {torch.get_num_threads()} threads, {cpu_model()} "
          f"({torch.backends.cpu.get_cpu_capability()}), context {args.context}: "
          f"one-token forward {one * 1e3:.1f} ms")
    print("| tokens scored | chain ms | chain / one token | tree ms | tree / one token | tree / chain |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        c = statistics.median(times[("chain", n)])
        if n == 1:
            print(f"| 1 | {c * 1e3:.1f} | 1.00x | | | |")
            continue
        t = statistics.median(times[("tree", n)])
        print(f"| {n} | {c * 1e3:.1f} | {c / one:.2f}x | {t * 1e3:.1f} | {t / one:.2f}x | {t / c:.2f}x |")


if __name__ == "__main__":
    main()
