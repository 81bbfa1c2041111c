"""What top-p sampling costs: tokens/s of seeded generations whose top-p cut is found among each row's most
likely tokens (`sampling.top_p_cut`, the default) against sorting every row's whole vocabulary
(`top_p_cut_by_sort`), interleaved per prompt and repeat in one run, and against the same method at the same
temperature without top-p. Both cuts give the same bits, so every pair of runs must give the same tokens.
Verification scores K + 1 rows per step and a sampling proposer transforms its own rows too, so a per-row cost
weighs on speculative methods more than on plain decoding: the speedups over `none` are printed for both cuts.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/top_p_cost.py --threads 1
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/top_p_cost.py --methods none,eagle3 --settings 1.0/0.95
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec
from specdec import sampling
from specdec.api import runtime_info
from specdec.bench.suites import load_suite


def timed(gen: specdec.Generator, prompt: str, max_new_tokens: int, temperature: float, top_p: float,
          by_sort: bool) -> tuple[float, list[int]]:
    """(tokens/s, tokens) of one seeded generation, the top-p cut by windows or by sorting whole rows."""
    windows = sampling.NUCLEUS_WINDOWS
    sampling.NUCLEUS_WINDOWS = () if by_sort else windows
    try:
        t0 = time.perf_counter()
        r = gen.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=7)
        return len(r.tokens) / (time.perf_counter() - t0), r.tokens
    finally:
        sampling.NUCLEUS_WINDOWS = windows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="none,ngram,eagle3", help="comma-separated (default: none,ngram,eagle3)")
    ap.add_argument("--settings", default="0.7/0.9,1.0/0.95",
                    help="temperature/top_p pairs, comma-separated (default: 0.7/0.9,1.0/0.95)")
    ap.add_argument("--num-draft-tokens", type=int, default=4, help="K, draft policy fixed (default: 4)")
    ap.add_argument("--prompts", type=int, default=6, help="mini-suite prompts, one per category (default: 6)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    settings = [tuple(float(v) for v in s.split("/")) for s in a.settings.split(",")]
    methods = a.methods.split(",")
    gens = {m: specdec.load(a.model, method=m, num_draft_tokens=a.num_draft_tokens, draft_policy="fixed")
            for m in methods}
    prompts = [p.turns[0] for p in load_suite("mini")[::3]][:a.prompts]
    speed: dict[tuple[str, float, float, str], list[float]] = {}
    for prompt in prompts:
        for _ in range(a.repeats):
            for t, top_p in settings:
                for m, gen in gens.items():
                    got = {}
                    for variant, p, by_sort in (("windows", top_p, False), ("sort", top_p, True), ("no top-p", 1.0, False)):
                        tps, got[variant] = timed(gen, prompt, a.max_new_tokens, t, p, by_sort)
                        speed.setdefault((m, t, top_p, variant), []).append(tps)
                    assert got["windows"] == got["sort"], f"{m}: the two cuts gave different tokens"
    rt = runtime_info(gens[methods[0]].target)
    print(f"{a.model} ({rt['dtype']}), {a.threads} thread(s), CPU: {rt['cpu']}, torch capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {len(prompts)} prompts x {a.repeats} repeats, "
          f"{a.max_new_tokens} new tokens, K = {a.num_draft_tokens} fixed; medians of tokens/s")
    print("| method | temperature / top_p | windows | whole-row sort | windows / sort | no top-p "
          "| windows vs none | sort vs none |")
    print("|---|---|---|---|---|---|---|---|")
    med = {k: statistics.median(v) for k, v in speed.items()}
    for t, top_p in settings:
        for m in methods:
            w, s, n = (med[(m, t, top_p, v)] for v in ("windows", "sort", "no top-p"))
            vs = [med[(m, t, top_p, v)] / med[("none", t, top_p, v)] if "none" in methods else float("nan")
                  for v in ("windows", "sort")]
            print(f"| `{m}` | {t} / {top_p} | {w:.1f} | {s:.1f} | {w / s:.2f}x | {n:.1f} | {vs[0]:.2f}x | {vs[1]:.2f}x |")


if __name__ == "__main__":
    main()
