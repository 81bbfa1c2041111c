"""Lossless speculative decoding on tiny random models: greedy equality and exact sampling distributions."""
from __future__ import annotations

import random

import pytest
import torch

import specdec.engine as engine_mod
from specdec.draft_length import make_policy
from specdec.engine import Engine, Request
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.reference import exact_distribution, reference_greedy
from specdec.sampling import BatchSampling, SamplingParams
from specdec.verify import Draft, follow, verify, verify_greedy

from helpers import N, PROMPTS, V, check_joint, close_draft, exact_joint, sample_engine, tiny_generator, tiny_model


class ScriptedProposer:
    """Deterministic test proposer: the oracle continuation, a corrupted oracle, or random guesses."""
    name = "scripted"
    feature_layers: tuple[int, ...] = ()

    def __init__(self, truth: dict[tuple, list[int]], mode: str, vocab: int) -> None:
        self.truth, self.mode, self.vocab = truth, mode, vocab
        self.rng = random.Random(0)

    def allocate(self, rows, slots):
        self.prompt = {}

    def start(self, rows, prompts, hidden):
        for r, p in zip(rows.tolist(), prompts):
            self.prompt[r] = tuple(p[:-1])             # histories arrive with the first token

    def propose(self, batch, k):
        out = torch.full((len(batch.tokens), k), -1, dtype=torch.long)
        for i, (r, toks) in enumerate(zip(batch.rows.tolist(), batch.tokens)):
            n = len(toks) - len(self.prompt[r])
            cont = self.truth[self.prompt[r]][n:n + k]
            for j, t in enumerate(cont):
                if self.mode == "random" or (self.mode == "corrupted" and self.rng.random() < 0.3):
                    t = self.rng.randrange(self.vocab)
                out[i, j] = t
        return Draft(out)

    def commit(self, batch, verdict, hidden):
        pass


