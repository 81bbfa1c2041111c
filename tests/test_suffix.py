"""Suffix decoding: continuation counts of this sequence and of earlier requests, drafted as a tree."""
from __future__ import annotations

import pytest
import torch

from helpers import PROMPTS, V, check_joint, exact_joint, run_engine, sample_engine, tiny_generator, tiny_model
from specdec.engine import Request
from specdec.errors import SpecdecError
from specdec.proposers.base import ActiveBatch
from specdec.proposers.suffix import ContinuationIndex, SuffixProposer
from specdec.reference import reference_greedy
from specdec.sampling import BatchSampling, SamplingParams
from specdec.tree import PAD

REPETITIVE = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 9, 9, 9, 9, 9]]


@pytest.mark.parametrize("k, batch", [(1, 1), (4, 1), (4, 3), (6, 5)])
def test_suffix_greedy_equals_plain(k, batch):
    target = tiny_model(seed=7)
    prompts = (PROMPTS + REPETITIVE)[:batch]
    gen = tiny_generator(target, SuffixProposer(), "fixed", k)
    for p, r in zip(prompts, gen.generate(prompts, max_new_tokens=30)):
        assert r.tokens == reference_greedy(target, p, 30)


def test_earlier_requests_teach_later_ones():
    """The same task again: the global index (earlier outputs) makes the second run draft and accept more."""
    target = tiny_model(seed=7)
    prop = SuffixProposer()
    first = run_engine(target, prop, [Request(list(PROMPTS[1]), 40)], "fixed", 4)[0]
    again = run_engine(target, prop, [Request(list(PROMPTS[1]), 40)], "fixed", 4)[0]
    assert again.generated == first.generated == reference_greedy(target, PROMPTS[1], 40)
    assert again.counters.accepted > first.counters.accepted
    assert again.counters.target_forwards < first.counters.target_forwards


def test_counts_and_bounded_memory():
    idx = ContinuationIndex(max_match=2, max_contexts=3)
    idx.add([1, 2, 1, 2, 3], 1)
    assert len(idx.counts) == 3 and idx.get((1,)) is None       # the least recently used context was dropped
    assert idx.get((1, 2)) == {1: 1, 3: 1} and idx.get((2,)) == {1: 1, 3: 1} and idx.get((2, 1)) == {2: 1}
    with pytest.raises(SpecdecError):
        SuffixProposer(budget=0)


@pytest.mark.slow        # 20,000 sequences: `make test`
def test_suffix_sampling_matches_exact_distribution():
    target = tiny_model(seed=20, vocab=V, std=0.5)
    params = SamplingParams(1.0, 6, 0.95)
    prompt = [1, 2, 1, 2, 1]
    samples = sample_engine(target, SuffixProposer(), params, prompt, n=20_000, k=3)
    assert check_joint(samples, exact_joint(target, prompt, params)) > 1e-3


def test_hybrid_can_use_suffix_decoding_in_place_of_prompt_lookup():
    from helpers import head_for
    from specdec.proposers.eagle import EagleProposer
    from specdec.proposers.hybrid import HybridProposer

    target = tiny_model(seed=7)
    prop = HybridProposer(EagleProposer(head_for(target), 1, 4, 4), SuffixProposer())
    gen = tiny_generator(target, prop, "fixed", 4)
    prompts = PROMPTS + REPETITIVE
    for p, r in zip(prompts, gen.generate(prompts, max_new_tokens=30)):
        assert r.tokens == reference_greedy(target, p, 30)
    assert prop.steps_ngram > 0 and prop.steps_eagle > 0


def test_a_step_scores_no_more_rows_than_a_chain_of_k():
    """Ambiguous continuations grow a bushy tree, but never past k nodes (each scored row costs)."""
    import torch

    from specdec.proposers.base import ActiveBatch
    from specdec.sampling import BatchSampling

    hist = [7, 1, 2, 7, 1, 3, 7, 1, 4, 7, 1]                   # after 7 1: 2, 3 or 4
    for k, budget in [(2, 8), (4, 8), (6, 3)]:
        prop = SuffixProposer(budget=budget, min_prob=0.01, tree_cost=1.0)
        rows = torch.tensor([0])
        prop.allocate(1, 64)
        prop.start(rows, [hist], torch.zeros(1, len(hist), 4))
        batch = ActiveBatch(rows, [hist], BatchSampling.of([SamplingParams()]), torch.zeros(1, dtype=torch.long))
        draft = prop.propose(batch, k)
        nodes = int((draft.tokens != -1).sum())
        assert nodes == min(k, budget) and not draft.is_chain           # tree_cost 1.0: the tree whenever it gains


