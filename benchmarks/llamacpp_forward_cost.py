"""A forward of K rows in llama.cpp and in specdec, side by side: why the engines choose draft lengths differently.

Speculation pays while verifying K+1 rows costs about what one row does. Both engines score K rows (logits on
every row, as verification needs) after the same --context tokens of the same GGUF, on the same thread count:
llama.cpp through llama-cpp-python's low-level API (one `llama_decode` of K tokens, then the K cache rows
dropped again), specdec's decoder in q4 (its target forward plus the LM head, into scratch cache rows).
Interleaved repeats, medians; each engine's times also as multiples of its own one-row forward.

    .venv/bin/python benchmarks/llamacpp_forward_cost.py [--model smollm2-135m] [--threads 1] [--rows 1,2,4,8,16]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
from specdec.api import load_model
from specdec.bench.peers import LlamaCppDecoder, llamacpp_version, load_llama
from specdec.machine import cpu_model
from specdec.models.registry import resolve


def llamacpp_forward(decoder: LlamaCppDecoder, context: int, tokens: list[int]) -> Callable[[], float]:
    """Seconds of one llama.cpp forward of ``tokens`` after ``context`` cached positions (dropped again after)."""
    def run() -> float:
        start = time.perf_counter()
        decoder.decode(tokens, context, every_row=True)
        decoder.synchronize()
        seconds = time.perf_counter() - start
        decoder.truncate(context)
        return seconds
    return run


def specdec_forward(target, cache, context: int, tokens: list[int]) -> Callable[[], float]:
    """Seconds of one specdec target forward (LM head on every row) of ``tokens`` after ``context`` committed ones."""
    ids = torch.tensor([tokens])                                          # (1, K)
    positions = context + torch.arange(len(tokens))[None]                 # (1, K)
    rows = torch.zeros(1, dtype=torch.long)

    def run() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            target.lm_head(target(ids, positions, cache, rows, None))    # writes scratch rows only
        return time.perf_counter() - start
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="registered name or .gguf path")
    ap.add_argument("--threads", type=int, default=1, help="threads of both engines")
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the scored rows")
    ap.add_argument("--rows", default="1,2,4,8,16", help="rows scored per forward (K)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    sizes = [int(s) for s in args.rows.split(",")]
    if not sizes or min(sizes) < 1 or args.threads < 1 or args.repeats < 1:
        raise SystemExit("--rows: positive integers (e.g. 1,2,4); --threads, --repeats: >= 1")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    context_ids = torch.randint(100, 10000, (args.context,), generator=g).tolist()
    scored = {k: torch.randint(100, 10000, (k,), generator=g).tolist() for k in sizes}

    decoder = LlamaCppDecoder(load_llama(resolve(args.model)[1], args.threads))
    decoder.truncate(0)
    for i in range(0, args.context, decoder.n_batch):
        decoder.decode(context_ids[i:i + decoder.n_batch], i)
    target = load_model(args.model, "q4")[0]
    cache = target.new_cache(1, args.context + max(sizes) + 1)
    rows, keep = torch.zeros(1, dtype=torch.long), torch.arange(args.context)[None]       # (1,), (1, context)
    with torch.inference_mode():
        target(torch.tensor([context_ids]), keep, cache, rows, None)     # the context's keys and values
    cache.commit(rows, keep, torch.tensor([args.context]))

    engines = {"llama.cpp": {k: llamacpp_forward(decoder, args.context, scored[k]) for k in sizes},
               "specdec": {k: specdec_forward(target, cache, args.context, scored[k]) for k in sizes}}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(2):                                                    # warm-up
        for runs in engines.values():
            for run in runs.values():
                run()
    for _ in range(args.repeats):
        for k in sizes:
            for name, runs in engines.items():
                times.setdefault((name, k), []).append(runs[k]())
    ms = {key: statistics.median(v) * 1e3 for key, v in times.items()}

    load = os.getloadavg()[0]
    print(f"{args.model}, {cpu_model()} (torch kernels {torch.backends.cpu.get_cpu_capability()}), "
          f"{args.threads} thread(s), context {args.context}, medians of {args.repeats}; llama-cpp-python "
          f"{llamacpp_version()}, specdec {target.compute}; load average {load:.1f}"
          + (" (a loaded machine)" if load > 1.5 else ""))
    print("| rows K | llama.cpp ms | llama.cpp / 1 row | specdec ms | specdec / 1 row | specdec / llama.cpp |")
    print("|---|---|---|---|---|---|")
    one = {name: ms[(name, sizes[0])] for name in engines} if sizes[0] == 1 else {}
    for k in sizes:
        lc, sd = ms[("llama.cpp", k)], ms[("specdec", k)]
        rel = (f"{lc / one['llama.cpp']:.2f}x", f"{sd / one['specdec']:.2f}x") if one else ("", "")
        print(f"| {k} | {lc:.2f} | {rel[0]} | {sd:.2f} | {rel[1]} | {sd / lc:.2f}x |")


if __name__ == "__main__":
    main()
