"""Replay a greedy benchmark's recorded outputs through model-free proposers (ngram, suffix), without the
target: greedy verification accepts a draft exactly where it equals the recorded output, so the drafted
rows, accepted tokens and target forwards of every step follow from the proposer alone. Prompts are
replayed in the benchmark's order through one proposer, so suffix decoding's global index grows as in
`specdec bench`.

    .venv/bin/python benchmarks/replay_drafts.py docs/benchmarks/mini/results.json --methods ngram,suffix

Prints per category: tau, drafted rows per target forward, and a modelled speedup over plain decoding,
sum(cost(1)) / sum(cost(rows of each forward)), with the forward cost of n scored rows from
`benchmarks/forward_cost.py` (`--chain-cost`, `--tree-cost`; defaults measured on smollm2-135m q4, one
thread: chain 1/3/5/9 rows 1.00/1.14/1.47/2.07, a tree 1.3x a chain of as many rows). Proposer time is not
modelled: compare with the benchmark's measured speedups.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np
import torch

from specdec.api import resolve
from specdec.bench.runner import turn_ids
from specdec.bench.suites import load_suite
from specdec.proposers.base import ActiveBatch
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer
from specdec.models.tokenizer import Tokenizer
from specdec.tree import PAD


def make(method: str):
    name, _, args = method.partition(":")
    kwargs = {k: float(v) if "." in v else int(v) for k, v in (a.split("=") for a in args.split(";") if a)}
    return {"ngram": NgramProposer, "suffix": SuffixProposer}[name](**kwargs)


def cost(rows: int, tree: bool, chain_rows: list[int], chain_cost: list[float], tree_cost: float) -> float:
    c = float(np.interp(rows, chain_rows, chain_cost))
    return c * (tree_cost if tree else 1.0)


def accepted(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Greedy walk of a draft tree against the recorded continuation."""
    node, depth = -1, 0
    while depth < len(truth):
        nxt = [i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == truth[depth]]
        if not nxt:
            break
        node, depth = nxt[0], depth + 1
    return depth


def replay(proposer, sequences: list[tuple[str, list[int], list[int]]], k: int, chain_rows, chain_cost,
           tree_cost) -> dict[str, dict]:
    per: dict[str, dict] = defaultdict(lambda: {"tokens": 0, "forwards": 0, "rows": 0, "cost": 0.0, "base": 0.0})
    proposer.allocate(1, 1)
    rows = torch.zeros(1, dtype=torch.long)
    for category, prompt, out in sequences:
        proposer.start(rows, [prompt + out[:1]], torch.zeros(1, 1, 1))
        s, pos = per[category], 1
        s["tokens"] += len(out)
        s["base"] += len(out) * cost(1, False, chain_rows, chain_cost, tree_cost)
        while pos < len(out):
            draft = proposer.propose(ActiveBatch(rows, [prompt + out[:pos]], None, rows), min(k, len(out) - pos))
            toks, pars = draft.tokens[0].tolist(), draft.parents[0].tolist()
            keep = [i for i, t in enumerate(toks) if t != PAD]
            toks, pars = [toks[i] for i in keep], [pars[i] for i in keep]
            a = accepted(toks, pars, out[pos:])
            s["forwards"] += 1
            s["rows"] += 1 + len(toks)
            s["cost"] += cost(1 + len(toks), not draft.is_chain, chain_rows, chain_cost, tree_cost)
            pos += a + 1
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a greedy `specdec bench` results.json")
    ap.add_argument("--methods", default="ngram,suffix",
                    help="comma-separated; NAME:key=value;key=value sets a proposer's arguments "
                         "(e.g. suffix:min_prob=0.2)")
    ap.add_argument("--system", default="none", help="whose recorded outputs to replay")
    ap.add_argument("-k", type=int, default=4, help="drafts per step, K")
    ap.add_argument("--chain-rows", default="1,3,5,9")
    ap.add_argument("--chain-cost", default="1.0,1.14,1.47,2.07")
    ap.add_argument("--tree-cost", type=float, default=1.3)
    a = ap.parse_args()
    results = json.load(open(a.results))
    if results["config"].get("temperature", 0.0) != 0.0:
        raise SystemExit("replay needs a greedy benchmark (temperature 0)")
    _, path = resolve(results["config"]["model"])
    tokenizer = Tokenizer.from_gguf(path)
    prompts = {p.id: p for p in load_suite(results["config"]["suite"])}
    sequences = []
    for run in results["runs"]:
        if run["system"] != a.system or run["repeat"] != 0:
            continue
        prompt, answers = prompts[run["prompt_id"]], []
        for index, out in enumerate(run["tokens"]):
            sequences.append((prompt.category, turn_ids(tokenizer, prompt.turns[: index + 1], answers), out))
            answers.append(tokenizer.decode([t for t in out if t not in tokenizer.eos_ids]))
    chain_rows = [int(x) for x in a.chain_rows.split(",")]
    chain_cost = [float(x) for x in a.chain_cost.split(",")]
    table: dict[str, dict[str, dict]] = {}
    for method in a.methods.split(","):
        table[method] = replay(make(method), sequences, a.k, chain_rows, chain_cost, a.tree_cost)
    categories = list(next(iter(table.values())))
    print(f"{'method':<32}" + "".join(f"{c:>14}" for c in categories + ["overall"]))
    for method, per in table.items():
        cells = []
        for c in categories + ["overall"]:
            rows = list(per.values()) if c == "overall" else [per[c]]
            t, f = sum(r["tokens"] for r in rows), sum(r["forwards"] for r in rows)
            speed = sum(r["base"] for r in rows) / max(1e-9, sum(r["cost"] for r in rows))
            cells.append(f"{speed:6.2f}x t{t / max(f, 1):4.2f}")
        print(f"{method:<32}" + "".join(f"{x:>14}" for x in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
