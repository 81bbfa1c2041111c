"""Exactness where the pieces meet: long catch-ups, duplicate draft spellings, large trees, shared targets."""
from __future__ import annotations

import torch

from helpers import PROMPTS, Stateless, tiny_generator, tiny_model
from specdec.draft_length import make_policy
from specdec.engine import Engine, Request
from specdec.models.early_exit import EarlyExitDraft
from specdec.models.eagle3 import Eagle3Config, Eagle3Head
from specdec.prefix_cache import PREFILL_PIECE, PrefixCache
from specdec.proposers.base import NoProposer
from specdec.proposers.cross_vocab import target_probs
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.lookahead import LookaheadProposer, LookaheadShape
from specdec.proposers.self_spec import SelfProposer
from specdec.reference import reference_greedy
from specdec.tree import MAX_TREE_BUDGET, PAD
from specdec.verify import Draft


def _decode(target, proposer, requests: list[Request], k: int, slots: int = 240):
    """Run `requests` through one engine; (outputs, the target's committed keys and values per row)."""
    eng = Engine(target, proposer, make_policy("fixed", k), lambda ids: "", frozenset())
    eng.allocate(len(requests), slots)
    seqs = [eng.add(r) for r in requests]
    with torch.inference_mode():
        while eng.busy:
            eng.step()
    n = [len(s.tokens) - 1 for s in seqs]
    kv = [(eng.cache.k[:, s.row, :, :n[i]].clone(), eng.cache.v[:, s.row, :, :n[i]].clone()) for i, s in enumerate(seqs)]
    return [s.generated for s in seqs], kv


def test_self_after_a_long_followed_prediction_keeps_the_targets_bits():
    """A prediction followed for 100 tokens leaves the self draft 100 tokens to catch up; its cache (which
    verification reuses) must hold the bits the target computed, not those of one long forward."""
    target = tiny_model(seed=9, layers=4).pack()
    prompt = list(PROMPTS[1])
    plain, plain_kv = _decode(target, NoProposer(), [Request(prompt, 140)], 1)
    torch.manual_seed(0)
    exit_ = EarlyExitDraft(target, 2, torch.arange(0, target.vocab_size, 2)).prepare(target.dtype)
    prediction = tuple(plain[0][:100])                                       # followed exactly for 100 tokens
    out, kv = _decode(target, SelfProposer(exit_), [Request(prompt, 140, prediction=prediction)], 3)
    assert out == plain
    for (k0, v0), (k1, v1) in zip(plain_kv, kv):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_draft_tokens_spelled_alike_add_their_probabilities():
    """Two draft tokens mapped onto one target id (a letter and its byte-fallback twin): q keeps its mass."""
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    d2t = torch.tensor([0, 2, 2, 1])                                         # draft 1 and 2 spell target token 2
    allowed = torch.tensor([0, 1, 2, 3])
    qt = target_probs(q, d2t, allowed, 3)
    assert torch.allclose(qt, torch.tensor([[0.1, 0.4, 0.5]]))
    assert torch.allclose(qt.sum(-1), torch.ones(1))


def test_lookahead_trees_stay_within_the_exact_budget():
    """The largest shape (W=16, N=8, G=16) at K=7: every tree fits MAX_TREE_BUDGET nodes, output is plain's."""
    target = tiny_model(seed=3, layers=2).pack()
    prop = LookaheadProposer(LookaheadShape(16, 8, 16))
    sizes = []
    orig = prop.propose

    def counting(batch, k):
        d = orig(batch, k)
        sizes.append(int((d.tokens != PAD).sum(-1).max()))
        return d

    prop.propose = counting
    prompts = [list(PROMPTS[2]) * 6, list(PROMPTS[1])]
    out, kv = _decode(target, prop, [Request(p, 40) for p in prompts], 7)
    assert sizes and max(sizes) <= MAX_TREE_BUDGET
    assert out == [reference_greedy(target, p, 40) for p in prompts]
    plain, plain_kv = _decode(target, NoProposer(), [Request(p, 40) for p in prompts], 1)
    for (k0, v0), (k1, v1) in zip(plain_kv, kv):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


class WideTree(Stateless):
    """Always MAX_TREE_BUDGET nodes: the first draft's candidates, all hanging from the root."""
    name = "wide-tree"

    def propose(self, batch, k):
        B = len(batch.tokens)
        toks = torch.arange(MAX_TREE_BUDGET).expand(B, MAX_TREE_BUDGET).clone()
        return Draft(toks, parents=torch.full((B, MAX_TREE_BUDGET), -1))


def test_the_largest_tree_fits_the_cache_a_generator_allocates():
    """A 58-token prompt, 32 new tokens, K = 4 and trees of the largest allowed size: no 'context full'."""
    target = tiny_model(seed=4).pack()
    prompt = list(range(1, 59))
    gen = tiny_generator(target, WideTree(), "fixed", 4)
    assert gen.generate(prompt, max_new_tokens=32).tokens == reference_greedy(target, prompt, 32)


def test_an_eagle3_engine_leaves_the_shared_prefix_cache_usable():
    """Engines of one target share its prefix cache; an EAGLE-3 engine's forwards return wider hidden states.
    A plain engine prefilling the same long prompt afterwards must still work and equal plain decoding."""
    target = tiny_model(seed=2, layers=6).pack()
    ids = torch.arange(0, 80, 2)
    torch.manual_seed(0)
    head = Eagle3Head(target, Eagle3Config.for_target(target, len(ids)), ids).init_from_target().eval()
    cache = PrefixCache(64 << 20)
    prompt = [(7 * i) % 97 for i in range(PREFILL_PIECE + 20)]
    want = reference_greedy(target, prompt, 12)
    for prop in (EagleProposer(head, 1, 4, 16, name="eagle3"), NoProposer(), EagleProposer(head, 1, 4, 16, name="eagle3")):
        eng = tiny_generator(target, prop, "fixed", 4).engine(1, 200, cache)
        seq = eng.add(Request(prompt, 12))
        with torch.inference_mode():
            while eng.busy:
                eng.step()
        assert seq.generated == want
    assert cache.hit_tokens == PREFILL_PIECE                               # the second EAGLE-3 engine reused its piece
