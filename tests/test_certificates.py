"""Sampling certificates: whole continuations sampled through the engine against the enumerated exact
distribution (chi-square), over the cases the other files leave out, and mutants of the verifier and
of the random streams that the certificates must catch."""
from __future__ import annotations


import numpy as np
import pytest
import torch

import specdec.engine as engine_mod
import specdec.verify as verify_mod
from specdec.engine import Request
from specdec.proposers.base import NoProposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleProposer
from specdec.reference import exact_distribution, reference_greedy
from specdec.sampling import BatchSampling, SamplingParams, sample, to_probs
from specdec.tree import TokenTree
from specdec.verify import Verdict, verify_tree

from helpers import (V, check_joint, chi2_pvalue, exact_joint, head_for, needs_bf16, perturbed_copy, run_engine,
                     sample_engine, stream_engine, tiny_model)

PROMPT, NEW3, N6 = [1, 2, 3], 3, 6000          # 3-token continuations, 6000 sequences: a few seconds each
TEMPERATURE_ONLY = SamplingParams(0.8)
TOP_P_ONLY = SamplingParams(1.0, 0, 0.9)
FULL = SamplingParams(1.0, 6, 0.95)
# 5-token continuations (41 outcomes under this transform): after the first token, steps have room for
# up to 3 drafts, so confidence cut-offs and changing draft lengths come into play
NEW5, LONG = 5, SamplingParams(0.8, 3, 0.9)


def target(dtype: torch.dtype = torch.float32):
    """Less peaky than the other files' target: 3-token continuations have 17-512 outcomes here."""
    return tiny_model(seed=20, vocab=V, std=0.4).to(dtype)


def draft(kind: str, dtype: torch.dtype = torch.float32):
    """close: the target with noise (most drafts accepted); bad: an unrelated model (most rejected)."""
    m = perturbed_copy(target(), 0.1) if kind == "close" else tiny_model(seed=21, vocab=V, std=0.4, layers=1)
    return m.to(dtype)


def certify(model, proposer, params: SamplingParams, n: int = N6, k: int = 3) -> float:
    """The chi-square p-value of n sampled 3-token continuations of PROMPT."""
    exact = exact_joint(model, PROMPT, params, NEW3)
    return check_joint(sample_engine(model, proposer, params, PROMPT, n, k, "fixed", NEW3), exact)


def requests(params: SamplingParams, new: int, n: int = N6) -> list[Request]:
    """n requests for `new` tokens after PROMPT, request i with seed i."""
    return [Request(list(PROMPT), new, SamplingParams(params.temperature, params.top_k, params.top_p, i))
            for i in range(n)]


def caught(model, proposer, params: SamplingParams, n: int = N6) -> bool:
    """Whether the certificate rejects: a continuation of probability zero, or a p-value below 1e-6."""
    exact = exact_joint(model, PROMPT, params, NEW3)
    samples = sample_engine(model, proposer, params, PROMPT, n, 3, "fixed", NEW3)
    return any(s not in exact for s in samples) or check_joint(samples, exact) < 1e-6


@pytest.mark.parametrize("params", [TEMPERATURE_ONLY, TOP_P_ONLY], ids=["temperature", "top_p"])
@pytest.mark.parametrize("proposer", ["none", "close_draft", "bad_draft"])
def test_temperature_only_and_top_p_only(params, proposer):
    """Plain sampling (which every point-mass method equals token for token, tests/test_seeds.py) and
    sampled drafts, with the transform reduced to one of its parts."""
    prop = NoProposer() if proposer == "none" else DraftModelProposer(draft(proposer.split("_")[0]))
    assert certify(target(), prop, params) > 1e-3


@pytest.mark.parametrize("proposer", ["none", "close_draft"])
def test_bfloat16_target(proposer):
    needs_bf16(torch.bfloat16)
    model = target(torch.bfloat16)
    prop = NoProposer() if proposer == "none" else DraftModelProposer(draft("close", torch.bfloat16))
    assert certify(model, prop, FULL) > 1e-3


def test_a_batch_whose_sequences_sample_with_different_parameters():
    """One batch, four transforms (greedy among them), sampled drafts: each group has its own law."""
    model = target()
    groups = [SamplingParams(0.0), TEMPERATURE_ONLY, TOP_P_ONLY, SamplingParams(1.3, 5, 0.95)]
    n = 1500 * len(groups)
    samples = sample_engine(model, DraftModelProposer(draft("close")), [groups[i % 4] for i in range(n)],
                            PROMPT, n, 3, "fixed", NEW3)
    assert set(samples[0::4]) == {tuple(reference_greedy(model, PROMPT, NEW3))}
    for g, params in enumerate(groups[1:], 1):
        assert check_joint(samples[g::4], exact_joint(model, PROMPT, params, NEW3)) > 1e-3, params


