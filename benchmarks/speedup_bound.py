"""What speedup over plain decoding this CPU allows a chain of drafts, from measured costs.

A speculative step with K drafts costs one target forward of K + 1 rows, F(K + 1), plus the drafting: nothing
for prompt lookup or suffix decoding, K head steps of D each for an EAGLE-3 chain. With a conditional
acceptance a at every draft position it commits on average 1 + a + a^2 + ... + a^K tokens, so

    speedup(a, K) = F(1) (1 - a^(K+1)) / (1 - a) / (F(K + 1) + K D)        (plain decoding: F(1) per token)

This script measures F(rows) for rows 1..K_max+1 (the q4 target, LM head on every row, after --context cached
tokens) and D (one step of the shipped EAGLE-3 head: its layer, logits and argmax, after the same context),
interleaved, medians of --repeats; then prints, for a range of acceptances, the best K and its speedup with
free drafts and with the head's, and the least acceptance at which each reaches --goal. Prefill, the
engine's bookkeeping and the step's sampling are left out: the figures bound what a chain can reach.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speedup_bound.py --threads 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
import torch

from specdec.api import load_model, shipped
from specdec.machine import cpu_model
from specdec.models.eagle3 import Eagle3Head


def tokens_per_step(a: float, k: int) -> float:
    """Expected tokens committed by a chain of k drafts, each accepted with probability a given its prefix."""
    return float(sum(a ** i for i in range(k + 1)))


def speedup(a: float, k: int, forward: dict[int, float], draft: float) -> float:
    """Tokens per second of a chain of k drafts over plain decoding's (forward: ms per forward of n rows)."""
    return forward[1] * tokens_per_step(a, k) / (forward[k + 1] + k * draft)


def best(a: float, forward: dict[int, float], draft: float, k_max: int) -> tuple[int, float]:
    """(K, speedup) of the best chain length 0..k_max at acceptance a (K = 0: plain decoding, 1.0x)."""
    return max(((k, speedup(a, k, forward, draft)) for k in range(k_max + 1)), key=lambda kv: kv[1])


def least_acceptance(goal: float, forward: dict[int, float], draft: float, k_max: int) -> float:
    """The least a (to 0.001) at which some chain reaches `goal`; above 1: no acceptance does."""
    if best(1.0, forward, draft, k_max)[1] < goal:
        return float("inf")
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if best(mid, forward, draft, k_max)[1] >= goal else (mid, hi)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="registered name or .gguf path")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the scored rows (default: %(default)s)")
    ap.add_argument("--k-max", type=int, default=8, help="longest chain considered (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=21, help="interleaved repeats, medians (default: %(default)s)")
    ap.add_argument("--goal", type=float, default=1.8, help="speedup whose least acceptance is printed (default: %(default)s)")
    a = ap.parse_args()
    if a.threads < 1 or a.k_max < 1 or a.repeats < 1 or a.context < 1:
        raise SystemExit("--threads, --k-max, --repeats and --context must be >= 1")
    torch.set_num_threads(a.threads)
    target = load_model(a.model, "q4")[0]
    head = Eagle3Head.load(shipped(target.config.name, "eagle3"), target)
    g = torch.Generator().manual_seed(0)
    C, H = a.context, target.config.dim
    ids = torch.randint(100, 10000, (1, C + a.k_max + 1), generator=g)                  # [1, C + K_max + 1]
    feats = torch.randn(1, C + 1, H, generator=g).to(head.fc.weight.dtype)            # [1, C + 1, H]
    rows = torch.zeros(1, dtype=torch.long)
    cache, hcache = target.new_cache(1, C + a.k_max + 2), head.new_cache(1, C + 8)
    with torch.inference_mode():
        target(ids[:, :C], torch.arange(C)[None], cache, rows, None)
        cache.commit(rows, torch.arange(C)[None], torch.tensor([C]))
        head(ids[:, :C], feats[:, :C], torch.arange(C)[None], hcache, rows)
        hcache.commit(rows, torch.arange(C)[None], torch.tensor([C]))

    def forward(n: int) -> Callable[[], object]:
        x, pos = ids[:, C:C + n], C + torch.arange(n)[None]
        return lambda: target.lm_head(target(x, pos, cache, rows, None)).argmax(-1)    # scratch rows only

    def head_step() -> object:
        return head.logits(head(ids[:, C:C + 1], feats[:, C:], torch.tensor([[C]]), hcache, rows)[:, -1]).argmax(-1)

    calls: dict[object, Callable[[], object]] = {n: forward(n) for n in range(1, a.k_max + 2)}
    calls["head"] = head_step
    times: dict[object, list[float]] = {key: [] for key in calls}
    with torch.inference_mode():
        for r in range(a.repeats + 2):                                                  # 2 warm-up rounds
            for key, call in calls.items():
                t = time.perf_counter()
                for _ in range(5):
                    call()
                if r >= 2:
                    times[key].append((time.perf_counter() - t) / 5 * 1e3)
    ms = {key: statistics.median(v) for key, v in times.items()}
    fwd = {n: ms[n] for n in range(1, a.k_max + 2)}
    d = ms["head"]

    load = os.getloadavg()[0]
    print(f"{a.model} q4, {cpu_model()} (torch kernels {torch.backends.cpu.get_cpu_capability()}), {a.threads} "
          f"thread(s), context {C}, medians of {a.repeats}; load average {load:.1f}"
          + (" (a loaded machine)" if load > 1.5 else ""))
    print("| rows | " + " | ".join(str(n) for n in fwd) + " |")
    print("|---|" + "---|" * len(fwd))
    print("| target forward, ms | " + " | ".join(f"{v:.2f}" for v in fwd.values()) + " |")
    print("| x one row | " + " | ".join(f"{v / fwd[1]:.2f}" for v in fwd.values()) + " |")
    print(f"\nEAGLE-3 head step (layer, logits, argmax): {d:.2f} ms = {d / fwd[1]:.2f} of a one-row forward\n")
    print("| acceptance a | free drafts: best K, speedup | head drafts: best K, speedup |")
    print("|---|---|---|")
    for acc in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0):
        (k0, s0), (k1, s1) = best(acc, fwd, 0.0, a.k_max), best(acc, fwd, d, a.k_max)
        print(f"| {acc:.2f} | K = {k0}: {s0:.2f}x | K = {k1}: {s1:.2f}x |")
    for name, cost in (("free drafts", 0.0), ("head drafts", d)):
        need = least_acceptance(a.goal, fwd, cost, a.k_max)
        print(f"{a.goal}x over plain decoding needs a >= {need:.3f} with {name}" if need <= 1 else
              f"{a.goal}x over plain decoding is out of reach with {name} (K <= {a.k_max})")


if __name__ == "__main__":
    main()
