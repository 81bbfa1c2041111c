"""Learning from traffic (`specdec serve --learn`): the EAGLE-3 head learns between steps, outputs do not change."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from helpers import tiny_generator, tiny_model
from specdec.engine import Request
from specdec.errors import SpecdecError
from specdec.models.eagle3 import Eagle3Config, Eagle3Head
from specdec.proposers.base import NoProposer
from specdec.proposers.eagle import EagleProposer
from specdec.reference import reference_greedy
from specdec.sampling import SamplingParams
from specdec.server import ServeConfig, ServerState
from specdec.server.learn import AcceptanceStats, LearnConfig, TrafficBuffer, earlier_report
from specdec.server.scheduler import Done, Job, SpecChoice

PROMPTS = [[5, 17, 3, 44, 90, 12, 7], [61, 33, 2, 80, 15, 9, 9, 4, 71], [3, 5, 7, 9, 11], [42, 1, 42, 1, 42, 8]]
NEW = 24
GREEDY = SamplingParams(0.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on one torch thread: a worker thread driving OpenMP teams beside the main thread's makes
    every parallel region sleep and wake (server/scheduler.py), several times slower on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=3, layers=6).pack()


@pytest.fixture(scope="module")
def head_file(target, tmp_path_factory) -> Path:
    """A tiny random EAGLE-3 head for the tiny target, as a weights file (what the server loads)."""
    torch.manual_seed(0)
    ids = torch.arange(0, 80, 2)
    head = Eagle3Head(target, Eagle3Config.for_target(target, len(ids)), ids).init_from_target()
    path = tmp_path_factory.mktemp("head") / "eagle3-tiny.safetensors"
    head.save(path, {})
    return path


def state_for(target, head_file: Path, learn: LearnConfig) -> ServerState:
    head = Eagle3Head.load(head_file, target)
    gen = tiny_generator(target, EagleProposer(head, 1, 4, 4, name="eagle3"), "fixed", 4)
    return ServerState(gen, ServeConfig(max_batch=4, max_prompt_tokens=32, max_tokens=NEW, prefix_cache_mb=0,
                                        learn=learn), drafts={"eagle3": str(head_file)},
                       sample_drafts="off")          # point masses at every temperature: seed-equal to plain


def serve(state: ServerState, requests: list[Request], method: str = "eagle3") -> list[list[int]]:
    """Each request's output tokens, the requests submitted together to the running scheduler."""
    async def run() -> list[Done]:
        jobs = [Job.create(r, SpecChoice(method, 4 if method != "none" else 0)) for r in requests]
        for j in jobs:
            state.scheduler.submit(j)
        out = []
        for j in jobs:
            while not isinstance(event := await j.events.get(), Done):
                assert not hasattr(event, "status"), event
            out.append(event)
        return out
    return [[int(t) for t in d.text.split()] for d in asyncio.run(run())]


def requests(sampling: SamplingParams) -> list[Request]:
    return [Request(p, NEW, sampling) for p in PROMPTS]


def wait_for(cond, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def live_head(state: ServerState) -> Eagle3Head:
    return state.pool.engines[state.default].proposer.head


def learn_config(path: Path, **kw) -> LearnConfig:
    return LearnConfig(enabled=True, checkpoint=str(path), train_dtype="float32", lr=1e-2, window=12, **kw)


def test_outputs_are_unchanged_while_the_head_learns(target, head_file, tmp_path):
    """Greedy output equals plain decoding and seeded sampling equals plain sampling (point-mass drafts),
    before and after the head learnt from the same traffic; the live head's weights changed."""
    plain = state_for(target, head_file, LearnConfig())
    seeded = SamplingParams(1.0, 0, 1.0, seed=11)
    want_greedy = [reference_greedy(target, p, NEW) for p in PROMPTS]
    plain.scheduler.start()
    try:                                                          # one worker at a time: they share the cores
        want_sampled = serve(plain, requests(seeded), method="none")
        assert serve(plain, requests(GREEDY)) == want_greedy
        assert serve(plain, requests(seeded)) == want_sampled     # point-mass drafts: seed-equal to plain
    finally:
        plain.scheduler.stop()
    learning = state_for(target, head_file, learn_config(tmp_path / "learnt.safetensors"))
    before = {k: v.clone() for k, v in live_head(learning).state_dict().items()}
    learner = learning.learner
    learning.scheduler.start()
    try:
        for round in range(2):
            assert serve(learning, requests(GREEDY)) == want_greedy, round
            assert serve(learning, requests(seeded)) == want_sampled, round
            updates = learner.updates
            wait_for(lambda: learner.updates >= updates + 5)      # the idle worker learns
    finally:
        learning.scheduler.stop()
    assert learner.tokens_learnt > 0 and learner.buffer.tokens > 0
    after = live_head(learning).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before if k != "vocab_ids")
    assert torch.equal(before["vocab_ids"], after["vocab_ids"])
    rates = learner.stats["eagle3"].rates()
    assert rates["before"] and rates["recent"]
    assert learner.stats["eagle3"].requests["before"] >= 1        # those that finished before the first update
    text = generate_latest(learning.metrics.registry).decode()      # what /metrics serves
    assert f"specdec:learn_updates_total {float(learner.updates)}" in text
    assert f"specdec:learn_tokens_total {float(learner.tokens_learnt)}" in text
    for phase in ("before", "recent"):
        assert f'specdec:learn_acceptance_first{{method="eagle3",phase="{phase}"}} {rates[phase][0]}' in text
        assert f'specdec:learn_acceptance_per_pos{{method="eagle3",phase="{phase}",position="0"}}' in text
    assert 'method="hybrid"' not in text                          # no hybrid request yet


