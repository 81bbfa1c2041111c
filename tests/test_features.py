"""Forwards that also return middle layers' outputs (the features EAGLE-3 heads read)."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_model


def _run(model, tokens, features=()):
    cache = model.new_cache(1, 64)
    T = tokens.shape[1]
    return model(tokens, torch.arange(T)[None], cache, torch.tensor([0]), features=features)


def test_features_append_layer_outputs_and_leave_the_head_alone():
    model = tiny_model(seed=3, layers=4)
    tokens = torch.tensor([[3, 14, 15, 92, 65]])
    plain = _run(model, tokens)                                             # [1, T, H]
    H = model.config.dim
    wide = _run(model, tokens, (0, 2, 3))                                   # [1, T, 4H]
    assert wide.shape == (1, 5, 4 * H)
    assert torch.equal(wide[..., :H], plain)
    assert torch.equal(model.lm_head(wide), model.lm_head(plain))
    last = wide[..., 3 * H:]                                                # layer 3's output, before the final norm
    assert torch.equal(model.final_norm(last.reshape(-1, H)).view_as(last), plain)
    assert not torch.equal(wide[..., H:2 * H], wide[..., 2 * H:3 * H])      # different depths differ


def test_feature_layers_must_exist():
    with pytest.raises(ValueError, match="outside"):
        _run(tiny_model(layers=2), torch.tensor([[1, 2]]), (0, 2))


def test_features_are_asked_per_forward_not_kept_on_the_model():
    """A target shared by engines of several methods: one forward's features do not widen the next's."""
    model = tiny_model(seed=3, layers=4)
    tokens = torch.tensor([[3, 14, 15]])
    assert _run(model, tokens, (1, 2)).shape[-1] == 3 * model.config.dim
    assert _run(model, tokens).shape[-1] == model.config.dim
