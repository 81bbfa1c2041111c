"""Hybrid proposer (prompt lookup where the text repeats, EAGLE chain elsewhere): lossless, both paths used."""
from __future__ import annotations

import math

import pytest

from specdec.api import AUTO_SAMPLE_FROM
from specdec.errors import SpecdecError
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.hybrid import HybridProposer
from specdec.proposers.ngram import NgramProposer
from specdec.reference import reference_greedy
from specdec.sampling import SamplingParams
from specdec.tree import PAD

from helpers import V, Recording, check_joint, exact_joint, head_for, sample_engine, tiny_generator, tiny_model

# repeats in the prompts give prompt lookup matches of length >= 2, the rest falls to EAGLE
PROMPTS = [[3, 5, 7, 9, 3, 5, 7], list(range(10, 28)), [42, 1, 42, 1, 42, 1]]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("min_match", [1, 2])
def test_hybrid_greedy_equals_plain(k, batch, min_match):
    target = tiny_model(seed=7)
    prop = HybridProposer(EagleProposer(head_for(target), 1, k, k), NgramProposer(1, 4), min_match)
    gen = tiny_generator(target, prop, "fixed", k)
    for p, r in zip(PROMPTS[:batch], gen.generate(PROMPTS[:batch], max_new_tokens=30)):
        assert r.tokens == reference_greedy(target, p, 30)
    assert prop.steps_eagle > 0
    if min_match == 1:                           # a unigram match exists from the first step on
        assert prop.steps_ngram > 0


def test_hybrid_uses_both_proposers_within_one_batch():
    target = tiny_model(seed=7)
    prop = HybridProposer(EagleProposer(head_for(target), 1, 4, 4), NgramProposer(1, 4), 2)
    gen = tiny_generator(target, prop, "fixed", 4)
    rs = gen.generate(PROMPTS, max_new_tokens=20)
    assert [r.tokens for r in rs] == [reference_greedy(target, p, 20) for p in PROMPTS]
    assert prop.steps_ngram > 0 and prop.steps_eagle > 0


@pytest.mark.slow        # 20,000 sequences: `make test`; fast loop: test_seeds.py (plain sampling's tokens)
@pytest.mark.parametrize("params, sample_from", [(SamplingParams(0.7, 5, 0.9), math.inf),
                                                 (SamplingParams(1.0, 6, 0.95), AUTO_SAMPLE_FROM)],
                         ids=["t0.7-point-masses", "t1.0-sampled-eagle-drafts"])
def test_hybrid_sampling_matches_exact_distribution(params, sample_from):
    """Prompt lookup's point masses beside EAGLE chains of point masses, or (at 1.0, as `auto` does) of
    drafts sampled from the head's q, in the same batch and sequence: the target's distribution."""
    target = tiny_model(seed=20, vocab=V, std=0.5)
    prompt = [1, 2, 3, 1, 2]
    prop = Recording(HybridProposer(EagleProposer(head_for(target), 1, 3, 3, sample_from=sample_from),
                                    NgramProposer(1, 3), 1))
    samples = sample_engine(target, prop, params, prompt, n=20_000, k=3)
    assert prop.steps_ngram > 0 and prop.steps_eagle > 0
    kinds = {bool(x) for d in prop.drafts for x in d.sampled}
    assert kinds == ({False, True} if sample_from <= params.temperature else {False})
    assert check_joint(samples, exact_joint(target, prompt, params)) > 1e-3


def test_hybrid_samples_its_eagle_drafts_only_and_keeps_greedy_rows_plain():
    """With sampled EAGLE drafts, rows drafted by prompt lookup stay point masses (verified as such) within
    the same step; sampled output is reproducible for a seed and K; greedy output equals plain decoding."""
    target = tiny_model(seed=7)
    prop = Recording(HybridProposer(EagleProposer(head_for(target), 1, 4, 4, sample_from=0.0), NgramProposer(1, 4), 1))
    gen = tiny_generator(target, prop, "fixed", 4)
    a = gen.generate(PROMPTS, max_new_tokens=20, temperature=1.0, seed=4)
    mixed = [d for d in prop.drafts if d.probs is not None and 0 < int(d.sampled.sum()) < len(d.sampled)]
    assert mixed                                                 # lookup and sampled EAGLE rows in one step
    for d in mixed:
        point = ~d.sampled
        one_hot = d.probs[point].amax(-1) == 1                   # [rows, K]
        assert bool((one_hot | (d.tokens[point] == PAD)).all())
    b = gen.generate(PROMPTS, max_new_tokens=20, temperature=1.0, seed=4)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    greedy = gen.generate(PROMPTS, max_new_tokens=20)
    assert [r.tokens for r in greedy] == [reference_greedy(target, p, 20) for p in PROMPTS]


def test_hybrid_needs_a_chain():
    target = tiny_model(seed=7)
    with pytest.raises(SpecdecError, match="topk = 1"):
        HybridProposer(EagleProposer(head_for(target), 2, 3, 6), NgramProposer(), 2)
