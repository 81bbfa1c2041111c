"""The protocols are the whole truth: every proposer meets Proposer, and the engine knows no concrete proposer."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import specdec.proposers as proposers_pkg
from specdec.proposers.base import Proposer

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
