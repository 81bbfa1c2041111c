"""A suite's time split into prefill and decoding, for one method (no peers, no report).

Runs each prompt of a benchmark suite (first turn, chat template, its token budget) twice through the engine:
for one new token (the prompt's prefill and first token) and for its budget, greedy, batch 1; prints the summed
seconds of both, the tokens/s of the whole (as `specdec bench` counts it: prefill included) and of the decoding
alone (the difference). Useful to A/B a change of the decoding step where the suite's prefill would hide it:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/suite_decode.py --threads 1
    OMP_NUM_THREADS=1 PYTHONPATH=/path/to/other/checkout/src .venv/bin/python benchmarks/suite_decode.py --threads 1
"""
from __future__ import annotations

import argparse
import time

import specdec  # (applies $SPECDEC_ISA before torch computes)
import torch

from specdec.bench.runner import turn_ids
from specdec.bench.suites import SUITES, load_suite
from specdec.engine import Request
from specdec.machine import cpu_model
from specdec.sampling import SamplingParams


def timed(gen: specdec.Generator, ids: list[int], new: int) -> tuple[float, int]:
    """Seconds and tokens of one greedy generation of up to `new` tokens after `ids`, engine steps only."""
    start = time.perf_counter()
    eng = gen.engine(1, len(ids) + new + 64)
    seq = eng.add(Request(list(ids), new, SamplingParams()))
    with torch.inference_mode():
        while eng.busy:
            eng.step()
    return time.perf_counter() - start, seq.num_generated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--method", default="none")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--suite", default="mini", choices=SUITES)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = specdec.load(a.model, method=a.method, dtype=a.dtype)
    prompts = [(turn_ids(gen.tokenizer, p.turns[:1], []), p.max_new_tokens) for p in load_suite(a.suite)]
    timed(gen, prompts[0][0], 16)                                                  # warm-up
    first = whole = 0.0
    tokens = 0
    for ids, budget in prompts:
        first += timed(gen, ids, 1)[0]
        s, n = timed(gen, ids, budget)
        whole, tokens = whole + s, tokens + n
    print(f"{a.model} {a.method} ({gen.target.compute}), {a.threads} thread(s), {cpu_model()}, specdec from "
          f"{specdec.__file__.removesuffix('/__init__.py')}")
    print(f"{len(prompts)} prompts, {tokens} tokens in {whole:.2f} s = {tokens / whole:.1f} tokens/s; prefill and first "
          f"token {first:.2f} s; decoding alone {(tokens - len(prompts)) / (whole - first):.1f} tokens/s")


if __name__ == "__main__":
    main()
