"""The distilled draft model: a reduced-vocabulary CausalLM, lossless as a draft, saved and loaded exactly."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.models.distilled import DistilledDraft
from specdec.proposers.draft_model import DraftModelProposer
from specdec.train.draft import draft_losses

from helpers import tiny_generator, tiny_model


def test_logits_are_minus_inf_outside_its_vocabulary():
    target = tiny_model(seed=1)
    ids = torch.tensor([0, 5, 9, 40, 96])
    d = DistilledDraft(target, ids, [1, 0]).prepare(torch.float32)
    h = d(torch.tensor([[3, 4, 5]]), torch.arange(3)[None], d.new_cache(1, 8), torch.tensor([0]))
    logits = d.lm_head(h)                                                  # [1, 3, 97]
    assert logits.shape == (1, 3, 97)
    inside = torch.zeros(97, dtype=torch.bool)
    inside[ids] = True
    assert torch.isinf(logits[..., ~inside]).all() and torch.isfinite(logits[..., inside]).all()
    assert set(logits.argmax(-1).flatten().tolist()) <= set(ids.tolist())


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_with_a_distilled_draft_equals_plain(k):
    target = tiny_model(seed=2)
    draft = DistilledDraft(target, torch.arange(0, 97, 2), [1]).prepare(torch.float32)
    plain = tiny_generator(target)
    spec = tiny_generator(target, DraftModelProposer(draft), "fixed", k)
    prompts = [[random.Random(s).randrange(97) for _ in range(4 + 3 * s)] for s in range(3)]
    want = [r.tokens for r in plain.generate(prompts, max_new_tokens=24)]
    got = spec.generate(prompts, max_new_tokens=24)
    assert [r.tokens for r in got] == want
    assert sum(r.metrics["acceptance_rate"] or 0 for r in got) > 0        # it does propose something useful


def test_save_load_roundtrip_and_foreign_target(tmp_path):
    target = tiny_model(seed=3)
    d = DistilledDraft(target, torch.arange(0, 97, 3), [0, 1]).prepare(torch.float32)
    path = tmp_path / "d.safetensors"
    d.save(path, {"note": "test"})
    back = DistilledDraft.load(path, target)
    x, pos = torch.tensor([[7, 8, 9, 10]]), torch.arange(4)[None]
    a = d.lm_head(d(x, pos, d.new_cache(1, 8), torch.tensor([0])))
    b = back.lm_head(back(x, pos, back.new_cache(1, 8), torch.tensor([0])))
    torch.testing.assert_close(a, b, rtol=0, atol=0.05)                    # saved in bfloat16
    with pytest.raises(SpecdecError, match="another target"):
        DistilledDraft.load(path, tiny_model(seed=4))
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(SpecdecError, match="corrupt"):
        DistilledDraft.load(path, target)


def test_distillation_lowers_the_kl():
    """A few optimiser steps on the target's own features reduce KL(target || draft)."""
    torch.manual_seed(0)
    target = tiny_model(seed=5, layers=3)
    ids = torch.arange(97)
    draft = DistilledDraft(target, ids, [0])
    toks = torch.randint(0, 97, (4, 16))
    with torch.no_grad():
        f = target(toks, torch.arange(16).expand(4, 16), target.new_cache(4, 16), torch.arange(4))
    lens = torch.full((4,), 16)
    w = target.embed.detach()
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(30):
        loss, _ = draft_losses(draft, toks, f, lens, w)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.7 * first
