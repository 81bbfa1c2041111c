"""Medusa heads + static tree: lossless; weights checked."""
from __future__ import annotations

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.models.medusa import MedusaHeads
from specdec.proposers.medusa import MedusaProposer
from specdec.reference import reference_greedy
from specdec.sampling import SamplingParams

from helpers import PROMPTS, V, check_joint, exact_joint, heads_for, sample_engine, tiny_generator, tiny_model


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 3])
def test_medusa_greedy_equals_plain(k, batch):
    target = tiny_model(seed=7)
    gen = tiny_generator(target, MedusaProposer(heads_for(target, 4)), "fixed", k)
    for p, r in zip(PROMPTS[:batch], gen.generate(PROMPTS[:batch], max_new_tokens=30)):
        assert r.tokens == reference_greedy(target, p, 30)


@pytest.mark.slow        # 20,000 sequences: `make test`; fast loop: test_seeds.py (plain sampling's tokens)
def test_medusa_sampling_matches_exact_distribution():
    params = SamplingParams(0.7, 5, 0.9)
    target = tiny_model(seed=20, vocab=V, std=0.5)
    h = MedusaHeads(target, torch.arange(V), 3)
    prop = MedusaProposer(h.prepare(torch.float32))
    samples = sample_engine(target, prop, params, [1, 2, 3], n=20_000, k=3)
    assert check_joint(samples, exact_joint(target, [1, 2, 3], params)) > 1e-3


def test_medusa_weights(tmp_path):
    target = tiny_model(seed=1)
    h = heads_for(target)
    path = tmp_path / "m.safetensors"
    h.save(path, {})
    again = MedusaHeads.load(path, target)
    torch.testing.assert_close(again.w.float(), h.w.to(torch.bfloat16).float())
    with pytest.raises(SpecdecError, match="another target"):
        MedusaHeads.load(path, tiny_model(seed=3))
    from specdec.models.eagle import EagleHead
    with pytest.raises(SpecdecError, match="holds 'medusa' weights"):
        EagleHead.load(path, target)
