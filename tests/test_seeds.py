"""Seeded sampling: a sequence's samples depend on its seed alone (not on its batch-mates, the draft
length, the draft policy or the clock), and every point-mass method samples, token for token, what
plain sampling does with the same seed."""
from __future__ import annotations

import pytest
import torch

from specdec.engine import Request
from specdec.proposers.base import NoProposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.hybrid import HybridProposer
from specdec.proposers.lookahead import LookaheadProposer, LookaheadShape
from specdec.proposers.medusa import MedusaProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.staged import StagedProposer
from specdec.proposers.suffix import SuffixProposer
from specdec.sampling import SamplingParams

from helpers import V, close_draft, head_for, heads_for, run_engine, tiny_generator, tiny_model

pytestmark = pytest.mark.exactness           # equalities that rest on row-invariant kernels

SAMPLED = dict(temperature=1.0, top_p=0.9, top_k=6)
# V = 8 tokens: point-mass drafts are often the target's sample, so steps accept as well as reject
PROMPTS = [[1, 2, 3, 1, 2], [0, 7, 5, 6, 4, 3, 2, 1, 0, 7], [4, 4, 4, 4], [6, 1]]
OTHERS = [[5, 5, 1, 0, 3, 2], [2, 7], [3, 3, 6, 1, 4, 0, 0, 2, 1], [7, 0, 7]]


def target_v8():
    return tiny_model(seed=20, vocab=V, std=0.5)


def point_mass_proposer(method: str, target, k: int):
    """A fresh deterministic proposer of each kind (chains with confidence cut-offs, trees)."""
    if method == "ngram":
        return NgramProposer(1, 3)
    if method == "eagle":
        return EagleProposer(head_for(target), 1, k, k, min_confidence=0.3)
    if method == "eagle_tree":
        return EagleProposer(head_for(target), 2, min(k, 3), 6)
    if method == "hybrid":
        return HybridProposer(EagleProposer(head_for(target), 1, k, k, min_confidence=0.3), NgramProposer(1, 3), 2)
    if method == "medusa":
        return MedusaProposer(heads_for(target, 3, vocab=torch.arange(V)))
    if method == "draft_greedy":                                  # a draft model drafting its argmax
        return DraftModelProposer(close_draft(), sample_drafts=False, min_confidence=0.3)
    if method == "suffix":
        return SuffixProposer()
    if method == "lookahead":
        return LookaheadProposer(LookaheadShape(2, 3, 2))
    if method == "staged":                                        # a draft for the draft (as `load` builds it)
        return StagedProposer(DraftModelProposer(close_draft()))
    raise ValueError(method)


POLICIES = [("fixed", k) for k in range(1, 7)] + [("heuristic", 2), ("auto", 3)]


@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle_tree", "hybrid", "medusa", "draft_greedy", "suffix",
                                    "lookahead", "staged"])
def test_point_mass_methods_sample_exactly_what_plain_sampling_does(method):
    """Same seed, temperature 1 with top-k and top-p: every draft length and policy (including `auto`,
    which reads the clock) gives plain sampling's tokens, for a batch of 4 ragged prompts."""
    target = target_v8()
    want = [r.tokens for r in tiny_generator(target).generate(PROMPTS, max_new_tokens=24, seed=11, **SAMPLED)]
    accepted = 0
    for policy, k in POLICIES:
        gen = tiny_generator(target, point_mass_proposer(method, target, k), policy, k)
        got = gen.generate(PROMPTS, max_new_tokens=24, seed=11, **SAMPLED)
        assert [r.tokens for r in got] == want, (policy, k)
        accepted += sum(r.metrics["acceptance_rate"] or 0 for r in got)
    assert accepted > 0                                           # drafts were accepted, not only rejected