def test_a_batch_mixing_sampled_and_point_mass_eagle_drafts():
    """The EAGLE chain sampling its drafts only for rows at temperature 0.9 or above (as `auto` does above its
    threshold), in one batch: greedy rows keep plain decoding's tokens, rows sampling below 0.9 draft point masses
    and keep plain sampling's tokens for their seeds (each row is verified by its own rule), rows above it draw
    their drafts from the head's q; each group has its own law."""
    model = target()
    groups = [SamplingParams(0.0), SamplingParams(0.8, 0, 0.9), FULL]
    n = 1500 * len(groups)
    params = [groups[i % 3] for i in range(n)]
    prop = EagleProposer(head_for(model, vocab=torch.arange(0, V, 2)), 1, 3, 3, sample_from=0.9)
    samples = sample_engine(model, prop, params, PROMPT, n, 3, "fixed", NEW3)
    plain = sample_engine(model, NoProposer(), params, PROMPT, n, 3, "fixed", NEW3)
    assert samples[0::3] == plain[0::3] and samples[1::3] == plain[1::3]
    assert samples[2::3] != plain[2::3]                                          # sampled drafts: other tokens
    for g, group in enumerate(groups[1:], 1):
        assert check_joint(samples[g::3], exact_joint(model, PROMPT, group, NEW3)) > 1e-3, group


@pytest.mark.parametrize("proposer", ["eagle_chain", "draft"])
def test_confidence_cutoffs_above_zero(proposer):
    """The EAGLE chain (point-mass drafts) and the sampling draft model, each sequence's drafts cut by
    its own confidence: the cut happens and the output keeps the target's law."""
    model = target()

    def make(conf: float):
        if proposer == "eagle_chain":
            return EagleProposer(head_for(model), 1, 5, 5, min_confidence=conf)
        return DraftModelProposer(draft("close"), min_confidence=conf)

    few = requests(LONG, NEW5, 300)
    drafted = [sum(s.counters.drafted for s in run_engine(model, make(c), few, "fixed", 5)) for c in (0.0, 0.5)]
    assert 0 < drafted[1] < drafted[0]                                           # the cut-off cuts
    seqs = run_engine(model, make(0.5), requests(LONG, NEW5, 4000), "fixed", 5)
    assert check_joint([tuple(s.generated) for s in seqs], exact_joint(model, PROMPT, LONG, NEW5)) > 1e-3


class SimulatedClock:
    """The engine's clock on a simulated machine: a target forward takes 200 ms, a draft forward 10 ms
    (a big target read from memory, a small draft), nothing else takes time. `auto` then decides from
    these costs and the measured acceptance, the same way on any machine however loaded."""

    def __init__(self, target_model, draft_model, target_s: float = 0.2, draft_s: float = 0.01) -> None:
        self.now = 0.0
        for model, cost in ((target_model, target_s), (draft_model, draft_s)):
            self._charge(model, cost)

    def _charge(self, model, cost: float) -> None:
        forward = model.forward

        def timed_forward(*args, **kwargs):
            self.now += cost
            return forward(*args, **kwargs)

        model.forward = timed_forward

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.slow
def test_auto_policy_with_sampled_drafts_under_continuous_batching(monkeypatch):
    """`auto` picks K from acceptance and time while sequences join and leave a batch of 16 (the
    server's way): K changes from step to step and with the batch, and the output keeps the target's law."""
    model, small = target(), draft("close")
    exact = exact_joint(model, PROMPT, LONG, NEW5)
    monkeypatch.setattr(engine_mod, "time", SimulatedClock(model, small))
    seqs = stream_engine(model, DraftModelProposer(small), requests(LONG, NEW5), "auto", 3, rows=16)
    assert sum(s.counters.drafted for s in seqs) > 2 * N6                      # it did speculate
    assert check_joint([tuple(s.generated) for s in seqs], exact) > 1e-3


