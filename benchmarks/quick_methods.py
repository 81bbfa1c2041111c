"""A quick side-by-side of speculative methods on a few real prompts (greedy, one run, same process).

Every 3rd prompt of the mini suite (6 prompts, all categories), 64 new tokens, bfloat16, batch 1;
methods interleaved per prompt; prints tokens/s (summed tokens / summed wall time) and tau, and
flags any greedy output that differs from `none`'s. The full benchmark is `specdec bench`.

    .venv/bin/python benchmarks/quick_methods.py none,ngram,eagle,medusa [K]
"""
import sys

import torch

from specdec.api import Generator, load_model, make_proposer
from specdec.bench.suites import load_suite

torch.set_num_threads(2)
target, tok, name = load_model("smollm2-135m", "bfloat16")
ps = [p.turns[0] for p in load_suite("mini")][::3][:6]
methods = sys.argv[1].split(",")
k = int(sys.argv[2]) if len(sys.argv) > 2 else 4
gens = {m: Generator(target, tok, make_proposer(m, target, tok, None, "bfloat16", "cpu"), "fixed", k, name)
        for m in methods}
tot = {m: [0, 0.0, 0] for m in methods}
base = {}
for p in ps:
    for m, g in gens.items():
        r = g.generate(p, max_new_tokens=64)
        tot[m][0] += r.metrics["new_tokens"]
        tot[m][1] += r.metrics["wall_seconds"]
        tot[m][2] += r.metrics["target_forwards"]
        if m == methods[0]:
            base[p] = r.tokens
        elif r.tokens != base[p]:
            print("MISMATCH", m, repr(p[:60]))
ref = tot[methods[0]][0] / tot[methods[0]][1]
for m, (n, s, f) in tot.items():
    print(f"{m}: {n / s:.1f} tokens/s ({n / s / ref:.2f}x {methods[0]}), tau {n / f:.2f}")
