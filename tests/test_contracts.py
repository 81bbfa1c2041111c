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
