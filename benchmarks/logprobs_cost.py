"""What log-probabilities cost: tokens/s of the same greedy generations without them, with each token's
(`logprobs=True`), with 5 and 20 alternatives, and with the prompt's too, interleaved per prompt and repeat in
one run; medians of the per-prompt ratios to the run without. Every variant's tokens must equal the plain run's.
The default method is `none`: `suffix` learns from each run's output, so the runs after the first of a prompt
draft more and the ratios measure that instead.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/logprobs_cost.py --threads 1
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/logprobs_cost.py --method eagle3 --repeats 5
"""
from __future__ import annotations

import argparse
import statistics
import time

import specdec
import torch

from specdec.api import runtime_info
from specdec.bench.suites import load_suite

VARIANTS = {"off": {}, "logprobs": dict(logprobs=True), "top 5": dict(logprobs=True, top_logprobs=5),
            "top 20": dict(logprobs=True, top_logprobs=20),
            "prompt too": dict(logprobs=True, prompt_logprobs=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="none", help="the method generating (default: none)")
    ap.add_argument("--prompts", type=int, default=8, help="mini-suite prompts, one per category (default: 8)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = specdec.load(a.model, method=a.method)
    prompts = [p.turns[0] for p in load_suite("mini")[::3]][:a.prompts]            # one per category first
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for prompt in prompts:
        for _ in range(a.repeats):
            speed, want = {}, None
            for name, kw in VARIANTS.items():
                t0 = time.perf_counter()
                r = gen.generate(prompt, max_new_tokens=a.max_new_tokens, **kw)
                speed[name] = len(r.tokens) / (time.perf_counter() - t0)
                want = want or r.tokens
                assert r.tokens == want, f"{name} changed the output"
            for name in VARIANTS:
                ratios[name].append(speed[name] / speed["off"])
    rt = runtime_info(gen.target)
    print(f"{a.model} {gen.method} ({rt['dtype']}), {a.threads} thread(s), CPU: {rt['cpu']}, torch capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {len(prompts)} prompts x {a.repeats} repeats, "
          f"{a.max_new_tokens} new tokens")
    for name, values in ratios.items():
        print(f"  {name:<11} tokens/s vs off: median {statistics.median(values):.3f} "
              f"(min {min(values):.3f}, max {max(values):.3f})")


if __name__ == "__main__":
    main()
