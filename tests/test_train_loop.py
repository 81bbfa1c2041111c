"""Training runs checkpoint and resume; a real (short) `specdec train medusa` run on the default target."""
from __future__ import annotations

import json

import pytest
import torch

from specdec.cli import main
from specdec.models.medusa import MedusaHeads
from specdec.train.loop import Checkpoint, train_loop


def _toy(seed: int = 0) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 1)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def test_interrupted_run_saves_and_resumes(tmp_path):
    out = tmp_path / "toy.safetensors"
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    m, opt = _toy()
    calls = []

    def step_fn():
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return torch.nn.functional.mse_loss(m(x), y), {}

    with pytest.raises(KeyboardInterrupt):
        train_loop("toy", list(m.parameters()), opt, 1e-2, 10.0, Checkpoint(out, m, opt), step_fn)
    assert out.with_suffix(".ckpt").exists()
    w_saved = m.weight.detach().clone()

    m2, opt2 = _toy(seed=1)                                    # a fresh process: other weights, empty optimiser
    ck = Checkpoint(out, m2, opt2)
    step, spent = ck.resume()
    assert step == 5 and 0 < spent < 10
    assert torch.equal(m2.weight, w_saved)
    assert opt2.state_dict()["state"][0]["step"] == 5         # Adam moments came back too
    ck.done()
    assert not out.with_suffix(".ckpt").exists()


def test_budget_counts_across_runs(tmp_path):
    out = tmp_path / "toy.safetensors"
    m, opt = _toy()
    ck = Checkpoint(out, m, opt)
    ck.save(step=7, seconds=3600.0)                            # an earlier run already spent an hour
    steps, minutes = train_loop("toy", list(m.parameters()), opt, 1e-2, 30.0, Checkpoint(out, m, opt),
                                lambda: (m(torch.ones(1, 4)).sum(), {}))
    assert steps == 7 and minutes >= 60                        # nothing left of a 30-minute budget


def test_train_medusa_end_to_end(tmp_path):
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
    assert not out.with_suffix(".ckpt").exists()
    from specdec.api import load_model

    target, _, _ = load_model("smollm2-135m", "float32")
    assert MedusaHeads.load(out, target).n_heads == 2