def test_hybrid_requests_teach_the_head_that_eagle3_drafts_with(target, head_file, tmp_path):
    """hybrid drafts with the same EAGLE-3 head where prompt lookup misses: its requests are learnt from,
    its outputs stay plain decoding's, and the eagle3 engine drafts with what hybrid traffic taught."""
    state = state_for(target, head_file, learn_config(tmp_path / "learnt.safetensors"))
    learner = state.learner
    want = [reference_greedy(target, p, NEW) for p in PROMPTS]
    state.scheduler.start()
    try:
        assert serve(state, requests(GREEDY), method="hybrid") == want
        wait_for(lambda: learner.updates >= 5)
        assert serve(state, requests(GREEDY), method="hybrid") == want
        assert serve(state, requests(GREEDY)) == want
    finally:
        state.scheduler.stop()
    hybrid = next(e for spec, e in state.pool.engines.items() if spec.method == "hybrid").proposer
    assert hybrid.method == "hybrid" and learner.stats["hybrid"].requests["before"] == len(PROMPTS)
    learnt = learner.trainer.head.state_dict()
    for head in (hybrid.head, live_head(state)):                  # both engines draft with the learnt weights
        assert all(torch.equal(v, learnt[k].to(v.dtype)) for k, v in head.state_dict().items() if k != "vocab_ids")
    text = generate_latest(state.metrics.registry).decode()
    assert 'specdec:learn_requests{method="hybrid",phase="before"} 4.0' in text


def test_the_learnt_head_is_kept_and_drafted_with_after_a_restart(target, head_file, tmp_path):
    path = tmp_path / "learnt.safetensors"
    first = state_for(target, head_file, learn_config(path))
    first.scheduler.start()
    try:
        serve(first, requests(GREEDY))
        wait_for(lambda: first.learner.updates >= 3)
    finally:
        first.scheduler.stop()                                   # the worker's last act writes the checkpoint
    assert path.exists()
    learnt = {k: v.to(torch.bfloat16) for k, v in first.learner.trainer.head.state_dict().items()}
    again = state_for(target, head_file, learn_config(path))      # drafts with the checkpoint at once
    shipped = Eagle3Head.load(head_file, target).state_dict()
    loaded = live_head(again).state_dict()
    weights = [k for k in learnt if k != "vocab_ids"]
    assert all(torch.equal(loaded[k].to(torch.bfloat16), learnt[k]) for k in weights)
    assert any(not torch.equal(loaded[k], shipped[k]) for k in weights)
    assert earlier_report(path)["learnt_updates"] == first.learner.updates
    again.scheduler.start()
    try:
        assert serve(again, requests(GREEDY)) == [reference_greedy(target, p, NEW) for p in PROMPTS]
        wait_for(lambda: again.learner.updates >= 1)
    finally:
        again.scheduler.stop()
    assert earlier_report(path)["learnt_updates"] == first.learner.updates + again.learner.updates   # across restarts


