"""Draft-length policies under batching: one batch of B prompts vs the same prompts one by one.

The first B prompts of the mini suite (chat template), greedy, bfloat16, exactly N new tokens each
(EOS ignored), prefill excluded; policies run side by side in one process, repeats interleaved;
prints median tokens/s per (policy, batched or one-by-one).

    .venv/bin/python benchmarks/batch_policy.py [--method ngram] [--policies none,fixed,auto] [--batch 8]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.api import Generator, load_model, make_proposer
from specdec.bench.suites import load_suite
from specdec.engine import Request
from specdec.proposers.base import NoProposer


def run(gen: Generator, prompts: list[list[int]], n: int) -> float:
    """Tokens/s of decoding `prompts` as one batch (prefill excluded)."""
    eng = gen.engine(len(prompts), max(map(len, prompts)) + n + 64)
    eng.eos_ids = frozenset()
    seqs = [eng.add(Request(p, n)) for p in prompts]
    with torch.inference_mode():
        eng.step()                                                  # the prefill
        t = time.perf_counter()
        while eng.busy:
            eng.step()
    return sum(len(s.generated) for s in seqs) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--policies", default="none,fixed,auto", help="'none' = plain decoding")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    target, tok, name = load_model(a.model, "bfloat16")
    prompts = [tok.encode(p.turns[0], chat=True) for p in load_suite("mini")][:a.batch]
    gens = {pol: Generator(target, tok, NoProposer(), "fixed", 1, name) if pol == "none" else
            Generator(target, tok, make_proposer(a.method, target, tok, None, "bfloat16", "cpu"), pol,
                      a.num_draft_tokens, name) for pol in a.policies.split(",")}
    batched: dict[str, list[float]] = {p: [] for p in gens}
    alone: dict[str, list[float]] = {p: [] for p in gens}
    for _ in range(a.repeats):
        for pol, gen in gens.items():
            batched[pol].append(run(gen, prompts, a.new_tokens))
            alone[pol].append(len(prompts) / sum(1 / run(gen, [p], a.new_tokens) for p in prompts))
    print(f"{name}, {a.method}, K={a.num_draft_tokens}, batch {len(prompts)}, {a.new_tokens} new tokens, "
          f"median of {a.repeats}, torch threads {torch.get_num_threads()}")
    for pol in gens:
        b, o = statistics.median(batched[pol]), statistics.median(alone[pol])
        print(f"  {pol:<6} batched {b:7.1f} tok/s   one by one {o:6.1f} tok/s   ratio {b / o:4.2f}x")


if __name__ == "__main__":
    main()
