"""Shared test helpers: prompts, exact enumerated distributions, many sequences sampled through the
engine, tiny EAGLE / Medusa heads. Imported by the test files (which never import each other)."""
from __future__ import annotations

import numpy as np
import torch

from specdec.draft_length import make_policy
from specdec.engine import Engine, Request, Sequence
from specdec.models.eagle import EagleHead
from specdec.models.medusa import MedusaHeads
from specdec.prefix_cache import PrefixCache
from specdec.proposers.base import Proposer
from specdec.reference import exact_distribution
from specdec.sampling import BatchSampling, SamplingParams, to_probs

from conftest import chi2_pvalue, perturbed_copy, tiny_model

PROMPTS = [[3, 5, 7, 9], list(range(10, 28)), [42, 1, 42, 1, 42]]
V, NEW, N = 8, 4, 20_000            # chi-square tests: vocabulary, continuation length, sequences


def rng(seed: int) -> torch.Generator:
    """A seeded torch generator for test data."""
    return torch.Generator().manual_seed(seed)


def exact_joint(model, prompt: list[int], params: SamplingParams, new: int = NEW) -> dict[tuple, float]:
    """P(whole `new`-token continuation) under the transform, by enumeration."""
    s = BatchSampling.of([params])
    frontier = [((), 1.0)]
    for _ in range(new):
        nxt = []
        for path, pr in frontier:
            p = to_probs(exact_distribution(model, prompt + list(path))[None, None], s)[0, 0]
            for t in torch.nonzero(p).flatten().tolist():
                nxt.append((path + (t,), pr * float(p[t])))
        frontier = nxt
    return dict(frontier)


def run_engine(target, proposer: Proposer, requests: list[Request], policy: str = "fixed", k: int = 3,
               slots: int = 0) -> list[Sequence]:
    """Decode `requests` as one batch (prefilled in one step) with `policy` drafting up to k tokens."""
    target.pack()                 # packed weights (as every loaded model has): equal prompts share a prefill
    budget = sum(len(r.prompt) for r in requests)
    eng = Engine(target, proposer, make_policy(policy, k), lambda ids: "", frozenset(), PrefixCache(0), budget)
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    eng.allocate(len(requests), slots or longest + 2 * max(k, 8) + 20)      # room for trees and `auto`'s K
    seqs = [eng.add(r) for r in requests]
    with torch.inference_mode():
        while eng.busy:
            eng.step()
    return seqs


def sample_engine(target, proposer: Proposer, params: SamplingParams | list[SamplingParams], prompt: list[int],
                  n: int = N, k: int = 3, policy: str = "fixed", new: int = NEW) -> list[tuple]:
    """n continuations of `prompt` (sequence i with seed i; params: one for all or one per sequence)."""
    per = params if isinstance(params, list) else [params] * n
    reqs = [Request(list(prompt), new, SamplingParams(p.temperature, p.top_k, p.top_p, seed))
            for seed, p in zip(range(n), per)]
    return [tuple(s.generated) for s in run_engine(target, proposer, reqs, policy, k)]


def check_joint(samples: list[tuple], exact: dict[tuple, float]) -> float:
    """Chi-square p-value of the samples' continuations against the exact distribution."""
    keys = sorted(exact)
    index = {key: i for i, key in enumerate(keys)}
    assert all(s in index for s in samples), "sampled a continuation of probability zero"
    obs = np.bincount([index[s] for s in samples], minlength=len(keys))
    return chi2_pvalue(obs, np.array([exact[k] for k in keys]), len(samples))


def close_draft():
    """The target of the chi-square tests with noise on every weight: acceptance high but not certain."""
    return perturbed_copy(tiny_model(seed=20, vocab=V, std=0.5), 0.1)


def head_for(target, seed: int = 0, vocab: torch.Tensor | None = None) -> EagleHead:
    """A randomly initialised EAGLE head for `target` (over `vocab`, default all tokens)."""
    torch.manual_seed(seed)
    ids = torch.arange(target.vocab_size) if vocab is None else vocab
    return EagleHead(target, ids).prepare(torch.float32)


def heads_for(target, n: int = 3, seed: int = 0, vocab: torch.Tensor | None = None) -> MedusaHeads:
    """n random Medusa heads over `vocab` (default every third token)."""
    torch.manual_seed(seed)
    h = MedusaHeads(target, torch.arange(0, target.vocab_size, 3) if vocab is None else vocab, n)
    with torch.no_grad():
        h.w.normal_(0, 0.2)
    return h.prepare(torch.float32)


def stream_engine(target, proposer: Proposer, requests: list[Request], policy: str = "auto", k: int = 3,
                  rows: int = 4) -> list[Sequence]:
    """Decode `requests` through `rows` slots, each newcomer joining as a sequence finishes (the server's
    continuous batching): batches of changing composition, and `auto` sees small batches, where it drafts."""
    target.pack()
    eng = Engine(target, proposer, make_policy(policy, k), lambda ids: "", frozenset())
    eng.allocate(rows, max(len(r.prompt) + r.max_new_tokens for r in requests) + 2 * max(k, 8) + 20)
    waiting, seqs = list(reversed(requests)), []
    with torch.inference_mode():
        while waiting or eng.busy:
            while waiting and eng.free:
                seqs.append(eng.add(waiting.pop()))
            eng.step()
    return seqs