def test_a_checkpoint_of_another_target_is_refused_at_start(target, head_file, tmp_path):
    other = tiny_model(seed=9, layers=6).pack()
    with pytest.raises(SpecdecError, match="another target"):
        state_for(other, head_file, LearnConfig(enabled=True, checkpoint=str(head_file), train_dtype="float32"))


def test_a_checkpoint_that_does_not_fit_or_cannot_be_written_is_refused_at_start(target, head_file, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    meta = safe_open(str(head_file), "pt").metadata()
    sd = load_file(str(head_file))
    misshapen = tmp_path / "misshapen.safetensors"
    save_file({**sd, "fc.weight": sd["fc.weight"][:, :7].contiguous()}, str(misshapen), meta)
    outside = tmp_path / "outside.safetensors"
    save_file({**sd, "vocab_ids": sd["vocab_ids"] + 1000}, str(outside), meta)
    (tmp_path / "a-file").write_text("x")
    for path, message in [(misshapen, "does not fit an EAGLE-3 head: RuntimeError: .*size mismatch"),
                          (outside, "vocabulary ids leave the target's vocabulary"),
                          (tmp_path, "--learn-checkpoint .* is a directory; give a file path"),
                          (tmp_path / "a-file" / "head.safetensors",
                           "the folder of --learn-checkpoint .* is a file, not a directory")]:
        with pytest.raises(SpecdecError, match=message):
            state_for(target, head_file, LearnConfig(enabled=True, checkpoint=str(path), train_dtype="float32"))
    with pytest.raises(SpecdecError, match="does not fit an EAGLE-3 head"):             # also as a --draft-model
        Eagle3Head.load(misshapen, target)


def test_one_server_at_a_time_learns_into_a_checkpoint(target, head_file, tmp_path):
    """A second learner on the same file is refused (the last save would drop the first one's learning) until
    the first one closes; a report that is JSON but no object counts as none."""
    from safetensors.torch import load_file, save_file

    from specdec.server.learn import OnlineLearner
    from prometheus_client import CollectorRegistry

    path = tmp_path / "learnt.safetensors"
    first = OnlineLearner(learn_config(path), target, "tiny", CollectorRegistry())
    with pytest.raises(SpecdecError, match="another specdec server learns into .*learnt.safetensors"):
        OnlineLearner(learn_config(path), target, "tiny", CollectorRegistry())
    first.close()
    OnlineLearner(learn_config(path), target, "tiny", CollectorRegistry()).close()
    odd = tmp_path / "odd.safetensors"
    save_file(load_file(str(head_file)), str(odd), {"report": "[1, 2]"})
    assert earlier_report(odd) == {}


def test_a_request_that_started_before_the_first_update_counts_before(target, tmp_path):
    """Phase `before` is about the head a request started with: one in flight when the first update lands is
    counted `before`; one that starts after it is not; the head's own drafts are counted, a prediction's not."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from specdec.metrics import Counters
    from specdec.server.learn import FeatureTap, OnlineLearner

    class Inner:
        name, feature_layers, head = "eagle3", (), None

        def start(self, rows, prompts, hidden):
            pass

    learner = OnlineLearner(learn_config(tmp_path / "l.safetensors"), target, "tiny", CollectorRegistry())
    tap = FeatureTap(Inner(), "eagle3")
    learner.taps[id(tap)] = tap

    def finish(row: int) -> None:
        c = Counters()
        c.record_step(2, 1, 2)
        c.record_step(8, 8, 9, predicted=True)
        learner.finished(tap, SimpleNamespace(row=row, tokens=[1, 2, 3, 4], counters=c))

    tap.start(torch.tensor([0]), [[5, 6, 7]], torch.zeros(1, 3, 4))
    tap.learnt = True                                         # the first update reaches the head meanwhile
    tap.start(torch.tensor([1]), [[5, 6, 7]], torch.zeros(1, 3, 4))
    finish(0)
    finish(1)
    stats = learner.stats["eagle3"]
    assert stats.requests["before"] == 1 and stats.before == ([1, 1], [1, 0])
    assert len(stats.recent) == 2
    learner.close()


def test_the_buffer_keeps_the_most_recent_tokens():
    buf = TrafficBuffer(10)
    for n in (4, 4, 4):
        buf.add(list(range(n)), torch.zeros(n, 3))
    assert buf.tokens == 8 and len(buf.seqs) == 2
    buf.add(list(range(30)), torch.arange(30.0)[:, None].expand(30, 3))
    assert buf.tokens == 10 and buf.seqs[0][1][0, 0] == 20


def test_acceptance_before_learning_and_over_recent_requests():
    stats = AcceptanceStats(recent=2)
    stats.add([4, 2], [2, 1], learnt=False)
    stats.add([], [], learnt=False)                               # drafted nothing: not counted
    stats.add([4, 4], [4, 4], learnt=True)
    stats.add([2], [2], learnt=True)
    r = stats.rates()
    assert r["before"] == [0.5, 0.5] and stats.requests["before"] == 1
    assert r["recent"] == [1.0, 1.0]


def test_collected_features_are_the_targets_features_of_each_position(target, head_file, tmp_path):
    """What the tap collects from prefill and verification equals a fresh prefill of the finished sequence,
    position by position (the pairs training reads are aligned)."""
    from specdec.train.eagle3 import extract_aux

    state = state_for(target, head_file, learn_config(tmp_path / "l.safetensors", passes=1e-9))
    state.scheduler.start()
    try:
        outs = serve(state, requests(GREEDY))
    finally:
        state.scheduler.stop()
    layers = live_head(state).feature_layers
    seen = {tuple(t) for t, _ in state.learner.buffer.seqs}
    assert seen == {tuple(p + o)[:-1] for p, o in zip(PROMPTS, outs)}     # every token but the unscored last
    for tokens, feats in state.learner.buffer.seqs:
        want = extract_aux(target, [tokens], layers)[0]                   # [T, H*(1+3)] bfloat16
        assert feats.shape == want.shape == (len(tokens), 4 * target.config.dim)
        assert torch.allclose(feats.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_a_step_drafts_and_commits_with_one_set_of_weights(target, head_file, tmp_path, monkeypatch):
    """Learning as often as it may (busy_share 1: an update at every step boundary): the head's weights
    changed between steps, never between a step's drafting and its commit."""
    from specdec.server.learn import FeatureTap

    seen: list[tuple[str, float]] = []
    checksum = lambda tap: float(tap.head.fc.weight.float().sum())      # noqa: E731
    propose, commit = FeatureTap.propose, FeatureTap.commit
    monkeypatch.setattr(FeatureTap, "propose", lambda self, b, k: seen.append(("propose", checksum(self)))
                        or propose(self, b, k))
    monkeypatch.setattr(FeatureTap, "commit", lambda self, b, v, h: seen.append(("commit", checksum(self)))
                        or commit(self, b, v, h))
    state = state_for(target, head_file, learn_config(tmp_path / "l.safetensors", busy_share=1.0))
    state.scheduler.start()
    try:
        serve(state, requests(GREEDY)[:1])                     # the buffer gets traffic; then a busy round
        serve(state, [Request(p, NEW, GREEDY) for p in PROMPTS] * 2)
    finally:
        state.scheduler.stop()
    steps = [(a[1], b[1]) for a, b in zip(seen, seen[1:]) if a[0] == "propose" and b[0] == "commit"]
    assert steps and all(a == b for a, b in steps)
    assert len({c for _, c in seen}) > 2                      # the weights did change, between steps


def test_the_start_up_line_says_when_the_default_method_does_not_learn():
    from specdec.cli_serve import learn_line

    assert learn_line("hybrid", Path("h.safetensors")).endswith("(head kept in h.safetensors)")
    assert "suffix drafts without the head (--method hybrid" in learn_line("suffix", Path("h.safetensors"))


def test_learning_without_a_head_to_learn_into_is_refused_at_start(target, head_file, tmp_path):
    """A model with no shipped EAGLE-3 head, none given and no checkpoint yet: nothing to learn into."""
    gen = tiny_generator(target, NoProposer(), "fixed", 4)
    with pytest.raises(SpecdecError, match=r"--learn trains an EAGLE-3 head, and none is shipped for .*give one "
                                           r"\(--method eagle3 --draft-model HEAD.safetensors"):
        ServerState(gen, ServeConfig(max_batch=2, max_prompt_tokens=32, max_tokens=NEW, prefix_cache_mb=0,
                                     learn=learn_config(tmp_path / "head.safetensors")))
    state = ServerState(gen, ServeConfig(max_batch=2, max_prompt_tokens=32, max_tokens=NEW, prefix_cache_mb=0,
                                         learn=learn_config(tmp_path / "head.safetensors")),
                        drafts={"eagle3": str(head_file)})                           # a head given: it learns
    assert state.pool.drafts["eagle3"] == str(head_file)