def sampled_alone_and_in_batches(target, make_proposer, k: int, seed: int) -> list[list[int]]:
    """The continuation of PROMPTS[0] with one seed: decoded alone, after two other sequences, and
    amid six (other prompts, seeds, lengths and sampling parameters, greedy included)."""
    me = Request(PROMPTS[0], 20, SamplingParams(1.0, 6, 0.9, seed))
    others = [Request(p, 20, SamplingParams(t, 0, 1.0, 100 + i))
              for i, (p, t) in enumerate(zip(OTHERS, (1.0, 0.0, 0.7, 1.0)))]
    others += [Request(p, 12, SamplingParams(1.0, 0, 0.95, 200 + i)) for i, p in enumerate(PROMPTS[1:])]
    outs = []
    for batch in ([me], others[:2] + [me], [others[2], me] + others[3:]):
        seqs = run_engine(target, make_proposer(), batch, "fixed", k)
        outs.append(seqs[batch.index(me)].generated)
    return outs


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_eagle_chain_with_a_confidence_cutoff_samples_the_same_alone_and_batched(seed):
    """Each chain is cut by its own confidence; how far its batch-mates draft changes nothing."""
    target = target_v8()
    alone, batched, other = sampled_alone_and_in_batches(
        target, lambda: EagleProposer(head_for(target), 1, 6, 6, min_confidence=0.3), 6, seed)
    assert alone == batched == other


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_draft_model_with_a_confidence_cutoff_samples_the_same_alone_and_batched(seed):
    """A sampling draft model (stochastic drafts) cut per sequence by its own confidence: the drafts a
    sequence draws, and so its output, do not depend on how long its batch-mates draft."""
    target = target_v8()
    alone, batched, other = sampled_alone_and_in_batches(
        target, lambda: DraftModelProposer(close_draft(), min_confidence=0.5), 5, seed)
    assert alone == batched == other


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("method", ["eagle", "hybrid"])
def test_sampled_eagle_chains_sample_the_same_alone_and_batched(method, seed):
    """EAGLE chains that draw their drafts from the head's q (sample_drafts on; `hybrid` beside prompt lookup):
    a sequence's drafts and output do not depend on its batch-mates."""
    target = target_v8()

    def make():
        chain = EagleProposer(head_for(target), 1, 6, 6, min_confidence=0.3, sample_from=0.0)
        return chain if method == "eagle" else HybridProposer(chain, NgramProposer(1, 3), 2)

    alone, batched, other = sampled_alone_and_in_batches(target, make, 6, seed)
    assert alone == batched == other


def test_a_batch_mate_near_the_end_of_the_context_does_not_change_a_sampled_draft_row():
    """Drafts sampled by a draft model, fixed K = 7: a batch-mate whose prompt leaves it less cache room than
    7 drafts (the context is 256 tokens) is stepped apart, so the other row drafts and samples as beside a short
    one."""
    target = tiny_model(seed=20, vocab=V, std=0.5)
    row, short_mate, long_mate = [3, 5, 7], [1, 2, 4], [i % V for i in range(256 - 24 - 1)]
    for seed in range(12):
        outs = []
        for mate in (short_mate, long_mate):
            gen = tiny_generator(target, DraftModelProposer(close_draft()), "fixed", 7)
            outs.append(gen.generate([row, mate], max_new_tokens=24, temperature=1.0, seed=seed)[0].tokens)
        assert outs[0] == outs[1], seed


def test_each_prompt_of_a_list_gets_its_own_seed():
    target = tiny_model(seed=7)
    gen = tiny_generator(target, NgramProposer(1, 3), "fixed", 3)
    prompt = [3, 5, 7, 9, 3, 5, 7]
    a, b = gen.generate([prompt, prompt], max_new_tokens=16, seed=4, **SAMPLED)
    assert a.tokens != b.tokens                                   # equal prompts, different samples
    again = gen.generate([prompt, prompt], max_new_tokens=16, seed=4, **SAMPLED)
    assert [a.tokens, b.tokens] == [r.tokens for r in again]      # and reproducible
    one = gen.generate(prompt, max_new_tokens=16, seed=4, **SAMPLED)
    assert one.tokens == gen.generate(prompt, max_new_tokens=16, seed=4, **SAMPLED).tokens
    plain = tiny_generator(target, NoProposer()).generate(prompt, max_new_tokens=16, seed=4, **SAMPLED)
    assert one.tokens == plain.tokens                             # a single prompt keeps `seed` itself
