"""One default everywhere: speculation on (the best lossless method for the model, `auto` draft length, `auto`
draft sampling)."""
from __future__ import annotations

import inspect
import math

import torch

from helpers import tiny_generator, tiny_model
from specdec import names
from specdec.api import AUTO_SAMPLE_FROM, best_method, load, sample_drafts_from, serve_sample_drafts
from specdec.cli import build_parser
from specdec.models.eagle3 import Eagle3Config, Eagle3Head
from specdec.server import ServeConfig, ServerState
from specdec.server.scheduler import SpecChoice


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
    assert api["sample_drafts"].default == gen["sample_drafts"] == serve["sample_drafts"] == "auto"
    assert inspect.signature(ServerState).parameters["sample_drafts"].default == "auto"


def test_the_server_samples_the_eagle_chains_drafts_as_told_and_leaves_other_methods_on_point_masses():
    """`serve --sample-drafts on` applies to the engines of eagle and eagle3 (requests choose their method);
    auto and off apply to every engine as they are (auto: the EAGLE chains above AUTO_SAMPLE_FROM)."""
    assert serve_sample_drafts("on", "eagle3") == serve_sample_drafts("on", "hybrid") == "on"
    assert serve_sample_drafts("on", "ngram") == serve_sample_drafts("on", "suffix") == "off"
    assert serve_sample_drafts("auto", "eagle3") == "auto" and serve_sample_drafts("off", "eagle") == "off"
    assert sample_drafts_from("auto", "hybrid") == AUTO_SAMPLE_FROM and sample_drafts_from("auto", "suffix") == math.inf


def test_the_default_method_is_suffix_for_every_model():
    class Named:
        def __init__(self, name):
            self.config = type("C", (), {"name": name})()

    assert best_method(Named("smollm2-135m")) == "suffix"             # an EAGLE head is shipped for it
    assert best_method(Named("gemma3-270m")) == "suffix"
    assert best_method(tiny_model()) == "suffix"


def test_the_servers_engine_pool_builds_its_eagle_engines_with_its_draft_sampling(tmp_path):
    target = tiny_model(seed=3, layers=6)
    ids = torch.arange(0, 80, 2)
    path = tmp_path / "eagle3.safetensors"
    Eagle3Head(target, Eagle3Config.for_target(target, len(ids)), ids).init_from_target().save(path, {})
    for setting, want in (("on", 0.0), ("auto", AUTO_SAMPLE_FROM), ("off", math.inf)):
        state = ServerState(tiny_generator(target), ServeConfig(max_batch=2, max_prompt_tokens=16, max_tokens=8),
                            drafts={"eagle3": str(path)}, sample_drafts=setting)
        assert state.pool.get(SpecChoice("eagle3", 4)).proposer.sample_from == want
        state.pool.get(SpecChoice("ngram", 4))                     # `on` leaves other methods on point masses