@pytest.mark.parametrize("kind", ["close", "bad"])
def test_sampled_drafts_second_token_given_the_first(kind):
    """The second token, given each frequent first token x, follows the target's p(. | prompt, x):
    accepted drafts (close draft) and recovered tokens (bad draft) both land at the second position."""
    model = target()
    samples = sample_engine(model, DraftModelProposer(draft(kind)), FULL, PROMPT, N6, 3, "fixed", NEW3)
    firsts = np.bincount([s[0] for s in samples], minlength=V)
    checked = 0
    for x in np.flatnonzero(firsts >= 300):
        p = to_probs(exact_distribution(model, PROMPT + [int(x)])[None, None], BatchSampling.of([FULL]))[0, 0]
        second = np.bincount([s[1] for s in samples if s[0] == x], minlength=V)
        assert chi2_pvalue(second, p.double().numpy(), int(second.sum())) > 1e-3 / V, x
        checked += 1
    assert checked >= 2


# ---- mutants: each breaks one piece of the library; the certificates must notice --------------------
def test_catches_the_residual_the_wrong_way_round(monkeypatch):
    """Recovered tokens from norm(max(0, q - p)) instead of norm(max(0, p - q))."""
    real = verify_mod.residual
    monkeypatch.setattr(verify_mod, "residual", lambda p, q: real(q, p))
    assert caught(target(), DraftModelProposer(draft("bad")), FULL)


@pytest.mark.parametrize("proposer", ["none", "close_draft"])
def test_catches_a_uniform_reused_for_two_positions(monkeypatch, proposer):
    """Positions 2j and 2j + 1 share the target's uniform: neighbouring tokens become dependent."""
    real = engine_mod.position_uniforms

    def paired(seeds, positions, stream):
        return real(seeds, positions // 2, stream)

    monkeypatch.setattr(engine_mod, "position_uniforms", paired)
    prop = NoProposer() if proposer == "none" else DraftModelProposer(draft("close"))
    assert caught(target(), prop, FULL)


def eagle_tree(model) -> EagleProposer:
    """Dynamic EAGLE trees (2 children per node, 6 nodes) from a random head: point-mass candidates that
    follow the context (random candidates would average a wrong recovery rule out of the joint law)."""
    return EagleProposer(head_for(model), 2, 3, 6)


def test_tree_certificate_holds():
    model = target()
    assert certify(model, eagle_tree(model), FULL, n=3000) > 1e-3


def test_catches_a_tree_verifier_that_recovers_from_p_with_the_rejected_children_left_in(monkeypatch):
    """After the walk stops at a node with children, the recovered token is drawn again from the node's
    whole p (a fresh uniform) instead of p without the children it rejected."""
    g = torch.Generator().manual_seed(0)

    def recover_from_p(tree: TokenTree, p: torch.Tensor, u: torch.Tensor) -> Verdict:
        v = verify_tree(tree, p, u)
        rows = torch.arange(p.shape[0])
        node = v.path[rows, v.num_accepted]                                     # [B] where the walk stopped
        had_children = ((tree.parents == node[:, None]) & (tree.tokens >= 0)).any(1)
        redo = sample(p[rows, node], torch.rand(p.shape[0], generator=g))
        tokens = v.tokens.clone()
        tokens[rows, v.num_accepted] = torch.where(had_children, redo, tokens[rows, v.num_accepted])
        return Verdict(v.num_accepted, tokens, v.path, v.target_tokens)

    monkeypatch.setattr(engine_mod, "verify_tree", recover_from_p)
    model = target()
    assert caught(model, eagle_tree(model), FULL, n=3000)


def test_full_chains_and_their_bonus_tokens():
    """Chains of K = 5 drafts long enough to be accepted whole: the joint law of 7 sampled tokens (top_k 2: 128
    outcomes), where a good share of the sequences commit 6 tokens (5 accepted drafts and the bonus) in one
    forward and the rest mix accepted, recovered and bonus tokens at every position."""
    target = tiny_model(seed=20, vocab=V, std=0.5)
    params = SamplingParams(1.0, 2)
    reqs = [Request([1, 2, 3], 7, SamplingParams(1.0, 2, 1.0, seed)) for seed in range(4000)]
    seqs = run_engine(target, DraftModelProposer(perturbed_copy(target, 0.02)), reqs, "fixed", 5)
    whole = sum(s.counters.target_forwards == 2 for s in seqs)             # one chain of 5, then the last token
    assert whole >= 400, f"only {whole} sequences accepted a whole chain"
    assert min(s.counters.target_forwards for s in seqs) == 2 and max(s.counters.target_forwards for s in seqs) > 2
    p = check_joint([tuple(s.generated) for s in seqs], exact_joint(target, [1, 2, 3], params, 7))
    assert p > 1e-3, p
