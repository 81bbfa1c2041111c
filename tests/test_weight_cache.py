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


def test_ctrl_c_during_a_read_is_an_interruption_not_a_damaged_entry(tmp_path, monkeypatch):
    """A native read interrupted by Ctrl-C may surface as another exception (safetensors: ValueError,
    SystemError); that must stop the program, not be taken for an unreadable entry and converted again."""
    import os
    import signal
    import time

    import safetensors

    entry = tmp_path / "entry.safetensors"
    entry.write_bytes(b"x")

    def interrupted_read(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
        except KeyboardInterrupt:
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None

    monkeypatch.setattr(safetensors, "safe_open", interrupted_read)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)   # xdist workers ignore SIGINT
    try:
        with pytest.raises(KeyboardInterrupt):
            weight_cache.read(entry)
    finally:
        signal.signal(signal.SIGINT, before)
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: (_ for _ in ()).throw(ValueError("damaged")))
    assert weight_cache.read(entry) is None                                      # a damaged entry: convert again


def test_writing_an_entry_removes_older_formats_of_the_same_form(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    _, path = resolve("smollm2-135m")
    where = weight_cache.entry(path, torch.float32, False)
    base = where.name.rsplit("-v", 1)[0]
    where.parent.mkdir(parents=True, exist_ok=True)
    old = where.with_name(f"{base}-v1.safetensors")
    other_torch = where.with_name(where.name.replace("-torch", "-torch9.9.9x"))
    other_form = where.with_name(where.name.replace("-dense-", "-q4-").rsplit("-v", 1)[0] + "-v1.safetensors")
    for p in (old, other_torch, other_form):
        p.write_bytes(b"old")
    load_gguf(path, torch.float32)                               # converts and stores this format's entry
    assert where.is_file() and not old.exists()
    assert other_torch.exists() and other_form.exists()
