"""The packed-weight cache: a model read from it computes exactly what a freshly converted one does."""
from __future__ import annotations

import pytest
import torch

from specdec.machine import probe
from specdec.models import weight_cache
from specdec.models.gguf_loader import load_gguf
from specdec.models.registry import resolve

pytestmark = pytest.mark.integration


def _logits(model) -> torch.Tensor:
    tokens = torch.tensor([[1, 42, 7, 1000, 5, 99, 123, 17]])
    cache = model.new_cache(1, 128)
    hidden = model(tokens, torch.arange(8)[None], cache, torch.tensor([0]))
    return model.lm_head(hidden)


@pytest.mark.parametrize("form", ["q4", "float32"])
def test_cached_weights_give_the_same_bits(form, tmp_path, monkeypatch):
    if form == "q4" and not probe().int4_kernel:
        pytest.skip("no int4 kernel here")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    _, path = resolve("smollm2-135m")
    dtype, int4 = (torch.bfloat16 if probe().native_bf16 else torch.float32, True) if form == "q4" else (torch.float32, False)
    fresh = load_gguf(path, dtype, int4=int4, use_cache=False)
    with torch.inference_mode():
        want = _logits(fresh)
    del fresh
    first = load_gguf(path, dtype, int4=int4)                  # converts and stores
    where = weight_cache.entry(path, dtype, int4)
    assert where.is_file()
    again = load_gguf(path, dtype, int4=int4)                  # reads the entry
    with torch.inference_mode():
        assert torch.equal(_logits(first), want) and torch.equal(_logits(again), want)
    assert again.compute == form


def test_a_damaged_entry_is_converted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    _, path = resolve("smollm2-135m")
    where = weight_cache.entry(path, torch.float32, False)
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_bytes(b"\x00not safetensors" * 100)
    assert weight_cache.read(where) is None
    model = load_gguf(path, torch.float32)
    assert model.compute == "float32" and weight_cache.read(where) is not None
