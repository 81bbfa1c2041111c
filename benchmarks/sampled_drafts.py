"""First-draft acceptance of an EAGLE chain's point-mass drafts against sampled ones, on the same contexts.

At every step the method's chain samples its first draft from the head's q (`sample_drafts="on"`); with p the
target's distribution at that position (both through the row's sampling transform), the step adds the
probability that each kind of first draft is accepted there: p(argmax q) for the head's argmax (a point mass),
sum(min(p, q)) = 1 - TV(p, q) for a draft sampled from q. Both are exact expectations on identical contexts,
so the comparison has none of the noise of two separately sampled outputs. With `--coupled N`, a third kind:
a draft coupled to the target's own sample by shared Gumbel noise (draft argmax(log q + G), target
argmax(log p + G), G one Gumbel per token and position), accepted where the two agree: the output would then
be the target's sample whatever the drafts, hence equal for a seed with or without speculation and whatever
the draft length; its acceptance, P(the two argmaxes agree), is estimated over N noise draws per first draft. Prompts: the mini suite's first
`--limit` per category (chat template, multi-turn as the bench runs them), top-p 1, top-k 0, K = 4 fixed; rows
drafted from a prediction (the `edit` category) are left out. Prints one line per temperature; --out writes JSON.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sampled_drafts.py --method eagle3 --temperatures 0.3,0.5,0.7,0.85,1.0,1.2
"""
from __future__ import annotations

import argparse
import json

import torch

from specdec.api import Generator, load_model, make_proposer
from specdec.bench import runner
from specdec.bench.suites import load_suite
from specdec.cli_bench import limit_prompts
from specdec.engine import Engine
from specdec.sampling import to_probs
from specdec.tree import PAD

STEPS: list[tuple[float, ...]] = []   # per first draft: p(argmax q), sum(min(p, q)), Gumbel- and uniform-coupled
_verify = Engine._verify
COUPLED = {"draws": 0}
NOISE = torch.Generator().manual_seed(0)


def same_uniform(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[B]: P(inverse-CDF samples of p and q from one shared uniform agree), exactly: the overlap of each token's
    cumulative interval under p and under q (vocabulary order), summed."""
    P, Q = p.cumsum(-1) / p.sum(-1, keepdim=True), q.cumsum(-1) / q.sum(-1, keepdim=True)
    lo = torch.maximum(P - p / p.sum(-1, keepdim=True), Q - q / q.sum(-1, keepdim=True))
    return (torch.minimum(P, Q) - lo).clamp_min(0).sum(-1)


def coupled(p: torch.Tensor, q: torch.Tensor, draws: int) -> torch.Tensor:
    """[B]: P(argmax(log p + G) == argmax(log q + G)) for p, q [B, V], G iid Gumbel, over `draws` draws."""
    if not draws:
        return torch.full(p.shape[:1], float("nan"))
    hits = torch.zeros(p.shape[0])
    lp, lq = p.clamp_min(0).log(), q.clamp_min(0).log()                    # log 0 = -inf: never the argmax
    for _ in range(draws):
        g = -torch.log(-torch.log(torch.rand(p.shape, generator=NOISE).clamp(1e-12, 1 - 1e-7)))
        hits += ((lp + g).argmax(-1) == (lq + g).argmax(-1)).float()
    return hits / draws


def _recording_verify(self, batch, draft, pending, scored):
    if draft.probs is not None and draft.tokens.shape[1]:
        q, p = draft.probs[:, 0], to_probs(scored.logits, batch.sampling)[:, 0]   # [B, V] the first draft's q, p
        rows = (draft.tokens[:, 0] != PAD) & draft.sampled & ~draft.predicted
        point = p.gather(-1, q.argmax(-1, keepdim=True))[:, 0]
        sampled = torch.minimum(p, q).sum(-1)
        both = coupled(p.float(), q.float(), COUPLED["draws"])
        one_u = same_uniform(p.double(), q.double())
        STEPS.extend((float(point[i]), float(sampled[i]), float(both[i]), float(one_u[i]))
                     for i in rows.nonzero().flatten().tolist())
    return _verify(self, batch, draft, pending, scored)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="eagle3", choices=("eagle", "eagle3"))
    ap.add_argument("--temperatures", default="0.3,0.5,0.7,0.85,1.0,1.2")
    ap.add_argument("--limit", type=int, default=2, help="prompts per category")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    ap.add_argument("--coupled", type=int, default=0, metavar="N",
                    help="also estimate Gumbel-coupled drafts' acceptance over N noise draws per first draft")
    a = ap.parse_args()
    COUPLED["draws"] = a.coupled
    torch.set_num_threads(a.threads)
    Engine._verify = _recording_verify
    target, tok, name = load_model(a.model, "auto", "cpu")
    prompts = limit_prompts(load_suite("mini", None), a.limit)
    proposer = make_proposer(a.method, target, tok, None, "auto", "cpu", sample_drafts="on")
    system = runner.MethodSystem(a.method, Generator(target, tok, proposer, "fixed", 4, name))
    print(f"{name}, {a.method} chain, {len(prompts)} prompts, seed {a.seed}: expected first-draft acceptance")
    print("temperature  first drafts  point mass  sampled  steps where sampled is higher  coupled  one uniform")
    figures = {}
    for t in (float(x) for x in a.temperatures.split(",")):
        STEPS.clear()
        runner.run([system], prompts, tok, 1, runner.SamplingParams(t, seed=a.seed), progress=False, warmup=False)
        n = len(STEPS)
        point, sampled = sum(s[0] for s in STEPS) / n, sum(s[1] for s in STEPS) / n
        higher = sum(s[1] > s[0] for s in STEPS) / n
        both, one_u = sum(s[2] for s in STEPS) / n, sum(s[3] for s in STEPS) / n
        figures[t] = {"first_drafts": n, "point_mass": point, "sampled": sampled, "sampled_higher": higher,
                      "one_uniform": one_u}
        if a.coupled:
            figures[t]["coupled"] = both
        print(f"{t:11.2f}  {n:12d}  {point:10.3f}  {sampled:7.3f}  {higher:29.2f}  "
              + (f"{both:7.3f}" if a.coupled else "      -") + f"  {one_u:11.3f}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": name, "method": a.method, "prompts": len(prompts), "seed": a.seed,
                       "figures": figures}, f, indent=1)


if __name__ == "__main__":
    main()
