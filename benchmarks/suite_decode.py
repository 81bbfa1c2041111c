"""A suite's time split into prefill and decoding, for one method (no peers, no report).

Runs each prompt of a benchmark suite (first turn, chat template, its token budget) twice through the engine:
for one new token (the prompt's prefill and first token) and for its budget, greedy, batch 1; prints the summed
seconds of both, the tokens/s of the whole (as `specdec bench` counts it: prefill included) and of the decoding
alone (the difference). Useful to A/B a change of the decoding step where the suite's prefill would hide it.
With --llamacpp, llama.cpp's own decode loop (the bench's `llama.cpp-loop` peer: llama-cpp-python's low-level API,
same ids, same threads) runs each prompt the same two ways right after ours, and its split is printed too:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/suite_decode.py --threads 1 [--llamacpp]
    OMP_NUM_THREADS=1 PYTHONPATH=/path/to/other/checkout/src .venv/bin/python benchmarks/suite_decode.py --threads 1
"""
from __future__ import annotations

import argparse
import time

import specdec  # (applies $SPECDEC_ISA before torch computes)
import torch

from specdec.bench.peers import llamacpp_peers
from specdec.bench.runner import turn_ids
from specdec.bench.suites import SUITES, load_suite
from specdec.engine import Request
from specdec.machine import cpu_model
from specdec.models.registry import resolve
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
    ap.add_argument("--llamacpp", action="store_true", help="time llama.cpp's decode loop the same way, interleaved")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = specdec.load(a.model, method=a.method, dtype=a.dtype)
    prompts = [(turn_ids(gen.tokenizer, p.turns[:1], []), p.max_new_tokens) for p in load_suite(a.suite)]
    runners = {f"specdec {a.method} ({gen.target.compute})": lambda ids, new: timed(gen, ids, new)}
    if a.llamacpp:
        loop = llamacpp_peers(resolve(a.model)[1], gen.tokenizer.eos_ids)[1]        # llama.cpp-loop

        def llama(ids: list[int], new: int) -> tuple[float, int]:
            g = loop.generate(ids, new, SamplingParams())
            return g.seconds, len(g.tokens)
        runners["llama.cpp-loop"] = llama
    totals = {name: [0.0, 0.0, 0] for name in runners}                            # prefill s, whole s, tokens
    for run in runners.values():
        run(prompts[0][0], 16)                                                     # warm-up
    for ids, budget in prompts:
        for name, run in runners.items():
            t = totals[name]
            t[0] += run(ids, 1)[0]
            s, n = run(ids, budget)
            t[1], t[2] = t[1] + s, t[2] + n
    print(f"{a.model}, {len(prompts)} prompts of the {a.suite} suite, {a.threads} thread(s), {cpu_model()}, specdec "
          f"from {specdec.__file__.removesuffix('/__init__.py')}")
    for name, (first, whole, tokens) in totals.items():
        print(f"{name}: {tokens} tokens in {whole:.2f} s = {tokens / whole:.1f} tokens/s; prefill and first token "
              f"{first:.2f} s; decoding alone {(tokens - len(prompts)) / (whole - first):.1f} tokens/s")


if __name__ == "__main__":
    main()