def test_a_costly_tree_gives_way_to_its_best_chain():
    """Where a tree's expected gain does not pay for its extra forward cost, the most probable chain drafts."""
    import torch

    from specdec.proposers.base import ActiveBatch
    from specdec.sampling import BatchSampling

    hist = [7, 1, 2, 7, 1, 3, 7, 1, 4, 7, 1]                   # after 7 1: 2, 3 or 4, each 1/3
    for cost, chain in [(1.0, False), (3.0, True)]:
        prop = SuffixProposer(min_prob=0.01, tree_cost=cost)
        rows = torch.tensor([0])
        prop.allocate(1, 64)
        prop.start(rows, [hist], torch.zeros(1, len(hist), 4))
        batch = ActiveBatch(rows, [hist], BatchSampling.of([SamplingParams()]), torch.zeros(1, dtype=torch.long))
        draft = prop.propose(batch, 4)
        assert draft.is_chain == chain
        if chain:
            assert draft.tokens[0, 0].item() in (2, 3, 4) and draft.tokens[0, 1].item() == 7


def test_a_short_match_drafts_few_tokens():
    """A match of m tokens drafts at most match_factor * m: one token of context is weak evidence, however
    often its continuation was seen."""
    hist = [3, 4, 5, 6, 9, 3, 4, 5, 6, 9, 8, 8, 3]            # ends in a 1-token match of "3" (then 4 5 6 9)
    for factor, drafted in [(1.0, 1), (2.0, 2), (8.0, 4)]:
        prop = SuffixProposer(match_factor=factor)
        rows = torch.tensor([0])
        prop.allocate(1, 64)
        prop.start(rows, [hist], torch.zeros(1, len(hist), 4))
        batch = ActiveBatch(rows, [hist], BatchSampling.of([SamplingParams()]), torch.zeros(1, dtype=torch.long))
        draft = prop.propose(batch, 4)
        assert draft.tokens[0].tolist()[:drafted] == [4, 5, 6, 9][:drafted]
        assert int((draft.tokens != PAD).sum()) == drafted


def test_forget_drops_what_earlier_requests_taught():
    target = tiny_model(seed=7)
    prop = SuffixProposer()
    first = run_engine(target, prop, [Request(list(PROMPTS[1]), 40)], "fixed", 4)[0]
    prop.forget()
    again = run_engine(target, prop, [Request(list(PROMPTS[1]), 40)], "fixed", 4)[0]
    assert again.generated == first.generated
    assert (again.counters.drafted, again.counters.accepted) == (first.counters.drafted, first.counters.accepted)


class NeverDraft:
    """A policy choosing K = 0 at every step (as `auto` does where drafting does not pay)."""

    def choose(self, batch: int, remaining: int) -> int:
        return 0

    def observe(self, batch, k, valid, accepted, draft_s, target_s, *, asked) -> None:
        pass


def test_outputs_of_steps_without_drafts_teach_later_requests():
    """Steps without drafts call no propose, where the indexes used to catch up: a request decoded wholly
    plainly taught the shared index nothing."""
    from specdec.engine import Engine
    from specdec.prefix_cache import PrefixCache

    target = tiny_model(seed=7)
    target.pack()
    prop = SuffixProposer()
    eng = Engine(target, prop, NeverDraft(), lambda ids: "", frozenset(), PrefixCache(0), 64)
    eng.allocate(1, 120)
    plain = eng.add(Request(list(PROMPTS[1]), 40))
    with torch.inference_mode():
        while eng.busy:
            eng.step()
    assert plain.generated == reference_greedy(target, PROMPTS[1], 40) and plain.counters.drafted == 0
    again = run_engine(target, prop, [Request(list(PROMPTS[1]), 40)], "fixed", 4)[0]
    fresh = run_engine(target, SuffixProposer(), [Request(list(PROMPTS[1]), 40)], "fixed", 4)[0]
    assert again.generated == fresh.generated == plain.generated
    assert again.counters.accepted > fresh.counters.accepted


def test_the_shared_indexes_are_bounded_over_all_tenants():
    """Each tenant's index is bounded; so are all of them together (64 full tenants held ~10 GiB): past
    max_total_contexts the least recently used tenants are dropped, never the one being written."""
    prop = SuffixProposer(max_match=2, max_contexts=40, max_total_contexts=100)
    prop.allocate(1, 64)
    sampling = BatchSampling.of([SamplingParams()])
    for i, tenant in enumerate(["a", "b", "c", "d"]):
        tokens = [1000 * i + j for j in range(30)]                            # 57 contexts per tenant, 40 kept
        prop.start(torch.tensor([0]), [tokens[:2]], torch.zeros(1, 2, 1))
        prop.commit(ActiveBatch(torch.tensor([0]), [tokens], sampling, torch.zeros(1, dtype=torch.long), [tenant]),
                    None, torch.zeros(1))
        assert sum(len(x.counts) for x in prop.shared.values()) <= 100 and tenant in prop.shared
    assert list(prop.shared) == ["c", "d"]
    with pytest.raises(SpecdecError, match="max_total_contexts >= max_contexts"):
        SuffixProposer(max_contexts=10, max_total_contexts=5)
