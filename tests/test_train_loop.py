"""Training runs checkpoint and resume; a real (short) `specdec train medusa` run on the default target."""
from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable

import pytest
import torch

from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.models.medusa import MedusaHeads
from specdec.train.loop import Checkpoint, train_loop


def _toy(seed: int = 0) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 1)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _stepper(m: torch.nn.Linear, at_call: int, act) -> Callable[[], tuple[torch.Tensor, dict]]:
    """A training step on fixed toy data that calls `act()` on its `at_call`-th call."""
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    calls = []

    def step_fn():
        calls.append(1)
        if len(calls) == at_call:
            act()
        return torch.nn.functional.mse_loss(m(x), y), {}
    return step_fn


def _interrupt():
    raise KeyboardInterrupt


def test_interrupted_run_saves_and_resumes(tmp_path):
    out = tmp_path / "toy.safetensors"
    m, opt = _toy()
    step_fn = _stepper(m, 6, _interrupt)

    with pytest.raises(KeyboardInterrupt):
        train_loop("toy", list(m.parameters()), opt, 1e-2, 10.0, Checkpoint(out, m, opt, random.Random(0)), step_fn)
    assert out.with_suffix(".ckpt").exists()
    w_saved = m.weight.detach().clone()

    m2, opt2 = _toy(seed=1)                                    # a fresh process: other weights, empty optimiser
    ck = Checkpoint(out, m2, opt2, random.Random(0))
    step, spent = ck.resume()
    assert step == 5 and 0 < spent < 10
    assert torch.equal(m2.weight, w_saved)
    assert opt2.state_dict()["state"][0]["step"] == 5         # Adam moments came back too
    ck.done()
    assert not out.with_suffix(".ckpt").exists()


def test_a_checkpoint_of_other_settings_is_a_one_line_error(tmp_path):
    out = tmp_path / "toy.safetensors"
    m, opt = _toy()
    Checkpoint(out, m, opt, random.Random(0)).save(3, 1.0)
    other = torch.nn.Linear(5, 2)                                           # e.g. another --heads
    with pytest.raises(SpecdecError, match="toy.ckpt holds a run this command cannot resume .*--overwrite"):
        Checkpoint(out, other, torch.optim.AdamW(other.parameters()), random.Random(0)).resume()


def test_a_checkpoint_over_another_draft_vocabulary_is_refused(tmp_path):
    """Buffers (a head's draft vocabulary) are part of what a run is: a resume over other data, whose vocabulary
    the loss was built from, would train weights for one vocabulary under another's ids."""
    out = tmp_path / "toy.safetensors"
    m, opt = _toy()
    m.register_buffer("vocab_ids", torch.arange(8))
    Checkpoint(out, m, opt, random.Random(0)).save(3, 1.0)
    m2, opt2 = _toy()
    m2.register_buffer("vocab_ids", torch.arange(8) * 2)
    with pytest.raises(SpecdecError, match="over another vocab_ids than this command's") as refused:
        Checkpoint(out, m2, opt2, random.Random(0)).resume()
    assert "cannot resume" not in str(refused.value)                        # said once, not wrapped in another
    m3, opt3 = _toy()
    m3.register_buffer("vocab_ids", torch.arange(8))
    assert Checkpoint(out, m3, opt3, random.Random(0)).resume()[0] == 3


def test_overwrite_starts_afresh(tmp_path):
    from specdec.train.features import begin

    out = tmp_path / "head.safetensors"
    out.write_bytes(b"x")
    out.with_suffix(".ckpt").write_bytes(b"an interrupted run")
    out.with_suffix(".json").write_text("{}")                 # a finished run's report
    with pytest.raises(SpecdecError, match="no-such-model"):
        begin("no-such-model", out, overwrite=True, seed=0, data=tmp_path)
    assert not out.with_suffix(".ckpt").exists() and not out.with_suffix(".json").exists()


