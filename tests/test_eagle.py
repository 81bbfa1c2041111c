"""EAGLE head + dynamic-tree proposer: lossless whatever the head's quality; weights files checked."""
from __future__ import annotations

import inspect
import math

import pytest
import torch

from specdec.api import AUTO_SAMPLE_FROM, make_proposer, sample_drafts_from
from specdec.draft_length import make_policy
from specdec.engine import Engine, Request
from specdec.errors import SpecdecError
from specdec.models.eagle import EagleHead
from specdec.models.eagle3 import Eagle3Config, Eagle3Head
from specdec.proposers.base import NoProposer
from specdec.proposers.eagle import EagleProposer
from specdec.reference import reference_greedy
from specdec.sampling import SamplingParams
from specdec.tree import TreeShape

from helpers import (PROMPTS, V, Recording, check_joint, exact_joint, head_for, run_engine, sample_engine,
                     tiny_generator, tiny_model)


@pytest.mark.parametrize("topk, depth, budget", [(2, 3, 6), (4, 5, 16), (3, 2, 4), (1, 4, 4)])
@pytest.mark.parametrize("batch", [1, 3])
def test_eagle_greedy_equals_plain(topk, depth, budget, batch):
    target = tiny_model(seed=7)
    prop = EagleProposer(head_for(target, vocab=torch.arange(0, 97, 2)), topk, depth, budget)  # reduced vocab
    gen = tiny_generator(target, prop, "fixed", depth)
    for p, r in zip(PROMPTS[:batch], gen.generate(PROMPTS[:batch], max_new_tokens=30)):
        assert r.tokens == reference_greedy(target, p, 30)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("new", [4, 20])
def test_a_tree_at_the_end_of_the_context_fits_the_heads_cache(kind, new):
    """The head's cache holds a tree's nodes past the rows' slots; a target cache that reaches the end of the
    context capped that scratch away ('context full' from the head where plain decoding finished)."""
    target = tiny_model(seed=7, layers=4)
    if kind == "eagle":
        head = head_for(target)
    else:
        torch.manual_seed(0)
        head = Eagle3Head(target, Eagle3Config.for_target(target, 40), torch.arange(0, 80, 2)).init_from_target()
        head = head.eval().prepare(target.dtype)
    prompt = ([3, 5, 7] * 100)[:target.max_seq_len - new - 1]           # the longest prompt generate() takes
    gen = tiny_generator(target, EagleProposer(head, 4, 64, 16), "fixed", 8)
    assert gen.generate(prompt, max_new_tokens=new).tokens == reference_greedy(target, prompt, new)


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


def head_file(target, path, vocab: torch.Tensor | None = None, eagle3: bool = False) -> str:
    """A random EAGLE (or EAGLE-3) head for `target` saved as a weights file, what make_proposer loads."""
    if eagle3:
        torch.manual_seed(0)
        ids = torch.arange(target.vocab_size) if vocab is None else vocab
        head = Eagle3Head(target, Eagle3Config.for_target(target, len(ids)), ids).init_from_target()
    else:
        head = head_for(target, vocab=vocab)
    head.save(path, {})
    return str(path)


@pytest.mark.slow        # 20,000 sequences: `make test`; at 1.0, where sampled drafts matter most
@pytest.mark.parametrize("params", [SamplingParams(1.0, 6, 0.95)], ids=["t1.0"])
def test_eagle_sampled_drafts_match_exact_distribution(params, tmp_path):
    """The default path: make_proposer's EAGLE chain with the default draft sampling (auto) draws the drafts of
    sampling rows from the head's own q (reduced vocabulary, the row's transform, the chain's confidence cut) and
    verification by the rejection rule gives the target's distribution."""
    target = tiny_model(seed=20, vocab=V, std=0.5)
    prompt = [1, 2, 3]
    prop = make_proposer("eagle", target, None, head_file(target, tmp_path / "h.safetensors", torch.arange(0, V, 2)),
                         "float32", "cpu")
    assert prop.sample_from <= params.temperature                              # auto samples the chain's drafts here
    samples = sample_engine(target, prop, params, prompt, n=20_000, k=3)
    assert check_joint(samples, exact_joint(target, prompt, params)) > 1e-3


