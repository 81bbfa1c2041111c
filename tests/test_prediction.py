"""Predicted outputs: the client's expected output drafts, for any method, and the output stays the target's."""
from __future__ import annotations

import pytest

from helpers import PROMPTS, V, check_joint, exact_joint, perturbed_copy, run_engine, tiny_generator, tiny_model
from specdec.engine import Request
from specdec.proposers.base import NoProposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.predictions import PredictionIndex
from specdec.reference import reference_greedy
from specdec.sampling import SamplingParams
from specdec.verify import Draft


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
    idx.advance([1, 2], [1, 2], 0)
    assert idx.continuation(2) == [3, 4]
    idx.advance([9], [1, 2, 9], 0)                    # a changed token: no 1..8-gram suffix matches
    assert idx.continuation(2) == []
    idx.advance([5], [1, 2, 9, 5], 0)                 # re-found after "5"
    assert idx.continuation(2) == [6, 7]


def test_realignment_moves_forward_through_the_prediction():
    """A renamed identifier breaks the match; the short suffix after it (here `( x )`, as in every call
    of the function) re-aligns at its next occurrence, not at the first one in the text."""
    f, g, lp, x, rp, nl, other = 10, 11, 12, 13, 14, 15, 16
    prediction = (f, lp, x, rp, nl, other, nl, f, lp, x, rp, nl, other, other, nl, f, lp, x, rp, nl)
    idx = PredictionIndex(prediction)
    out = list(prediction[:7])                                       # the first line and a half, as predicted
    idx.advance(out, out, 0)
    assert idx.at == 7
    out += [g]                                                       # f renamed to g in the second call
    idx.advance([g], out, 0)
    assert idx.at == -1                                              # g is not in the prediction
    out += [lp, x, rp]
    idx.advance([lp, x, rp], out, 0)
    assert idx.at == 11 and idx.continuation(4) == [nl, other, other, nl]   # the second call's `( x )`, not the first


def test_prediction_draft_length_adapts():
    idx = PredictionIndex(tuple(range(1, 40)))
    assert len(idx.continuation(8)) == 8
    idx.advance([1, 2, 3, 4, 5, 6, 7, 8, 9], list(range(1, 10)), 8)          # all 8 accepted + bonus
    assert idx.continuation(8) == list(range(10, 18))
    idx.advance([10, 99], [*range(1, 11), 99], 8)                            # rejected at the second draft
    assert idx.continuation(8) == []                                          # no suffix ending in 99 is in it
    idx.advance([12], [*range(1, 11), 99, 12], 0)                            # re-found, not a prediction step
    assert idx.continuation(8) == [13, 14, 15]
    idx.advance([13, 14, 15, 16], [*range(1, 11), 99, *range(12, 17)], 3)   # all accepted: back to k
    assert idx.continuation(8) == list(range(17, 25))


class CountingProposer:
    """A method that speculates but drafts nothing, counting how often it is asked."""
    name = "counting"
    feature_layers: tuple[int, ...] = ()

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, rows, slots):
        pass

    def start(self, rows, prompts, hidden):
        pass

    def propose(self, batch, k):
        self.calls += 1
        return Draft.empty(len(batch.tokens), batch.rows.device)

    def commit(self, batch, verdict, hidden):
        pass


def test_the_method_does_not_draft_while_the_prediction_does():
    """A sequence that follows its prediction needs no drafts of the method: its proposer is not run."""
    target = tiny_model(seed=7)
    ref = reference_greedy(target, PROMPTS[0], 24)
    inner = CountingProposer()
    seqs = run_engine(target, inner, [Request(list(PROMPTS[0]), 24, prediction=tuple(ref))], "fixed", 3)
    assert seqs[0].generated == ref and seqs[0].counters.accepted_prediction >= 20
    assert inner.calls == 0
    inner = CountingProposer()
    run_engine(target, inner, [Request(list(PROMPTS[0]), 24, prediction=tuple(range(40, 44)))], "fixed", 3)
    assert inner.calls > 0                             # where the prediction has nothing, the method drafts


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


def test_plain_decoding_with_a_prediction_reports_the_acceptance_of_its_drafts():
    """`none` drafts nothing of its own, but a prediction drafts: acceptance is reported (null only where
    nothing was drafted)."""
    target = tiny_model(seed=7)
    gen = tiny_generator(target)
    ref = reference_greedy(target, PROMPTS[0], 30)
    plain = gen.generate(list(PROMPTS[0]), max_new_tokens=30).metrics
    res = gen.generate(list(PROMPTS[0]), max_new_tokens=30, prediction=" ".join(map(str, _edited(ref, 8, 5))))
    assert gen.method == "none" and plain["acceptance_rate"] is None
    assert res.tokens == ref and res.metrics["accepted_prediction_tokens"] > 0
    assert 0 < res.metrics["acceptance_rate"] <= 1


def test_a_row_that_does_not_speculate_drafts_only_from_its_prediction():
    """Plain decoding with a prediction inside a speculative batch (the server's `none` request in another
    method's engine): where the prediction has no continuation it drafts nothing, not the method's drafts."""
    target = tiny_model(seed=7)
    ref = reference_greedy(target, list(PROMPTS[0]), 24)
    wrong = tuple(range(40, 44))                                     # matches nowhere: no continuation
    seqs = run_engine(target, NgramProposer(), [Request(list(PROMPTS[0]), 24, prediction=wrong, speculate=False),
                                                Request(list(PROMPTS[0]), 24)], "fixed", 3)
    off, on = seqs
    assert off.generated == ref == on.generated
    assert off.counters.drafted == 0 and off.counters.target_forwards == 24 and on.counters.drafted > 0
    seqs = run_engine(target, NgramProposer(), [Request(list(PROMPTS[0]), 24, prediction=tuple(ref), speculate=False)],
                      "fixed", 3)
    assert seqs[0].generated == ref and seqs[0].counters.drafted == seqs[0].counters.accepted_prediction \
        + seqs[0].counters.rejected_prediction > 0                   # its prediction's drafts, and only those
