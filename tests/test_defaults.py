"""One default everywhere: speculation on (the best lossless method for the model, `auto` draft length)."""
from __future__ import annotations

import inspect

from helpers import tiny_model
from specdec import names
from specdec.api import best_method, load
from specdec.cli import build_parser


def _defaults(command: str) -> dict:
    ap = build_parser()
    sub = next(a for a in ap._actions if a.dest == "command").choices[command]
    return {a.dest: a.default for a in sub._actions}


def test_cli_api_and_server_share_the_method_and_policy_defaults():
    api = inspect.signature(load).parameters
    gen, serve = _defaults("generate"), _defaults("serve")
    assert api["method"].default == gen["method"] == serve["method"] == names.AUTO_METHOD
    assert api["draft_policy"].default == gen["draft_policy"] == serve["draft_policy"] == "auto"
    assert api["num_draft_tokens"].default == gen["num_draft_tokens"] == serve["num_draft_tokens"]


def test_the_default_method_is_hybrid_where_a_head_is_shipped_else_suffix():
    class Named:
        def __init__(self, name):
            self.config = type("C", (), {"name": name})()

    assert best_method(Named("smollm2-135m")) == "hybrid"
    assert best_method(Named("gemma3-270m")) == "suffix"
    assert best_method(tiny_model()) == "suffix"
