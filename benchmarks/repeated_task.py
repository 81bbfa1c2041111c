"""The same task again and again with different inputs (an agent's or a pipeline's workload), one request
after another through one Generator per method, so `suffix` can learn from earlier outputs.

    .venv/bin/python benchmarks/repeated_task.py --requests 16 --methods none,ngram,suffix

Prints, per method, tokens/s over the requests after the first `--warmup` (median of per-request
speedups over `none`), tau, and whether every output equals `none`'s.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import torch

import specdec
from specdec.machine import cpu_model

NAMES = ["Alice Martin", "Bob Chen", "Carla Diaz", "David Okafor", "Elena Petrova", "Farid Haddad", "Grace Kim",
         "Hugo Laurent", "Ines Costa", "Jonas Berg", "Keiko Sato", "Liam Walsh", "Maya Singh", "Noah Fischer",
         "Olga Ivanova", "Pablo Ruiz", "Quinn Taylor", "Rosa Moretti", "Samir Nasser", "Tara Novak"]
CITIES = ["Lisbon", "Toronto", "Nairobi", "Osaka", "Lyon", "Denver", "Krakow", "Perth", "Bergen", "Quito"]
TASK = ("Extract the person's details from the note below and answer with a JSON object with the keys "
        '"name", "city", "age" and "job".\n\nNote: {name} is {age} years old, lives in {city} and works as a {job}.')
JOBS = ["teacher", "nurse", "software engineer", "carpenter", "pilot", "chef", "lawyer", "farmer"]


def prompts(n: int) -> list[str]:
    return [TASK.format(name=NAMES[i % len(NAMES)], city=CITIES[(3 * i) % len(CITIES)], age=21 + (7 * i) % 50,
                        job=JOBS[(5 * i) % len(JOBS)]) for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="none,ngram,suffix")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4, help="first requests not timed (they fill the indexes)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    ps = prompts(a.requests)
    methods = a.methods.split(",")
    results: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    for m in methods:
        gen = specdec.load(a.model, method=m)
        seconds, tokens, forwards, outs = [], [], [], []
        for p in ps:
            r = gen.generate(p, max_new_tokens=a.max_new_tokens)
            outs.append(r.tokens)
            seconds.append(r.metrics["wall_seconds"])
            tokens.append(r.metrics["new_tokens"])
            forwards.append(r.metrics["target_forwards"])
        outputs[m] = outs
        w = a.warmup
        results[m] = {"tokens_per_second": sum(tokens[w:]) / sum(seconds[w:]), "tau": sum(tokens[w:]) / sum(forwards[w:]),
                      "per_request_seconds": seconds}
    base = results[methods[0]]
    print(f"{cpu_model()}, torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, {platform.python_version()}; {a.requests} requests, "
          f"first {a.warmup} untimed")
    for m in methods:
        r = results[m]
        ratios = [b / s for b, s in zip(base["per_request_seconds"][a.warmup:], r["per_request_seconds"][a.warmup:])]
        r["median_speedup"] = statistics.median(ratios)
        r["equal_to_first"] = outputs[m] == outputs[methods[0]]
        print(f"{m:<8} {r['tokens_per_second']:6.1f} tok/s  tau {r['tau']:.2f}  median speedup "
              f"{r['median_speedup']:.2f}x  equal to {methods[0]}: {r['equal_to_first']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_model(), "results": results}, f, indent=2)
    return 0 if all(r["equal_to_first"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