def test_a_resumed_curve_drops_the_points_after_its_checkpoint(tmp_path):
    from specdec.train.eagle3 import Curve

    out = tmp_path / "head.safetensors"
    m, opt = _toy()
    ckpt = Checkpoint(out, m, opt, random.Random(0))
    ckpt.save(9, 1.0)
    curve_file = out.with_suffix(".curve.jsonl")
    curve_file.write_text("".join(json.dumps({"step": s}) + "\n" for s in (3, 6, 9, 12, 15)))
    ckpt.resume()
    curve = Curve(out, ckpt)
    curve.add(10, 100, 1.0, {"chat": [0.5]})
    assert [json.loads(line)["step"] for line in curve_file.read_text().splitlines()] == [3, 6, 9, 10]


def test_sigterm_stops_a_run_like_ctrl_c_and_keeps_its_state(tmp_path):
    """`kill` reaches a background run as SIGTERM (its SIGINT is ignored): the loop saves its checkpoint and
    stops as on Ctrl-C; afterwards the previous SIGTERM handler is back."""
    import signal

    out = tmp_path / "toy.safetensors"
    m, opt = _toy()
    step_fn = _stepper(m, 4, lambda: os.kill(os.getpid(), signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        train_loop("toy", list(m.parameters()), opt, 1e-2, 10.0, Checkpoint(out, m, opt, random.Random(0)), step_fn)
    assert signal.getsignal(signal.SIGTERM) is before
    step, _ = Checkpoint(out, *_toy(seed=1), random.Random(0)).resume()
    assert 3 <= step <= 4                                     # the signal lands during step 4 or just after


def test_a_resumed_run_draws_the_batches_an_uninterrupted_run_would(tmp_path):
    """The batch sampler's state is in the checkpoint as of the last finished step: a resumed run goes on
    with the next batches, not the first ones again (and a step cut short gives its draws back)."""
    out = tmp_path / "toy.safetensors"
    expected = random.Random(0)
    expected = [expected.random() for _ in range(6)]

    def run(stop_at: int) -> list[float]:
        m, opt = _toy()
        rng, drawn = random.Random(0), []

        def step_fn():
            drawn.append(rng.random())
            if len(drawn) == stop_at:
                raise KeyboardInterrupt
            return m(torch.ones(1, 4)).sum(), {}
        with pytest.raises(KeyboardInterrupt):
            train_loop("toy", list(m.parameters()), opt, 1e-2, 10.0, Checkpoint(out, m, opt, rng), step_fn)
        return drawn

    assert run(4) == expected[:4]                # steps 1-3 done, the 4th cut short
    assert run(3) == expected[3:6]               # steps 4-5, then the 6th cut short


def test_a_finished_loop_keeps_a_checkpoint_until_the_weights_are_written(tmp_path):
    """The final validation after the loop may take minutes: an interrupt there loses no step."""
    out = tmp_path / "toy.safetensors"
    m, opt = _toy()
    steps, _ = train_loop("toy", list(m.parameters()), opt, 1e-2, 0.5 / 60, Checkpoint(out, m, opt, random.Random(0)),
                          lambda: (m(torch.ones(1, 4)).sum(), {}))
    m2, opt2 = _toy(seed=1)
    ck = Checkpoint(out, m2, opt2, random.Random(0))
    assert ck.resume()[0] == steps and torch.equal(m2.weight, m.weight)
    assert train_loop("toy", list(m2.parameters()), opt2, 1e-2, 0.5 / 60, ck, lambda: 1 / 0)[0] == steps


def test_budget_counts_across_runs(tmp_path):
    out = tmp_path / "toy.safetensors"
    m, opt = _toy()
    ck = Checkpoint(out, m, opt, random.Random(0))
    ck.save(step=7, seconds=3600.0)                            # an earlier run already spent an hour
    steps, minutes = train_loop("toy", list(m.parameters()), opt, 1e-2, 30.0, Checkpoint(out, m, opt, random.Random(0)),
                                lambda: (m(torch.ones(1, 4)).sum(), {}))
    assert steps == 7 and minutes >= 60                        # nothing left of a 30-minute budget


def test_train_medusa_end_to_end(tmp_path, capsys):
    """Stdout holds the report as JSON alone (the dtype, resume and step lines go to stderr, with where the files
    went)."""
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"tokens": [1 + (i * 37 + j * 11) % 900 for j in range(40 + i)]} for i in range(12)]
    (data / "shard-0000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "heads.safetensors"
    assert main(["train", "medusa", "--data", str(data), "--out", str(out), "--minutes", "0.05",
                 "--heads", "2", "--window", "16", "--batch", "2"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["steps"] > 0 and report["sequences"] == 12
    assert len(report["heldout_top1_agreement_per_head"]) == 2
    printed = capsys.readouterr()
    assert json.loads(printed.out) == report
    assert f"wrote {out} (and heads.json beside it)" in printed.err and "training dtype:" in printed.err
    assert not out.with_suffix(".ckpt").exists()
    assert [p.name for p in data.iterdir()] == ["shard-0000.jsonl"]          # features are cached elsewhere
    from specdec.train.features import default_feature_dir

    kept = list(default_feature_dir("smollm2-135m").glob("features-12-*.pt"))
    assert kept
    for f in kept:
        f.unlink()
    from specdec.api import load_model

    target, _, _ = load_model("smollm2-135m", "float32")
    assert MedusaHeads.load(out, target).n_heads == 2


def test_auto_trains_in_bfloat16_only_where_it_is_faster():
    from specdec.errors import SpecdecError
    from specdec.train.precision import Timings, choose

    zen3 = Timings(float32=0.154, bfloat16=1.894)              # emulated bfloat16 (AVX2 only)
    zen4 = Timings(float32=0.41, bfloat16=0.18)                # native bfloat16 dot products
    assert choose("auto", zen3) == torch.float32
    assert choose("auto", zen4) == torch.bfloat16
    assert choose("float32", zen4) == torch.float32 and choose("bfloat16", zen3) == torch.bfloat16
    with pytest.raises(SpecdecError, match="--train-dtype"):
        choose("float16", zen4)


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_asked_for_where_it_is_emulated_is_warned(monkeypatch, capsys, native):
    import dataclasses

    from specdec import machine
    from specdec.train import precision

    here = dataclasses.replace(machine.probe(), onednn_bf16=native, avx512_bf16=native, amx=native, avx_ne_convert=native)
    monkeypatch.setattr(machine, "probe", lambda: here)
    assert precision.train_dtype("bfloat16") == torch.bfloat16
    err = capsys.readouterr().err
    assert err.startswith("training dtype: bfloat16 (asked for")
    assert ("no native bfloat16, so it is emulated" in err) is not native


def test_the_dtype_timings_are_measured_once_per_machine(tmp_path, monkeypatch):
    from specdec.train import precision

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(precision, "measure", lambda: calls.append(1) or precision.Timings(0.2, 0.1))
    assert precision.train_dtype("auto") == torch.bfloat16
    assert precision.train_dtype("auto") == torch.bfloat16
    assert len(calls) == 1 and list((tmp_path / "train-dtype").glob("*.json"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_runs_in_the_chosen_dtype(tmp_path, dtype):
    m, opt = _toy()
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    seen, losses = [], []

    def step_fn():
        seen.append(torch.is_autocast_enabled("cpu"))
        loss = torch.nn.functional.mse_loss(m(x).float(), y)
        losses.append(float(loss.detach()))
        return loss, {}

    steps, _ = train_loop("toy", list(m.parameters()), opt, 1e-2, 0.01, Checkpoint(tmp_path / "t.safetensors", m, opt, random.Random(0)),
                          step_fn, dtype=dtype)
    assert steps > 10 and set(seen) == {dtype == torch.bfloat16}
    assert losses[-1] < losses[0]


def test_a_slow_report_does_not_overrun_the_budget(tmp_path):
    """Reports count toward the budget and run only where their cost fits: the run ends within the budget
    plus one step."""
    m, opt = _toy()
    step_s, report_s, budget_s = 0.2, 1.2, 3.0
    reports = []

    def step_fn():
        time.sleep(step_s)
        return m(torch.ones(1, 4)).sum(), {}

    def report(step):
        reports.append(step)
        time.sleep(report_s)
        return "slow"

    t = time.time()
    train_loop("toy", list(m.parameters()), opt, 1e-2, budget_s / 60, Checkpoint(tmp_path / "t.safetensors", m, opt, random.Random(0)),
               step_fn, report, report_every_s=0.0)
    assert time.time() - t < budget_s + step_s + 0.3
    assert len(reports) >= 1                                   # it does report where there is time


def test_setup_time_counts_toward_the_budget(tmp_path):
    m, opt = _toy()
    t = time.time()
    train_loop("toy", list(m.parameters()), opt, 1e-2, 2.0 / 60, Checkpoint(tmp_path / "t.safetensors", m, opt, random.Random(0)),
               lambda: (time.sleep(0.05) or m(torch.ones(1, 4)).sum(), {}), setup_s=1.5)
    assert time.time() - t < 0.5 + 0.05 + 0.2                  # 1.5 s of the 2 s were spent before the loop


def test_eagle3_run_on_a_tiny_target_keeps_a_short_budget(tmp_path):
    """Steps, progress reports and the learning curve inside `--minutes` (features cached; extraction's share
    of the budget is the next test's)."""
    import random

    from helpers import tiny_model
    from specdec.models.eagle3 import Eagle3Config
    from specdec.train.eagle3 import Eagle3Options, fit_eagle3, shard_features
    from specdec.train.magpie import Row

    target = tiny_model(layers=6)
    g = random.Random(0)
    rows = [Row([g.randrange(97) for _ in range(g.randrange(20, 60))], [], ("chat", "code")[i % 2], f"magpie-000{i % 3}/{i}")
            for i in range(30)]
    assert any(r.validation for r in rows) and not all(r.validation for r in rows)
    out = tmp_path / "head.safetensors"
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())     # its first use imports for seconds
    opts = Eagle3Options(minutes=5 / 60, vocab_size=64, window=16, batch=4, max_rows=0, report_minutes=0.5 / 60)
    layers = tuple(i - 1 for i in Eagle3Config.for_target(target, 64).aux_layers)
    shard_features(target, rows, [r.tokens for r in rows], layers, tmp_path, opts.max_seq, float("inf"))
    assert len(list(tmp_path.glob("features3-magpie-000*.pt"))) == 3                    # one cache file per shard
    t = time.time()
    report = fit_eagle3(target, "tiny", rows, out, opts, tmp_path, random.Random(0), t)
    # a tiny step takes milliseconds, the final validation and writing tens of them on an idle machine (5.03 s in
    # all); a fresh clone's suite on 2 busy cores once took 9.3 s, so the bound leaves room for such a stall while
    # still catching a budget that lets steps or reports run on
    assert time.time() - t < 5 + 6.0
    assert report["steps"] > 0 and report["tokens_seen"] > 0
    curve = [json.loads(line) for line in out.with_suffix(".curve.jsonl").read_text().splitlines()]
    assert len(curve) >= 2 and curve[-1]["tokens"] == report["tokens_seen"]
    assert set(curve[-1]["agreement"]) == set(report["validation_top1_agreement_per_position"])
    assert len(curve[-1]["mean"]) == opts.steps
    assert "validation_top1_agreement_per_position" in json.loads(_metadata(out)["report"])    # the final write


def _metadata(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_an_eagle3_run_leaves_a_usable_head_at_every_report_and_resumes_over_it(tmp_path, monkeypatch):
    """While a run trains, OUT holds the head of the last progress report; a run stopped there (checkpoint
    beside OUT) resumes without --overwrite, and a finished one is not overwritten by accident."""
    import random

    from helpers import tiny_model
    from specdec.errors import SpecdecError
    from specdec.models.eagle3 import Eagle3Config, Eagle3Head
    from specdec.train import eagle3 as train3
    from specdec.train.features import begin
    from specdec.train.magpie import Row

    g = random.Random(2)
    rows = [Row([g.randrange(97) for _ in range(40)], [], ("chat", "code")[i % 2], f"magpie-0000/{i}") for i in range(24)]
    out = tmp_path / "head.safetensors"
    snapshots = []
    save = Eagle3Head.save

    def recording_save(self, path, meta):
        save(self, path, meta)
        snapshots.append(json.loads(_metadata(path)["report"]))
    monkeypatch.setattr(Eagle3Head, "save", recording_save)
    from specdec.train import loop
    monkeypatch.setattr(loop._Reports, "ready", lambda self, elapsed, budget, step_s: time.time() >= self.due)
    opts = train3.Eagle3Options(minutes=5 / 60, vocab_size=64, window=16, batch=4, report_minutes=0.5 / 60)
    target = tiny_model(layers=6)
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())     # its first use imports for seconds
    layers = tuple(i - 1 for i in Eagle3Config.for_target(target, 64).aux_layers)
    train3.shard_features(target, rows, [r.tokens for r in rows], layers, tmp_path, opts.max_seq, float("inf"))
    train3.fit_eagle3(target, "tiny", rows, out, opts, tmp_path, random.Random(0), time.time())
    partial = [r for r in snapshots if "snapshot_at_step" in r]
    assert partial and all(r["tokens_seen"] > 0 for r in partial)
    assert "validation_top1_agreement_per_position" in snapshots[-1]                   # then the final head
    assert Eagle3Head.load(out, tiny_model(layers=6)) is not None                       # a usable head
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask                                 # the umask's mode, not 0600
    assert not list(tmp_path.glob(".*.tmp"))                                            # written whole, then renamed
    with pytest.raises(SpecdecError, match="exists"):
        begin("unused", out, overwrite=False, seed=0, data=tmp_path)                                  # finished: no checkpoint
    out.with_suffix(".ckpt").write_bytes(b"")
    with pytest.raises(Exception) as err:                                               # resuming passes the check
        begin("no-such-model", out, overwrite=False, seed=0, data=tmp_path)
    assert "exists" not in str(err.value)


def test_tokens_seen_survive_a_checkpoint(tmp_path):
    m, opt = _toy()
    ck = Checkpoint(tmp_path / "t.safetensors", m, opt, random.Random(0))
    ck.tokens = 1234
    ck.save(step=3, seconds=10.0)
    m2, opt2 = _toy(seed=1)
    ck2 = Checkpoint(tmp_path / "t.safetensors", m2, opt2, random.Random(0))
    assert ck2.resume() == (3, 10.0) and ck2.tokens == 1234


def test_feature_extraction_stops_at_a_shard_boundary_when_the_budget_is_out(tmp_path):
    import random

    from helpers import tiny_model
    from specdec.train.eagle3 import Eagle3Options, fit_eagle3
    from specdec.train.magpie import Row

    g = random.Random(1)
    rows = [Row([g.randrange(97) for _ in range(40)], [], "chat", f"magpie-000{i // 20}/{i}") for i in range(60)]
    opts = Eagle3Options(minutes=0.001, vocab_size=64, window=16, batch=4)
    started = time.time() - 60                                     # the budget is spent before extraction starts
    with pytest.raises(SpecdecError, match="ran out before the first training step"):   # no untrained head written
        fit_eagle3(tiny_model(layers=6), "tiny", rows, tmp_path / "h.safetensors", opts, tmp_path,
                   random.Random(0), started)
    assert len(list(tmp_path.glob("features3-*.pt"))) == 1         # the first shard's features, kept for a re-run
    assert not (tmp_path / "h.safetensors").exists()


def test_the_schedule_starts_at_the_peak_after_a_long_setup(tmp_path):
    """Feature extraction spends budget, not learning rate: the first step runs at the peak, the last near 10%."""
    m, opt = _toy()
    lrs = []

    def step_fn():
        lrs.append(opt.param_groups[0]["lr"])
        time.sleep(0.02)
        return m(torch.ones(1, 4)).sum(), {}

    train_loop("toy", list(m.parameters()), opt, 1e-2, 2.0 / 60, Checkpoint(tmp_path / "t.safetensors", m, opt, random.Random(0)),
               step_fn, setup_s=1.0)
    assert lrs[0] > 0.99e-2 and lrs[-1] < 0.2e-2


def test_an_eagle3_run_can_continue_from_a_saved_head(tmp_path):
    """--init: the run starts from the file's weights, configuration and draft vocabulary (not the target's)."""
    from helpers import tiny_model
    from specdec.models.eagle3 import Eagle3Config, Eagle3Head
    from specdec.train.eagle3 import Eagle3Options, initial_head

    target = tiny_model(layers=6)
    seqs = [[1, 2, 3, 4, 5] * 8]
    fresh = initial_head(target, seqs, Eagle3Options(vocab_size=48))
    saved = Eagle3Head(target, Eagle3Config.for_target(target, 40), torch.arange(40) * 2)
    with torch.no_grad():
        for p in saved.parameters():
            p.normal_(0, 0.1)
    saved.save(tmp_path / "h.safetensors", {})
    head = initial_head(target, seqs, Eagle3Options(vocab_size=48, init=str(tmp_path / "h.safetensors")))
    assert fresh.cfg.draft_vocab == 48 and head.cfg.draft_vocab == 40
    assert torch.equal(head.vocab_ids, saved.vocab_ids)
    for (name, p), q in zip(head.named_parameters(), saved.parameters()):
        assert p.dtype == torch.float32 and p.requires_grad, name                    # trainable
        assert torch.equal(p, q.detach().to(torch.bfloat16).float()), name           # the file's (bf16) weights


def test_train_eagle3_init_must_name_a_file(tmp_path, capsys):
    assert main(["train", "eagle3", "--out", str(tmp_path / "h.safetensors"), "--init", str(tmp_path / "none")]) == 2
    assert "--init" in capsys.readouterr().err


def test_features_of_other_data_with_the_same_shard_names_are_not_read(tmp_path):
    """The feature cache is named by the rows' tokens too: another --data with the same shard names extracts its
    own features instead of reading these (wrong shapes gave a traceback; fitting ones would train silently)."""
    import random

    from helpers import tiny_model
    from specdec.models.eagle3 import Eagle3Config
    from specdec.train.eagle3 import shard_features
    from specdec.train.magpie import Row

    target = tiny_model(layers=6)
    layers = tuple(i - 1 for i in Eagle3Config.for_target(target, 64).aux_layers)
    for seed in (0, 1):
        g = random.Random(seed)
        rows = [Row([g.randrange(97) for _ in range(20)], [], "chat", f"magpie-0000/{i}") for i in range(4)]
        feats = shard_features(target, rows, [r.tokens for r in rows], layers, tmp_path, 640, float("inf"))
        assert all(f.shape[0] == 20 for f in feats)
    assert len(list(tmp_path.glob("features3-magpie-0000-4-640-*.pt"))) == 2


def test_a_draft_vocabulary_beyond_the_targets_is_refused():
    from helpers import tiny_model
    from specdec.train.eagle3 import Eagle3Options, initial_head

    with pytest.raises(SpecdecError, match="--vocab-size 100000 exceeds the target's vocabulary"):
        initial_head(tiny_model(layers=6), [[1, 2, 3]], Eagle3Options(vocab_size=100_000))


def test_a_budget_spent_before_the_first_step_is_an_error_not_an_untrained_result(tmp_path):
    """Set-up (feature extraction) that eats the whole budget: no step, so nothing is written as if trained."""
    m, opt = _toy()
    out = tmp_path / "t.safetensors"
    with pytest.raises(SpecdecError, match="ran out before the first training step"):
        train_loop("toy", list(m.parameters()), opt, 1e-2, 1.0 / 60, Checkpoint(out, m, opt, random.Random(0)),
                   lambda: (m(torch.ones(1, 4)).sum(), {}), setup_s=2.0)
    assert not out.exists() and not out.with_suffix(".ckpt").exists()


def test_cached_features_are_written_whole_and_a_damaged_file_is_extracted_again(tmp_path, capsys):
    from specdec.train.features import cached

    path = tmp_path / "f.pt"
    calls = []

    def compute():
        calls.append(1)
        return [torch.arange(6.0).view(2, 3)]

    assert torch.equal(cached(path, compute)[0], torch.arange(6.0).view(2, 3)) and len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["f.pt"]                  # no temporary file left
    assert torch.equal(cached(path, compute)[0], torch.arange(6.0).view(2, 3)) and len(calls) == 1   # read back
    path.write_bytes(path.read_bytes()[:40])                                 # a damaged file
    assert torch.equal(cached(path, compute)[0], torch.arange(6.0).view(2, 3)) and len(calls) == 2
    assert "does not load" in capsys.readouterr().err


def test_features_that_cannot_be_kept_are_used_and_said(tmp_path, monkeypatch, capsys):
    """An unwritable cache (a read-only folder, a full disk) costs the next run an extraction, not this run."""
    from specdec.train import features

    def no_room(obj, f):
        raise RuntimeError("open file failed with strerror: Operation not permitted")

    monkeypatch.setattr(features.torch, "save", no_room)
    got = features.cached(tmp_path / "f.pt", lambda: [torch.ones(2)])
    assert torch.equal(got[0], torch.ones(2)) and list(tmp_path.iterdir()) == []
    assert "cannot keep the features in" in capsys.readouterr().err


def test_an_interrupted_step_is_not_counted_and_a_killed_write_is_cleared(tmp_path):
    """A step cut short by Ctrl-C trained nothing: its tokens (counted by the step function as it starts) are not
    kept in the checkpoint. A checkpoint write that was killed (OUT.ckpt.tmp) goes when the run resumes."""
    out = tmp_path / "toy.safetensors"
    m, opt = _toy()
    ck = Checkpoint(out, m, opt, random.Random(0))
    inner = _stepper(m, 6, _interrupt)

    def counted():
        ck.tokens += 100                                       # as the real steps do: before the step's work
        return inner()

    with pytest.raises(KeyboardInterrupt):
        train_loop("toy", list(m.parameters()), opt, 1e-2, 10.0, ck, counted)
    out.with_suffix(".ckpt.tmp").write_bytes(b"half a checkpoint")
    m2, opt2 = _toy(seed=1)
    again = Checkpoint(out, m2, opt2, random.Random(0))
    assert again.resume()[0] == 5 and again.tokens == 500
    assert not out.with_suffix(".ckpt.tmp").exists()


@pytest.mark.parametrize("name", ["h.json", "h.ckpt", "h.curve.jsonl", "h.pt", "h"])
def test_an_out_that_is_not_a_safetensors_file_is_refused(name, tmp_path):
    """--out h.json was overwritten by the run's report and h.ckpt deleted with the checkpoint (the trained
    head lost, exit 0)."""
    from specdec.train.features import check_output

    with pytest.raises(SpecdecError, match="--out must name a .safetensors file"):
        check_output(tmp_path / name, overwrite=True)


@pytest.mark.parametrize("side", [".json", ".curve.jsonl"])
def test_a_report_or_curve_already_beside_out_is_not_overwritten_silently(side, tmp_path):
    from specdec.train.features import check_output

    out = tmp_path / "h.safetensors"
    out.with_suffix(side).write_text("a user's notes")
    with pytest.raises(SpecdecError, match=f"h{side} exists; pass --overwrite"):
        check_output(out, overwrite=False)
    check_output(out, overwrite=True)                          # asked for
    out.with_suffix(".ckpt").write_bytes(b"")                   # a run to resume: its own files
    check_output(out, overwrite=False)


def test_cached_features_of_other_shapes_are_extracted_again(tmp_path, capsys):
    from specdec.train.features import cached

    f = tmp_path / "features.pt"
    torch.save([torch.zeros(3, 5)], f)
    got = cached(f, lambda: [torch.ones(4, 8)], [(4, 8)])
    assert torch.equal(got[0], torch.ones(4, 8)) and "extracting again" in capsys.readouterr().err
    assert torch.equal(cached(f, lambda: [torch.zeros(1)], [(4, 8)])[0], torch.ones(4, 8))    # kept now
