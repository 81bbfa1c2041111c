"""Predicted outputs: the client's expected output drafts, for any method, and the output stays the target's."""
from __future__ import annotations

import pytest
import torch

from helpers import PROMPTS, V, check_joint, exact_joint, perturbed_copy, run_engine, tiny_model
from specdec.engine import Request
from specdec.proposers.base import NoProposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.prediction import PredictionIndex
from specdec.reference import reference_greedy
from specdec.sampling import SamplingParams


def _edited(tokens: list[int], at: int, by: int) -> tuple[int, ...]:
    """The reference output with one token changed and one inserted: a prediction that is mostly right."""
    out = list(tokens)
    out[at] = (out[at] + by) % 97
    out.insert(at + 3, 1)
    return tuple(out)


@pytest.mark.parametrize("inner", ["none", "ngram", "draft"])
@pytest.mark.parametrize("batch", [1, 3])
def test_prediction_is_lossless_and_accepted(inner, batch):
    target = tiny_model(seed=7)
    refs = [reference_greedy(target, p, 30) for p in PROMPTS[:batch]]
    reqs = [Request(list(p), 30, prediction=_edited(r, 8, 5)) for p, r in zip(PROMPTS[:batch], refs)]
    prop = {"none": NoProposer, "ngram": NgramProposer,
            "draft": lambda: DraftModelProposer(perturbed_copy(target, 0.05))}[inner]()
    seqs = run_engine(target, prop, reqs, "fixed", 3)
    for s, r in zip(seqs, refs):
        assert s.generated == r
        c = s.counters
        assert c.accepted_prediction >= 20 and c.rejected_prediction >= 1          # re-aligned after the edit
        assert c.target_forwards < 12


def test_a_wrong_prediction_costs_nothing_but_rows():
    target = tiny_model(seed=7)
    ref = reference_greedy(target, PROMPTS[0], 20)
    seqs = run_engine(target, NoProposer(), [Request(list(PROMPTS[0]), 20, prediction=tuple(range(40, 60)))], "fixed", 3)
    assert seqs[0].generated == ref and seqs[0].counters.accepted_prediction == 0


def test_alignment_follows_and_refinds():
    idx = PredictionIndex((1, 2, 3, 4, 5, 6, 7, 8))
    assert idx.continuation(3) == [1, 2, 3]
    idx.advance([1, 2], [1, 2])
    assert idx.continuation(2) == [3, 4]
    idx.advance([9], [1, 2, 9])                       # a changed token: no 1..8-gram suffix matches
    assert idx.continuation(2) == []
    idx.advance([5], [1, 2, 9, 5])                    # re-found after "5"
    assert idx.continuation(2) == [6, 7]


@pytest.mark.slow        # 20,000 sequences: `make test`
def test_prediction_sampling_matches_exact_distribution():
    target = tiny_model(seed=20, vocab=V, std=0.5)
    params = SamplingParams(1.0, 6, 0.95)
    prompt = [1, 2, 3]
    exact = exact_joint(target, prompt, params)
    likely = max(exact, key=exact.get)
    reqs = [Request(list(prompt), len(likely), SamplingParams(1.0, 6, 0.95, seed), prediction=likely)
            for seed in range(20_000)]
    samples = [tuple(s.generated) for s in run_engine(target, DraftModelProposer(perturbed_copy(target, 0.1)), reqs,
                                                       "fixed", 3)]
    assert check_joint(samples, exact) > 1e-3
