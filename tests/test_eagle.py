"""EAGLE head + dynamic-tree proposer: lossless whatever the head's quality; weights files checked."""
from __future__ import annotations

import pytest
import torch

from specdec.draft_length import make_policy
from specdec.engine import Engine, Request
from specdec.errors import SpecdecError
from specdec.models.eagle import EagleHead
from specdec.proposers.eagle import EagleProposer
from specdec.reference import reference_greedy
from specdec.sampling import SamplingParams

from helpers import PROMPTS, V, check_joint, exact_joint, head_for, sample_engine, tiny_generator, tiny_model


@pytest.mark.parametrize("topk, depth, budget", [(2, 3, 6), (4, 5, 16), (3, 2, 4), (1, 4, 4)])
@pytest.mark.parametrize("batch", [1, 3])
def test_eagle_greedy_equals_plain(topk, depth, budget, batch):
    target = tiny_model(seed=7)
    prop = EagleProposer(head_for(target, vocab=torch.arange(0, 97, 2)), topk, depth, budget)  # reduced vocab
    gen = tiny_generator(target, prop, "fixed", depth)
    for p, r in zip(PROMPTS[:batch], gen.generate(PROMPTS[:batch], max_new_tokens=30)):
        assert r.tokens == reference_greedy(target, p, 30)


@pytest.mark.parametrize("batch", [1, 3])
def test_eagle_chain_confidence_cutoff_is_lossless_and_drafts_less(batch):
    target = tiny_model(seed=7)
    drafted = []
    for conf in (0.0, 0.02):
        eng = Engine(target, EagleProposer(head_for(target), 1, 4, 4, min_confidence=conf), make_policy("fixed", 4),
                     lambda ids: "", frozenset())
        eng.allocate(batch, 80)
        seqs = [eng.add(Request(list(p), 30)) for p in PROMPTS[:batch]]
        with torch.inference_mode():
            while eng.busy:
                eng.step()
        for p, s in zip(PROMPTS[:batch], seqs):
            assert s.generated == reference_greedy(target, p, 30)
        drafted.append(sum(s.counters.drafted for s in seqs))
    assert 0 < drafted[1] < drafted[0]


def test_eagle_head_trained_on_target_accepts_more_than_random():
    """Sanity of the feature plumbing: a head that passes the target's feature through drafts the target's
    own next-token guess (fc picks the feature half before the head is packed; its random layer barely
    moves it) and is accepted clearly more often than a random head, both lossless."""
    target = tiny_model(seed=11, layers=2)
    dim = target.config.dim
    torch.manual_seed(0)
    passing = EagleHead(target, torch.arange(target.vocab_size))
    with torch.no_grad():
        passing.fc.weight.zero_()
        passing.fc.weight[:, dim:] = torch.eye(dim)
    passing.prepare(torch.float32)
    acceptance = {}
    for name, head in (("passing", passing), ("random", head_for(target))):
        gen = tiny_generator(target, EagleProposer(head, 3, 3, 8), "fixed", 3)
        results = gen.generate(PROMPTS, max_new_tokens=30)
        for p, r in zip(PROMPTS, results):
            assert r.tokens == reference_greedy(target, p, 30)
        acceptance[name] = sum(r.metrics["acceptance_rate"] for r in results) / len(results)
    assert acceptance["passing"] > acceptance["random"] + 0.05, acceptance


@pytest.mark.slow        # 20,000 sequences: `make test`; fast loop: test_seeds.py (plain sampling's tokens)
@pytest.mark.parametrize("params", [SamplingParams(0.7, 5, 0.9), SamplingParams(1.0, 6, 0.95)], ids=["t0.7", "t1.0"])
def test_eagle_sampling_matches_exact_distribution(params):
    target = tiny_model(seed=20, vocab=V, std=0.5)
    prompt = [1, 2, 3]
    samples = sample_engine(target, EagleProposer(head_for(target), 2, 3, 5), params, prompt, n=20_000, k=3)
    assert check_joint(samples, exact_joint(target, prompt, params)) > 1e-3


def test_weights_roundtrip_and_errors(tmp_path):
    target = tiny_model(seed=1)
    head = head_for(target)
    path = tmp_path / "eagle.safetensors"
    head.save(path, {"note": "test"})
    again = EagleHead.load(path, target)
    torch.testing.assert_close(again.fc.weight.float(), head.fc.weight.to(torch.bfloat16).float())
    with pytest.raises(SpecdecError, match="trained for another target"):
        EagleHead.load(path, tiny_model(seed=2))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(SpecdecError, match="corrupt weights"):
        EagleHead.load(bad, target)
    with pytest.raises(SpecdecError, match="not found"):
        EagleHead.load(tmp_path / "missing.safetensors", target)


@pytest.mark.slow        # 20,000 sequences: `make test`; at 1.0, where sampled drafts matter most
@pytest.mark.parametrize("params", [SamplingParams(1.0, 6, 0.95)], ids=["t1.0"])
def test_eagle_sampled_drafts_match_exact_distribution(params):
    """Drafts drawn from the head's own q (reduced vocabulary, the row's transform) and verified by the rejection
    rule: the output is the target's distribution."""
    target = tiny_model(seed=20, vocab=V, std=0.5)
    prompt = [1, 2, 3]
    prop = EagleProposer(head_for(target, vocab=torch.arange(0, V, 2)), 1, 3, 3, sample_drafts=True)
    samples = sample_engine(target, prop, params, prompt, n=20_000, k=3)
    assert check_joint(samples, exact_joint(target, prompt, params)) > 1e-3


def test_eagle_sampled_drafts_are_reproducible_and_greedy_rows_stay_plain():
    target = tiny_model(seed=21)
    head = head_for(target)
    gen = tiny_generator(target, EagleProposer(head, 1, 4, 4, sample_drafts=True), "fixed", 4)
    a = gen.generate(PROMPTS, max_new_tokens=24, temperature=0.9, seed=3)
    b = gen.generate(PROMPTS, max_new_tokens=24, temperature=0.9, seed=3)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert all(r.metrics["acceptance_rate"] is not None for r in a)                # it drafted
    greedy = gen.generate(PROMPTS, max_new_tokens=24)
    assert [r.tokens for r in greedy] == [reference_greedy(target, p, 24) for p in PROMPTS]
    with pytest.raises(SpecdecError, match="chains"):
        EagleProposer(head, 2, 4, 8, sample_drafts=True)


def test_sample_drafts_is_refused_where_it_does_not_apply():
    from specdec.api import make_proposer
    from specdec.tree import TreeShape

    target = tiny_model(seed=2)
    with pytest.raises(SpecdecError, match="applies to the chains of eagle and eagle3"):
        make_proposer("ngram", target, None, None, "float32", "cpu", TreeShape(), sample_drafts="on")
    with pytest.raises(SpecdecError, match="with a tree"):
        make_proposer("eagle", target, None, None, "float32", "cpu", TreeShape(4, 16), sample_drafts="on")
