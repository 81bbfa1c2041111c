"""Lookahead decoding: Jacobi window + n-gram pool, verified as a token tree."""
from __future__ import annotations

import pytest
import torch

from helpers import PROMPTS, V, check_joint, exact_joint, sample_engine, tiny_generator, tiny_model
from specdec.errors import SpecdecError
from specdec.proposers.lookahead import LookaheadProposer, LookaheadShape
from specdec.reference import reference_greedy
from specdec.sampling import SamplingParams

REPETITIVE = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 9, 9, 9, 9, 9]]


@pytest.mark.parametrize("shape", [LookaheadShape(), LookaheadShape(3, 2, 1), LookaheadShape(4, 4, 3)],
                         ids=["2,3,2", "3,2,1", "4,4,3"])
@pytest.mark.parametrize("k, batch", [(2, 1), (5, 1), (5, 3), (7, 5)])
def test_lookahead_greedy_equals_plain(shape, k, batch):
    target = tiny_model(seed=7)
    prompts = (PROMPTS + REPETITIVE)[:batch]
    gen = tiny_generator(target, LookaheadProposer(shape), "fixed", k)
    for p, r in zip(prompts, gen.generate(prompts, max_new_tokens=30)):
        assert r.tokens == reference_greedy(target, p, 30)


def test_the_window_is_a_tree_with_lades_attention_pattern():
    """Column i's level j hangs from its level j-1, level 0 is a chain: node (j, i) sees level 0 up to
    column i and its own column below it, at depth i + j + 1."""
    from specdec.proposers.base import ActiveBatch
    from specdec.sampling import BatchSampling

    prop = LookaheadProposer(LookaheadShape(3, 3, 1))
    prop.allocate(1, 64)
    prompt = [11, 12, 13]
    prop.start(torch.tensor([0]), [prompt], torch.zeros(1, 3, 4))
    prop.rows[0].pool.clear()
    prop.rows[0].levels = [[20, 21, 22], [30, 31, 32]]
    batch = ActiveBatch(torch.tensor([0]), [prompt], BatchSampling.of([SamplingParams()], "cpu"), torch.zeros(1, dtype=torch.long))
    d = prop.propose(batch, 4)
    nodes = prop.rows[0].window_nodes
    tok, par = d.tokens[0].tolist(), d.parents[0].tolist()
    assert [tok[n] for n in nodes[0]] == [20, 21, 22] and [tok[n] for n in nodes[1]] == [30, 31, 32]
    assert par[nodes[0][0]] == -1 and par[nodes[0][1]] == nodes[0][0] and par[nodes[0][2]] == nodes[0][1]
    assert [par[n] for n in nodes[1]] == nodes[0]
    assert d.depth[0].tolist()[nodes[1][2]] == 4
    assert prop.propose(batch, 2).tokens.shape[1] == 2       # K = 2 leaves room for one column of 2 levels


def test_the_pool_learns_the_columns_ngrams():
    target = tiny_model(seed=7)
    prop = LookaheadProposer(LookaheadShape(2, 3, 2))
    gen = tiny_generator(target, prop, "fixed", 4)
    r = gen.generate(PROMPTS[1], max_new_tokens=30)
    pool = prop.rows[0].pool
    assert sum(len(v) for v in pool.values()) > len(PROMPTS[1])        # more than the prompt's n-grams
    assert all(len(v) <= 2 and all(len(g) == 2 for g in v) for v in pool.values())
    assert r.metrics["acceptance_rate"] > 0


@pytest.mark.parametrize("spec, msg", [("0,3,2", "W >= 1"), ("2,1,2", "N >= 2"), ("2,3,0", "G >= 1"),
                                       ("2x3x2", "W,N,G"), ("17,3,2", "capped")])
def test_bad_shapes_are_clear_errors(spec, msg):
    with pytest.raises(SpecdecError, match=msg):
        LookaheadShape.parse(spec)


@pytest.mark.slow        # 20,000 sequences: `make test`
def test_lookahead_sampling_matches_exact_distribution():
    target = tiny_model(seed=20, vocab=V, std=0.5)
    params = SamplingParams(1.0, 6, 0.95)
    prompt = [1, 2, 1, 2, 1]
    samples = sample_engine(target, LookaheadProposer(LookaheadShape(2, 3, 2)), params, prompt, n=20_000, k=3)
    assert check_joint(samples, exact_joint(target, prompt, params)) > 1e-3