def sampled_rows(drafts) -> list[bool]:
    """Per drafting step and row, whether the row's drafts were sampled from the head's q."""
    return [bool(x) for d in drafts if d.tokens.shape[1] for x in d.sampled]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_auto_samples_drafts_where_it_pays_and_drafts_point_masses_elsewhere(method, tmp_path):
    """The default setting (auto) on an EAGLE chain: rows sampling at AUTO_SAMPLE_FROM or above draw their drafts
    from the head's q; greedy rows draft its argmax, token-identical to plain decoding, and rows sampling below
    it too, seed-equal to plain sampling, alone and beside rows of sampled drafts in one batch (each row is
    verified by its own rule); `off` drafts point masses at any temperature, seed-equal to plain sampling."""
    target = tiny_model(seed=3, layers=6)
    path = head_file(target, tmp_path / "h.safetensors", eagle3=method == "eagle3")
    prop = make_proposer(method, target, None, path, "float32", "cpu")
    assert inspect.signature(make_proposer).parameters["sample_drafts"].default == "auto"
    hot, warm = SamplingParams(max(1.0, AUTO_SAMPLE_FROM), 0, 1.0, seed=5), SamplingParams(0.5, 0, 0.9, seed=6)
    assert warm.temperature < AUTO_SAMPLE_FROM

    def plain(params):
        return [s.generated for s in run_engine(target, NoProposer(), [Request(list(p), 16, params) for p in PROMPTS])]

    rec = Recording(prop)
    run_engine(target, rec, [Request(list(p), 16, hot) for p in PROMPTS], k=4)
    assert sampled_rows(rec.drafts) and all(sampled_rows(rec.drafts))
    for params, want in ((SamplingParams(), [reference_greedy(target, p, 16) for p in PROMPTS]), (warm, plain(warm))):
        rec = Recording(prop)
        out = run_engine(target, rec, [Request(list(p), 16, params) for p in PROMPTS], k=4)
        assert [s.generated for s in out] == want
        assert rec.drafts and not any(sampled_rows(rec.drafts))
    rec = Recording(prop)
    mixed = run_engine(target, rec, [Request(list(PROMPTS[0]), 16), Request(list(PROMPTS[1]), 16, hot),
                                     Request(list(PROMPTS[2]), 16, warm)], k=4)
    assert mixed[0].generated == reference_greedy(target, PROMPTS[0], 16)
    assert mixed[2].generated == plain(warm)[2]
    assert any(sampled_rows(rec.drafts)) and not all(sampled_rows(rec.drafts))
    off = Recording(make_proposer(method, target, None, path, "float32", "cpu", sample_drafts="off"))
    seeded = run_engine(target, off, [Request(list(p), 16, hot) for p in PROMPTS], k=4)
    assert [s.generated for s in seeded] == plain(hot)
    assert off.drafts and not any(sampled_rows(off.drafts))


def test_eagle_sampled_drafts_are_reproducible_and_greedy_rows_stay_plain():
    target = tiny_model(seed=21)
    head = head_for(target)
    gen = tiny_generator(target, EagleProposer(head, 1, 4, 4, sample_from=0.0), "fixed", 4)
    a = gen.generate(PROMPTS, max_new_tokens=24, temperature=0.9, seed=3)
    b = gen.generate(PROMPTS, max_new_tokens=24, temperature=0.9, seed=3)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert all(r.metrics["acceptance_rate"] is not None for r in a)                # it drafted
    greedy = gen.generate(PROMPTS, max_new_tokens=24)
    assert [r.tokens for r in greedy] == [reference_greedy(target, p, 24) for p in PROMPTS]
    with pytest.raises(SpecdecError, match="chains"):
        EagleProposer(head, 2, 4, 8, sample_from=0.0)


def test_sample_drafts_is_refused_where_it_does_not_apply():
    target = tiny_model(seed=2)
    with pytest.raises(SpecdecError, match="applies to the EAGLE chains of eagle, eagle3 and hybrid"):
        make_proposer("ngram", target, None, None, "float32", "cpu", TreeShape(), sample_drafts="on")
    with pytest.raises(SpecdecError, match="with a tree"):
        make_proposer("eagle", target, None, None, "float32", "cpu", TreeShape(4, 16), sample_drafts="on")
    with pytest.raises(SpecdecError, match="unknown sample_drafts setting True.*auto, on, off"):
        make_proposer("eagle", target, None, None, "float32", "cpu", TreeShape(), sample_drafts=True)
    assert sample_drafts_from("auto", "eagle", TreeShape(4, 16)) == sample_drafts_from("auto", "ngram") == math.inf
    assert sample_drafts_from("off", "eagle3") == math.inf and sample_drafts_from("on", "eagle3") == 0.0
    assert sample_drafts_from("auto", "eagle3") == sample_drafts_from("auto", "eagle") == AUTO_SAMPLE_FROM


@pytest.mark.parametrize("head_kind", ["eagle", "eagle3"])
def test_a_newcomer_beside_a_long_row_catches_up_within_the_rotary_table(head_kind):
    """A request joins a batch whose other row is 200 tokens along (context 256): the head's catch-up feeds both
    rows' waiting pairs in one forward padded to the newcomer's prompt, whose padding runs past the last
    position the rotary table holds. It is never kept: both outputs stay the target's."""
    target = tiny_model(seed=20, vocab=V, std=0.5, layers=6)
    if head_kind == "eagle":
        head = head_for(target)
    else:
        head = Eagle3Head(target, Eagle3Config.for_target(target, V), torch.arange(V)).init_from_target()
    eng = Engine(target, EagleProposer(head, 1, 4, 4, min_confidence=0.0), make_policy("fixed", 4), lambda ids: "",
                 frozenset())
    eng.allocate(2, 256)
    long, short = [i % V for i in range(200)], [(3 * i) % V for i in range(58)]
    a = eng.add(Request(long, 40))
    with torch.inference_mode():
        for _ in range(3):
            eng.step()
        b = eng.add(Request(short, 5))
        while eng.busy:
            eng.step()
    assert a.generated == reference_greedy(target, long, 40) and b.generated == reference_greedy(target, short, 5)