@pytest.mark.parametrize("mode", ["oracle", "random", "corrupted"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_plain_for_scripted_proposers(mode, k, batch):
    model = tiny_model(seed=7)
    prompts = PROMPTS[:batch]
    truth = {tuple(p): reference_greedy(model, p, 40) for p in prompts}
    gen = tiny_generator(model, ScriptedProposer(truth, mode, 97), "fixed", k)
    results = gen.generate(prompts, max_new_tokens=30)
    for p, r in zip(prompts, results):
        assert r.tokens == truth[tuple(p)][:30]
        m = r.metrics
        assert m["new_tokens"] == 30
        assert m["tau"] == pytest.approx(30 / m["target_forwards"])
        if mode == "oracle":
            assert m["acceptance_rate"] == 1.0 and m["tau"] > 1 + 0.5 * min(k, 3)
        if mode == "random":
            assert m["acceptance_rate"] < 0.2


@pytest.mark.parametrize("policy", ["fixed", "heuristic", "auto"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("gemma", [False, True])
def test_greedy_equals_plain_with_draft_model(policy, k, gemma):
    target = tiny_model(seed=8, gemma=gemma)
    draft = tiny_model(seed=8, gemma=gemma, layers=1)                      # a truncated copy: some accepted
    draft.load_state_dict({n: p for n, p in target.state_dict().items() if not n.startswith("layers.1.")})
    gen = tiny_generator(target, DraftModelProposer(draft), policy, k)
    results = gen.generate(PROMPTS, max_new_tokens=25)
    for p, r in zip(PROMPTS, results):
        assert r.tokens == reference_greedy(target, p, 25)
    assert any(r.metrics["acceptance_rate"] > 0 for r in results)


def test_greedy_equals_plain_with_ngram_and_eos():
    model = tiny_model(seed=9)
    prompt = [5, 6, 7, 8] * 6
    plain = tiny_generator(model, eos=11).generate(prompt, max_new_tokens=40)
    spec = tiny_generator(model, NgramProposer(1, 3), "fixed", 4, eos=11).generate(prompt, max_new_tokens=40)
    assert spec.tokens == plain.tokens == reference_greedy(model, prompt, 40, frozenset({11}))
    assert spec.finish_reason == plain.finish_reason


def test_identical_draft_accepts_everything():
    target = tiny_model(seed=10)
    gen = tiny_generator(target, DraftModelProposer(target), "fixed", 4)
    for temp in (0.0, 1.0):
        r = gen.generate(PROMPTS[1], max_new_tokens=30, temperature=temp, top_k=20, seed=3)
        assert r.metrics["acceptance_rate"] == 1.0                       # p == q: nothing is rejected


def test_seeded_sampling_is_reproducible_and_batch_independent():
    model = tiny_model(seed=11)
    gen = tiny_generator(model, DraftModelProposer(tiny_model(seed=12, layers=1)), "fixed", 3)
    a = gen.generate(PROMPTS[0], max_new_tokens=20, temperature=0.9, seed=5)
    b = gen.generate(PROMPTS[0], max_new_tokens=20, temperature=0.9, seed=5)
    c = gen.generate(PROMPTS[0], max_new_tokens=20, temperature=0.9, seed=6)
    eng = gen.engine(2, 80)
    seqs = [eng.add(Request(p, 20, SamplingParams(0.9, seed=s))) for p, s in ((PROMPTS[1], 9), (PROMPTS[0], 5))]
    with torch.inference_mode():
        while eng.busy:
            eng.step()
    assert a.tokens == b.tokens == seqs[1].generated
    assert a.tokens != c.tokens


# ---- exact sampling distributions -------------------------------------------------------------
SAMPLING = [SamplingParams(0.7, 5, 0.9), SamplingParams(1.0, 6, 0.95)]


SLOW_20K = pytest.mark.slow          # 20,000 sequences each: `make test`; the fast loop keeps the deterministic case
                                     # and the smaller certificates (test_certificates.py) of sampled drafts


@pytest.mark.parametrize("params", SAMPLING, ids=["t0.7", "t1.0"])
@pytest.mark.parametrize("proposer", [pytest.param("bad_draft", marks=SLOW_20K),
                                      pytest.param("close_draft", marks=SLOW_20K), "deterministic",
                                      pytest.param("reduced_vocab_draft", marks=SLOW_20K)])
def test_speculative_sampling_matches_exact_distribution(params, proposer):
    target = tiny_model(seed=20, vocab=V, std=0.5)
    prompt = [1, 2, 3]
    if proposer == "bad_draft":
        prop = DraftModelProposer(tiny_model(seed=21, vocab=V, std=0.5, layers=1))
    elif proposer == "close_draft":
        prop = DraftModelProposer(close_draft())
    elif proposer == "reduced_vocab_draft":                          # q = 0 outside 5 of the 8 tokens
        from specdec.models.distilled import DistilledDraft
        prop = DraftModelProposer(DistilledDraft(target, torch.tensor([0, 2, 3, 5, 7]), [1]).prepare(torch.float32))
    else:
        prop = NgramProposer(1, 2)                                   # point-mass drafts
        prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    exact = exact_joint(target, prompt, params)
    samples = sample_engine(target, prop, params, prompt)
    assert check_joint(samples, exact) > 1e-3


# ---- tests that catch the classic bugs (each mutant must be detected) ----------------------------
@SLOW_20K
def test_catches_q_without_the_transform(monkeypatch):
    """Drafts sampled from the transformed q but verified against an untransformed q: detected."""
    params = SAMPLING[0]
    target = tiny_model(seed=20, vocab=V, std=0.5)
    prompt = [1, 2, 3]
    exact = exact_joint(target, prompt, params)
    prop = DraftModelProposer(close_draft())
    import specdec.proposers.draft_model as dm
    real_probs, real_sample = dm.to_probs, dm.sample
    transform = BatchSampling.of([params] * N)

    def raw_q(logits, s):                                             # q reported without the transform
        return torch.softmax(logits.float(), -1)

    def sample_transformed(q, u):                                     # drafts still sampled with it
        return real_sample(real_probs(q.log()[:, None], transform.select(torch.arange(q.shape[0])))[:, 0], u)

    monkeypatch.setattr(dm, "to_probs", raw_q)
    monkeypatch.setattr(dm, "sample", sample_transformed)
    assert check_joint(sample_engine(target, prop, params, prompt), exact) < 1e-5


def test_catches_bonus_from_wrong_position(monkeypatch):
    def shifted(p):
        p = p.clone()
        if p.shape[1] > 1:
            p[:, -1] = p[:, -2]                                      # bonus from the previous position
        return p

    def buggy(draft, p, u_target, u_accept):
        return verify(draft, shifted(p), u_target, u_accept)

    def buggy_greedy(tokens, top):                                   # the greedy fast path, equally wrong
        return follow(tokens, shifted(top[..., None].float())[..., 0].long())

    monkeypatch.setattr(engine_mod, "verify", buggy)
    monkeypatch.setattr(engine_mod, "follow", buggy_greedy)
    model = tiny_model(seed=7)
    truth = {tuple(PROMPTS[1]): reference_greedy(model, PROMPTS[1], 40)}
    gen = tiny_generator(model, ScriptedProposer(truth, "oracle", 97), "fixed", 4)
    assert gen.generate(PROMPTS[1], max_new_tokens=30).tokens != truth[tuple(PROMPTS[1])][:30]


@pytest.mark.parametrize("broken", [False, True])
def test_draft_cache_rolls_back_after_rejection(monkeypatch, broken):
    """After every step the draft's cache equals a fresh prefill of the tokens it has seen."""
    target, draft = tiny_model(seed=30), tiny_model(seed=31, layers=1)
    prop = DraftModelProposer(draft)
    if broken:
        monkeypatch.setattr(type(draft.new_cache(1, 1)), "truncate", lambda self, rows, lengths: None)
    eng = Engine(target, prop, make_policy("fixed", 4), lambda ids: "", frozenset())
    eng.allocate(2, 80)
    for p in PROMPTS[:2]:
        eng.add(Request(p, 40))
    mismatch = False
    with torch.inference_mode():
        while eng.busy and not mismatch:
            eng.step()
            for s in eng.active:
                fed = prop.fed[s.row]
                if int(prop.cache.lengths[s.row]) != fed:
                    mismatch = True
                    continue
                rows = torch.tensor([s.row])
                # score the next unseen token from the cache and from scratch
                nxt = s.tokens[fed] if fed < len(s.tokens) else 0
                h = draft(torch.tensor([[nxt]]), torch.tensor([[fed]]), prop.cache, rows)
                got = draft.lm_head(h[0, 0])
                want = exact_distribution(draft, s.tokens[:fed] + [nxt])
                mismatch |= not torch.allclose(got, want, atol=1e-4)
    assert mismatch == broken


def test_speculation_can_be_disabled_per_sequence():
    model = tiny_model(seed=7)
    truth = {tuple(p): reference_greedy(model, p, 40) for p in PROMPTS[:2]}
    eng = Engine(model, ScriptedProposer(truth, "oracle", 97), make_policy("fixed", 4), lambda ids: "", frozenset())
    eng.allocate(2, 80)
    on, off = eng.add(Request(PROMPTS[0], 30)), eng.add(Request(PROMPTS[1], 30, speculate=False))
    with torch.inference_mode():
        while eng.busy:
            eng.step()
    assert on.generated == truth[tuple(PROMPTS[0])][:30] and off.generated == truth[tuple(PROMPTS[1])][:30]
    assert on.counters.accepted > 0 and off.counters.drafted == 0 and off.counters.target_forwards == 30


def test_rows_are_reused_lowest_first_and_kept_in_order():
    """Joins and leaves at step boundaries: a newcomer takes the lowest free cache row, the batch stays
    ordered by row (so a dense batch is read from the cache in place), and every output stays exact."""
    model = tiny_model(seed=7)
    prompts = PROMPTS + [[8, 6, 4, 2]]
    truth = {tuple(p): reference_greedy(model, p, 12) for p in prompts}
    eng = Engine(model, NgramProposer(), make_policy("fixed", 3), lambda ids: "", frozenset())
    eng.allocate(4, 60)
    lengths = [12, 3, 12]
    seqs = [eng.add(Request(p, n)) for p, n in zip(PROMPTS, lengths)]
    assert [s.row for s in seqs] == [0, 1, 2]
    late = None
    with torch.inference_mode():
        while eng.busy:
            eng.step()
            if late is None and seqs[1].done:                  # row 1 freed: the newcomer must take it, not row 3
                late = eng.add(Request(prompts[3], 12))
            assert [s.row for s in eng.active] == sorted(s.row for s in eng.active)
    assert late is not None and late.row == 1
    for s, p, n in zip(seqs + [late], prompts, lengths + [12]):
        assert s.generated == truth[tuple(p)][:n]


def test_greedy_verification_from_logits_is_sampling_the_one_hot_for_any_uniform():
    """The greedy fast path (argmax of the logits) keeps what sampling the greedy one-hot keeps, ties included
    (the first index), whatever the uniforms."""
    from specdec.sampling import sample, to_probs
    from specdec.verify import PAD, verify_point_masses

    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (6, 5, 11), generator=g).float()          # many ties
    y = logits.argmax(-1)
    drafts = torch.where(torch.rand(6, 4, generator=g) < 0.7, y[:, :4], torch.randint(0, 11, (6, 4), generator=g))
    drafts[5, 2:] = PAD
    greedy = BatchSampling.of([SamplingParams(temperature=0.0)] * 6)
    fast = verify_greedy(drafts, logits)
    for seed in range(5):
        u = torch.rand(6, 5, generator=torch.Generator().manual_seed(seed))
        slow = verify_point_masses(drafts, to_probs(logits, greedy), u)
        assert torch.equal(fast.num_accepted, slow.num_accepted) and torch.equal(fast.tokens, slow.tokens)
        assert torch.equal(fast.path, slow.path) and torch.equal(fast.target_tokens, slow.target_tokens)
    assert torch.equal(sample(to_probs(logits, greedy), torch.full((6, 5), 0.999)), y)
    assert int(fast.num_accepted.sum()) > 0
    fields = ("num_accepted", "tokens", "path", "target_tokens", "num_new")
    for k in (0, 2):                                                        # nothing drafted (plain decoding), 2
        fast = verify_greedy(drafts[:, :k], logits[:, :k + 1])
        slow = verify_point_masses(drafts[:, :k], to_probs(logits[:, :k + 1], greedy), torch.rand(6, k + 1))
        for name in fields:
            a, b = getattr(fast, name), getattr(slow, name)
            assert torch.equal(a, b) and a.dtype == b.dtype == torch.long, name


def test_one_generator_used_from_several_threads_takes_turns():
    """The proposer keeps per-generation state (a draft model's cache rows): concurrent calls must not share it.
    Threads take turns, each output equal to its sequential one; a second generation inside a running stream of
    the same thread is refused (it would deadlock or share the state)."""
    import threading

    from specdec.errors import SpecdecError

    target = tiny_model(seed=10)
    gen = tiny_generator(target, DraftModelProposer(tiny_model(seed=12, layers=1)), "fixed", 3)
    prompts = [p for p in PROMPTS[:4]]
    want = [gen.generate(p, max_new_tokens=40).tokens for p in prompts]
    got: list = [None] * len(prompts)

    def run(i: int) -> None:
        got[i] = gen.generate(prompts[i], max_new_tokens=40).tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    stream = gen.stream(prompts[0], max_new_tokens=40)
    next(stream)
    with pytest.raises(SpecdecError, match="already generating in this thread"):
        gen.generate(prompts[1], max_new_tokens=4)
    stream.close()
    assert gen.generate(prompts[1], max_new_tokens=40).tokens == want[1]                  # the turn is free again
