"""Training prompts never contain benchmark prompts; the check has teeth; train CLI refuses bad input."""
from __future__ import annotations

import pytest

from specdec.bench import suites
from specdec.cli import main
from specdec.train.data import _benchmark_fingerprints, overlaps, training_prompts


def test_no_benchmark_prompt_in_training_data():
    fp = _benchmark_fingerprints()
    prompts = training_prompts()
    assert len(prompts) > 5000
    assert not [p for p in prompts if overlaps(p, fp)]
    bench = {t for p in suites.load_suite("full") for t in p.turns}
    assert not bench & set(prompts)


def test_leak_check_catches_a_benchmark_prompt():
    fp = _benchmark_fingerprints()
    caught = 0
    for p in suites.load_suite("mini"):
        if len(p.turns[0].split()) >= 12:
            caught += overlaps("Please help: " + p.turns[0], fp)
            assert overlaps("Please help: " + p.turns[0], fp), p.id
    assert caught >= 10


@pytest.mark.parametrize("argv, msg", [
    (["train", "eagle", "--model", "gpt-5", "--out", "x.safetensors"], "unknown target"),
    (["train", "draft", "--model", "gpt-5", "--out", "x.safetensors"], "unknown target"),
    (["train", "draft", "--out", "x.safetensors", "--layers", "first,last"], "comma-separated layer numbers"),
    (["train", "eagle", "--out", "x.safetensors", "--minutes", "0"], "--minutes must be > 0"),
    (["train", "medusa", "--out", "x.safetensors", "--heads", "-1"], "--heads must be > 0"),
    (["train", "draft", "--out", "x.safetensors", "--max-rows", "-5"], "--max-rows must be >= 0"),
    (["train", "data", "--batch", "0"], "--batch must be > 0"),
    (["train", "eagle3", "--out", "x.safetensors", "--target-temperature", "0"], "--target-temperature must be > 0"),
    (["train", "eagle3", "--out", "x.safetensors", "--prompt-weight", "-1"], "--prompt-weight must be >= 0"),
])
def test_train_cli_errors(argv, msg, capsys):
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


def test_train_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "head.safetensors"
    out.write_bytes(b"x")
    assert main(["train", "eagle", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
