"""Where a method under the `auto` draft policy spends its time against plain decoding, step by step.

Runs each prompt of the mini suite (first turn, its token budget, seed = its index) through `--method` with
`--draft-policy auto` and through `none`, alternately, at `--temperature`; the EAGLE chains draft point masses
(`sample_drafts="off"`), so both write the same tokens and their times compare directly (checked). Prints the
summed time of each, then the method's engine steps grouped by (drafts asked, drafts made): count, mean ms and
seconds in all (a step that asked for drafts and got none is a decline: an EAGLE chain below its confidence cut,
prompt lookup without a match), and the EAGLE head's catch-ups (calls, pairs waiting, seconds).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/auto_steps.py --method eagle3 --temperature 1.0 --threads 1
"""
from __future__ import annotations

import argparse
import collections
import time

import specdec  # (applies $SPECDEC_ISA before torch computes)
import torch

from specdec import engine as engine_mod
from specdec.bench.suites import load_suite
from specdec.machine import cpu_model
from specdec.proposers import eagle as eagle_mod

STEPS: dict[tuple[int, int], list[float]] = collections.defaultdict(list)   # (asked, drafted) -> step seconds
CATCH_UP = collections.Counter()
TIMING = [False]                                                             # the method's steps, not none's


def watch() -> None:
    """Time the engine's steps (with the drafts each asked for and made) and the EAGLE head's catch-ups."""
    speculate, propose, catch_up = (engine_mod.Engine._speculate, engine_mod.Engine._propose,
                                    eagle_mod.EagleProposer._catch_up)

    def timed_speculate(self, seqs, k):
        t = time.perf_counter()
        speculate(self, seqs, k)
        if TIMING[0]:
            STEPS[self.asked_drafted].append(time.perf_counter() - t)

    def noted_propose(self, seqs, batch, k):
        draft = propose(self, seqs, batch, k)
        self.asked_drafted = (k, draft.tokens.shape[1])
        return draft

    def timed_catch_up(self, rows):
        waiting = sum(len(self.unfed[r][0]) for r in rows.tolist() if r in self.unfed)
        t = time.perf_counter()
        catch_up(self, rows)
        CATCH_UP["seconds"] += time.perf_counter() - t
        CATCH_UP["pairs waiting"] += waiting
        CATCH_UP["calls"] += 1

    engine_mod.Engine._speculate = timed_speculate
    engine_mod.Engine._propose = noted_propose
    eagle_mod.EagleProposer._catch_up = timed_catch_up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="eagle3", help="a drafting method (default: eagle3)")
    ap.add_argument("--temperature", type=float, default=1.0, help="(default: 1.0)")
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts of the suite only (default: all)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    watch()
    prompts = load_suite("mini", None)
    prompts = prompts[:args.limit] if args.limit else prompts
    method = specdec.load(method=args.method, draft_policy="auto", sample_drafts="off")
    plain = specdec.load(method="none")
    seconds = collections.Counter()
    for i, p in enumerate(prompts):
        outputs = []
        for name, gen in ((args.method, method), ("none", plain)):
            TIMING[0] = gen is method
            t = time.perf_counter()
            outputs.append(gen.generate(p.turns[0], max_new_tokens=p.max_new_tokens, temperature=args.temperature,
                                        seed=i).tokens)
            seconds[name] += time.perf_counter() - t
        assert outputs[0] == outputs[1], f"{p.id}: {args.method} wrote other tokens than none"
    print(f"{cpu_model()}, {args.threads} thread(s), {len(prompts)} prompts, temperature {args.temperature}")
    print(f"{args.method}@auto {seconds[args.method]:.2f} s, none {seconds['none']:.2f} s: "
          f"{seconds['none'] / seconds[args.method]:.3f}x")
    print(f"{'asked':>5} {'drafted':>7} {'steps':>6} {'mean ms':>8} {'seconds':>8}")
    for (asked, drafted), times in sorted(STEPS.items()):
        print(f"{asked:>5} {drafted:>7} {len(times):>6} {1e3 * sum(times) / len(times):>8.2f} {sum(times):>8.2f}")
    print(f"EAGLE head catch-ups: {CATCH_UP['calls']} calls, {CATCH_UP['pairs waiting']} pairs waiting, "
          f"{CATCH_UP['seconds']:.2f} s")


if __name__ == "__main__":
    main()
