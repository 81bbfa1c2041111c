"""Where a decoding step of the engine spends its time outside the layer loop and the LM head.

Runs `none` (greedy, batch 1) through `specdec.load` once for one token and once for 1 + `--tokens`, and prints
per decoding step (the difference, so the prefill does not count) the wall time and the time inside the engine's
and the model's methods (inclusive: `_score` holds `_forward`, which holds the layer loop). The timers add about
a microsecond per call.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/step_parts.py --threads 2
"""
from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable

import specdec  # (applies $SPECDEC_ISA before torch computes)
import torch

from profile_token import STEP_PROMPT, Timed
from specdec import engine
from specdec.machine import cpu_model
from specdec.models import decoder

ENGINE = ("step", "_speculate", "_propose", "_score", "_verify", "_commit", "_note_logprobs", "_record",
          "_check_end", "_emit")
MODEL = ("_forward", "final_norm", "lm_head", "embed_tokens")


def timed(fn: Callable, label: str, seconds: dict[str, float]) -> Callable:
    def run(*args, **kw):
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            seconds[label] += time.perf_counter() - t
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--tokens", type=int, default=256, help="decoding steps timed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = specdec.load(args.model, method="none", dtype=args.dtype, draft_policy="fixed")
    seconds: dict[str, float] = collections.defaultdict(float)
    for name in ENGINE:
        setattr(engine.Engine, name, timed(getattr(engine.Engine, name), name, seconds))
    for name in MODEL:
        setattr(decoder.Transformer, name, timed(getattr(decoder.Transformer, name), name, seconds))
    loop = gen.target.loop = Timed(gen.target.loop) if gen.target.loop is not None else None
    prompt = STEP_PROMPT
    gen.generate(prompt, max_new_tokens=8)                                     # warm-up
    runs = []
    for n in (1, 1 + args.tokens):
        seconds.clear()
        in_loop = loop.seconds if loop else 0.0
        t = time.perf_counter()
        res = gen.generate(prompt, max_new_tokens=n)
        runs.append((time.perf_counter() - t, dict(seconds), len(res.tokens)))
        if loop:
            runs[-1][1]["layer loop"] = loop.seconds - in_loop
    (w0, s0, n0), (w1, s1, n1) = runs
    steps = n1 - n0
    print(f"{args.model} {gen.target.dtype if gen.target.loop is None else 'q4'}, {args.threads} thread(s), "
          f"{cpu_model()}, torch {torch.__version__} kernels {torch.backends.cpu.get_cpu_capability()}")
    print(f"per decoding step ({steps} steps): {(w1 - w0) / steps * 1e3:.3f} ms")
    for label in sorted(s1, key=lambda k: s0.get(k, 0.0) - s1[k]):
        print(f"  {label:16s} {(s1[label] - s0.get(label, 0.0)) / steps * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
