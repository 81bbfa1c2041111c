"""The protocols are the whole truth: every proposer meets Proposer, and the engine knows no concrete proposer."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch

import specdec.proposers as proposers_pkg
from specdec.proposers.base import Proposer
from specdec.verify import Draft

from helpers import Stateless, tiny_generator, tiny_model

MEMBERS = ("name", "feature_layers", "allocate", "start", "propose", "commit", "forget")


def _proposer_classes() -> list[type]:
    """Every concrete class of specdec.proposers that proposes (protocols left out)."""
    found = []
    for info in pkgutil.iter_modules(proposers_pkg.__path__):
        mod = importlib.import_module(f"specdec.proposers.{info.name}")
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ == mod.__name__ and hasattr(cls, "propose") and not getattr(cls, "_is_protocol", False):
                found.append(cls)
    return found


def test_the_proposers_are_found():
    names = {c.__name__ for c in _proposer_classes()}
    assert {"NoProposer", "NgramProposer", "SuffixProposer", "LookaheadProposer", "DraftModelProposer",
            "SelfProposer", "StagedProposer", "CrossVocabProposer", "EagleProposer", "MedusaProposer",
            "HybridProposer"} <= names


@pytest.mark.parametrize("cls", _proposer_classes(), ids=lambda c: c.__name__)
def test_every_proposer_declares_what_the_engine_calls(cls):
    missing = [m for m in MEMBERS if not hasattr(cls, m)]
    assert not missing, f"{cls.__name__} lacks {missing}"
    assert isinstance(cls.feature_layers, tuple)
    for m in MEMBERS[2:]:
        want = list(inspect.signature(getattr(Proposer, m)).parameters)
        got = list(inspect.signature(getattr(cls, m)).parameters)
        assert got[:len(want)] == want, f"{cls.__name__}.{m}{tuple(got)} does not take {tuple(want)}"


def test_the_engine_imports_no_concrete_proposer_and_checks_no_types():
    src = Path(importlib.import_module("specdec.engine").__file__).read_text()
    tree = ast.parse(src)
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {m for m in modules if m.startswith("proposers")} == {"proposers.base"}
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "NoProposer" not in names
    assert "isinstance(" not in src


def test_every_file_the_package_reads_is_package_data():
    """A non-editable install (a wheel) holds only the modules and the package-data globs: every other
    tracked file under src/specdec (native sources, shipped weights) must match one, or installs lose it."""
    import fnmatch
    import subprocess
    import tomllib

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["specdec"]
    tracked = subprocess.run(["git", "ls-files", "src/specdec"], cwd=root, capture_output=True, text=True)
    files = [Path(f).relative_to("src/specdec").as_posix() for f in tracked.stdout.split()] if tracked.returncode == 0 \
        else [p.relative_to(root / "src/specdec").as_posix() for p in (root / "src/specdec").rglob("*")
              if p.is_file() and "__pycache__" not in p.parts]
    data = [f for f in files if not f.endswith(".py")]
    assert "models/layers.cpp" in data and "models/attend.c" in data
    missing = [f for f in data if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"


class Handmade(Stateless):
    """A user's proposer: drafts the last token repeated, shaped by `make(batch, k) -> Draft`."""
    name = "handmade"

    def __init__(self, make) -> None:
        self.make = make

    def propose(self, batch, k):
        return self.make(batch, k)


def _repeat(batch, k: int) -> torch.Tensor:
    return torch.tensor([[t[-1]] * k for t in batch.tokens])              # [B, k] the last token again


def _one_hot(tokens: torch.Tensor, vocab: int, mass: float = 1.0) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens, vocab).float() * mass      # [B, k, V]


V = 97                                                                    # tiny_model's vocabulary


@pytest.mark.parametrize("make, message", [
    (lambda b, k: None, "propose returned NoneType, not a Draft"),
    (lambda b, k: Draft(torch.full((len(b.tokens), k), 500)), r"ids in \[0, 97\) or PAD \(-1\), got \[500\]"),
    (lambda b, k: Draft(torch.full((len(b.tokens), k), -7)), r"got \[-7\]"),
    (lambda b, k: Draft(torch.zeros(len(b.tokens) + 1, k, dtype=torch.long)), r"long \[1, K\], got int64 \[2, 2\]"),
    (lambda b, k: Draft(torch.zeros(len(b.tokens), k + 3, dtype=torch.long)), "at most 2 drafts along a path, got 5"),
    (lambda b, k: Draft(_repeat(b, k), parents=torch.tensor([[-1, 5]])), "each ROOT .-1. or an earlier draft's index"),
    (lambda b, k: Draft(_repeat(b, k), -_one_hot(_repeat(b, k), V)), "q must be finite and non-negative"),
    (lambda b, k: Draft(_repeat(b, k), _one_hot(_repeat(b, k), V, 0.5)), "each sampled draft's q must sum to 1, got 0.5"),
    (lambda b, k: Draft(_repeat(b, k), _one_hot(_repeat(b, k), V - 1)), r"q must be floating \[1, 2, 97\], got float32 \[1, 2, 96\]"),
    (lambda b, k: Draft(_repeat(b, k), _one_hot((_repeat(b, k) + 1) % V, V)), r"a sampled draft must have q\(draft\) > 0"),
])
def test_a_proposer_that_breaks_the_contract_is_one_line(make, message):
    """What the verifier trusts is checked at every step: a broken draft (which would otherwise corrupt greedy
    output, bias sampling or fail deep in torch) is a SpecdecError naming what is wrong."""
    from specdec.errors import SpecdecError

    gen = tiny_generator(tiny_model(), Handmade(make), k=2)
    with pytest.raises(SpecdecError, match="a proposer broke the Proposer contract: .*" + message):
        gen.generate([3, 4, 5], max_new_tokens=6, temperature=0.8)


def test_a_handmade_proposer_within_the_contract_is_exact():
    model = tiny_model()
    plain = tiny_generator(model).generate([3, 4, 5], max_new_tokens=12)
    for make in (lambda b, k: Draft(_repeat(b, k)), lambda b, k: Draft(_repeat(b, k), _one_hot(_repeat(b, k), V))):
        got = tiny_generator(model, Handmade(make), k=3).generate([3, 4, 5], max_new_tokens=12)
        assert got.tokens == plain.tokens


@pytest.mark.integration
def test_the_documented_proposer_runs_as_written_and_is_exact(capsys):
    """docs/design.md's "Your own proposer" example, run as it stands, on the real target: its greedy text is
    plain decoding's."""
    import re

    import specdec

    design = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    section = design.split("### Your own proposer", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "design.md", "exec"), scope)
    gen, res = scope["gen"], scope["res"]
    plain = specdec.Generator(gen.target, gen.tokenizer, specdec.api.NoProposer(), name=gen.name)
    prompt = 'Say "no" ten times in a row, separated by spaces.'
    assert res.text == plain.generate(prompt, max_new_tokens=48).text and gen.policy_name == "auto"
    assert capsys.readouterr().out.startswith(res.text)
    # `auto` may measure that drafting does not pay on a busy machine and draft nothing; with a fixed draft
    # length the example's proposer is certainly asked, its drafts are accepted, and the text stays plain's.
    fixed = specdec.Generator(gen.target, gen.tokenizer, scope["Bigram"](), policy_name="fixed", name=gen.name)
    drafted = fixed.generate(prompt, max_new_tokens=48)
    assert drafted.text == res.text and drafted.metrics["tau"] > 1.0
