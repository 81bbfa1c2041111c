"""The on-disk caches heal: damaged, foreign or half-written files are rebuilt or refused with one line, never
loaded into a run (a damaged native library used to crash every start; a lost chat template changed output)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.machine import env_switch
from specdec.models import kernels, native
from specdec.models.registry import STALE_SECONDS, cache_dir, sweep_stale, write_atomic


def test_a_native_library_is_rebuilt_unless_it_matches_the_digest_of_its_build(tmp_path):
    """`native.built`: reused while whole; truncated, overwritten or without its digest (a build that did not
    finish): built again."""
    lib = tmp_path / "native" / "k.so"
    builds: list[Path] = []

    def build(out: Path) -> str:
        builds.append(out)
        out.write_bytes(b"\x7fELF" + bytes(range(256)) * 40)
        return ""

    assert native.built(lib, build, "k") == "" and len(builds) == 1
    assert native.built(lib, build, "k") == "" and len(builds) == 1                  # whole: reused
    with lib.open("r+b") as f:
        f.truncate(1000)                                                              # damaged
    assert native.built(lib, build, "k") == "" and len(builds) == 2
    assert lib.stat().st_size == 4 + 256 * 40
    lib.with_name("k.so.sha256").unlink()                                             # no digest
    assert native.built(lib, build, "k") == "" and len(builds) == 3
    assert native.built(lib, lambda out: "cc failed: no", "k") == ""                 # whole again: no build
    lib.write_bytes(b"garbage")
    assert native.built(lib, lambda out: "cc failed: no", "k") == "cc failed: no"     # the reason, not a crash
    for folder in (lib, lib.with_name("k.so.sha256")):                                # a folder where a file goes
        folder.unlink()
        folder.mkdir()
        (folder / "x").write_bytes(b"x")
        assert native.built(lib, build, "k") == ""
        assert lib.is_file() and lib.with_name("k.so.sha256").is_file()
        assert native.built(lib, build, "k") == ""                                    # and whole again
    assert len(builds) == 5


def test_processes_starting_together_build_a_native_library_once(tmp_path):
    """Concurrent first starts: the first builds, the others wait on the lock and then find the library whole."""
    import threading

    lib = tmp_path / "native" / "k.so"
    builds: list[Path] = []

    def build(out: Path) -> str:
        builds.append(out)
        time.sleep(0.3)
        out.write_bytes(b"\x7fELF" + bytes(range(256)) * 40)
        return ""

    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(native.built(lib, build, "k"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["", "", ""] and len(builds) == 1


def test_a_file_rewritten_in_place_keeping_its_size_and_mtime_is_hashed_again(tmp_path, monkeypatch):
    """`cp -p`, `rsync -a` or `touch -r` keep a modification time: the file's hash (what the converted weights
    and tokenizer are found by) must still change with its bytes."""
    from specdec.models.registry import file_sha256, file_stamp

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"a" * 1000)
    first = file_sha256(f)
    st = f.stat()
    f.write_bytes(b"GGUF" + b"b" * 1000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    assert file_sha256(f) != first
    book = json.loads((tmp_path / "cache" / "weights" / "hashes.json").read_text())
    assert list(book) == [file_stamp(f)]                                              # the old stamp is gone


def test_stale_temporary_files_of_killed_writers_are_swept(tmp_path):
    old, new, kept = tmp_path / ".tmp-old", tmp_path / ".tmp-new", tmp_path / "entry.safetensors"
    for f in (old, new, kept):
        f.write_bytes(b"x")
    (tmp_path / "tmpdir").mkdir()
    (tmp_path / "tmpdir" / "lib.so").write_bytes(b"x")
    past = time.time() - STALE_SECONDS - 5
    for p in (old, kept, tmp_path / "tmpdir"):
        os.utime(p, (past, past))
    sweep_stale(tmp_path, (".tmp-", "tmp"))
    assert not old.exists() and not (tmp_path / "tmpdir").exists()
    assert new.exists() and kept.exists()                                             # a live writer's; an entry


def test_the_cache_directory_comes_from_the_environment_or_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "specdec"                          # empty: the default
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SPECDEC_CACHE", "~/c")
    assert cache_dir() == tmp_path / "c"
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "file" / "x"))
    with pytest.raises(SpecdecError, match=r"cannot use .*file/x as the cache directory \(\$SPECDEC_CACHE\)"):
        cache_dir()
    with pytest.raises(SpecdecError, match="cannot write"):
        write_atomic(tmp_path / "file" / "y" / "z.json", b"{}")


def test_cache_files_get_the_umask_mode_and_a_file_as_the_cache_is_named(tmp_path, monkeypatch):
    """A cache one account fills is readable by another (mkstemp alone gives 0600); $SPECDEC_CACHE naming a file
    says so."""
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "w" / "entry.json", b"{}")
    finally:
        os.umask(old)
    assert (tmp_path / "w" / "entry.json").stat().st_mode & 0o777 == 0o644
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "f"))
    with pytest.raises(SpecdecError, match=r"\$SPECDEC_CACHE .*/f is a file, not a directory"):
        cache_dir()


def test_a_start_sweeps_what_killed_writers_left_in_a_warm_cache(tmp_path, monkeypatch):
    past = time.time() - STALE_SECONDS - 5
    debris = [tmp_path / "weights" / ".tmp-x", tmp_path / "tokenizers" / ".tmp-y", tmp_path / "native" / "tmpz",
              tmp_path / ".tmp-gemma"]
    for d in debris:
        d.parent.mkdir(parents=True, exist_ok=True)
        d.write_bytes(b"x" * 100)
        os.utime(d, (past, past))
    (tmp_path / "weights" / "entry.safetensors").write_bytes(b"kept")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    assert not any(d.exists() for d in debris) and (tmp_path / "weights" / "entry.safetensors").exists()


def test_info_counts_the_cache_while_another_process_removes_files(tmp_path, monkeypatch):
    from specdec import cli

    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "gone").write_bytes(b"x" * 99)
    real = os.lstat
    monkeypatch.setattr(cli.os, "lstat", lambda p: (_ for _ in ()).throw(FileNotFoundError(p)) if str(p).endswith("gone")
                        else real(p))
    assert cli.tree_bytes(tmp_path) == 10


@pytest.mark.parametrize("value, on", [("", True), ("1", True), ("on", True), ("TRUE", True), ("0", False),
                                       ("false", False), ("Off", False), ("no", False)])
def test_on_off_switches_read_the_usual_spellings(monkeypatch, value, on):
    monkeypatch.setenv("SPECDEC_NATIVE", value)
    assert env_switch("SPECDEC_NATIVE") is on


def test_an_on_off_switch_with_another_value_is_refused(monkeypatch):
    monkeypatch.setenv("SPECDEC_LOOP", "nope")
    with pytest.raises(SpecdecError, match=r"\$SPECDEC_LOOP='nope': use 1"):
        env_switch("SPECDEC_LOOP")


def test_an_unknown_instruction_set_limit_exits_2_with_one_line():
    r = subprocess.run([sys.executable, "-c", "import specdec"], env={**os.environ, "SPECDEC_ISA": "foo"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "SPECDEC_ISA='foo' is not one of" in r.stderr


@pytest.mark.parametrize("content", ["[]", "null", "3", '{"x": 3}'])
def test_a_kernel_book_of_another_shape_is_checked_again(content, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_BOOKS", {})
    kernels.book_path().parent.mkdir(parents=True)
    kernels.book_path().write_text(content)
    w = torch.randn(8, 16)
    check = kernels.checked(("x", 8, 16), lambda x: x @ w.T, 16, torch.float32)
    assert check.many_rows
    assert json.loads(kernels.book_path().read_text())["('x', 8, 16)"][0] is True


@pytest.mark.parametrize("entry", [[True, True, "64"], [True, True, 0], [True, True, None], [1, True, 64],
                                   [True, True, True], ["yes", True, 64]])
def test_a_kernel_book_entry_of_the_wrong_types_is_checked_again(entry, tmp_path, monkeypatch):
    """An entry that does not read as what `checked` writes (a hand edit, a damaged file) is checked again;
    it failed deep inside a kernel call (ctypes.ArgumentError, split_size 0, None < int) at every start."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_BOOKS", {})
    kernels.book_path().parent.mkdir(parents=True)
    kernels.book_path().write_text(json.dumps({"('x', 8, 16)": entry}))
    w = torch.randn(8, 16)
    check = kernels.checked(("x", 8, 16), lambda x: x @ w.T, 16, torch.float32)
    assert check.many_rows is True and type(check.max_rows) is int and check.max_rows >= 1
    on_disk = json.loads(kernels.book_path().read_text())["('x', 8, 16)"]
    assert on_disk[0] is True and isinstance(on_disk[1], bool) and type(on_disk[2]) is int


@pytest.mark.parametrize("entry", [[["a"], {}], [3, {}], ["c", {}], "a"])
def test_a_kernel_choice_of_the_wrong_form_is_made_again(entry, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_BOOKS", {})
    kernels.book_path().parent.mkdir(parents=True)
    kernels.book_path().write_text(json.dumps({repr(("fastest", "k", 8, 16)): entry}))
    w = torch.randn(8, 16)
    made = kernels.fastest(("k", 8, 16), {"a": lambda: kernels.PackedLinear(None, torch.float32,
                                                                             kernels.RowCheck(True, True))}, w)
    assert isinstance(made, kernels.PackedLinear)
    assert json.loads(kernels.book_path().read_text())[repr(("fastest", "k", 8, 16))][0] == "a"


def test_choices_made_by_another_process_are_kept_and_followed(tmp_path, monkeypatch):
    """The book is merged under a lock, not overwritten: a choice another process wrote meanwhile stays on disk
    and is the one this process takes too (concurrent first starts lost entries to the last writer)."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_BOOKS", {})
    w = torch.randn(8, 16)
    kernels.checked(("mine", 8, 16), lambda x: x @ w.T, 16, torch.float32)           # this process's book in memory
    book = json.loads(kernels.book_path().read_text())
    book[repr(("fastest", "k", 8, 16))] = ["b", {"a": 1.0, "b": 1.0}]                 # another process's choice
    book["('theirs', 8, 16)"] = [True, True, 64]
    kernels.book_path().write_text(json.dumps(book))

    made: list[str] = []

    def maker(name: str):
        def make():
            made.append(name)
            return kernels.PackedLinear(None, torch.float32, kernels.RowCheck(True, True))
        return make

    kernels.fastest(("k", 8, 16), {"a": maker("a"), "b": maker("b")}, w)
    assert made == ["b"]                                                              # its choice, untimed
    kernels.checked(("again", 8, 16), lambda x: x @ w.T, 16, torch.float32)
    on_disk = json.loads(kernels.book_path().read_text())
    assert {"('mine', 8, 16)", "('theirs', 8, 16)", "('again', 8, 16)"} <= set(on_disk)


def test_near_ties_resolve_by_name_not_by_timing_noise():
    assert kernels.tie_break({"native-q4": 1.00, "int4": 1.04}) == "int4"
    assert kernels.tie_break({"native-q4": 1.04, "int4": 1.00}) == "int4"
    assert kernels.tie_break({"native-q4": 1.00, "int4": 1.06}) == "native-q4"


def test_training_timings_of_another_shape_are_measured_again(tmp_path, monkeypatch):
    from specdec.train import precision

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(precision, "measure", lambda repeats=3: precision.Timings(0.2, 0.1))
    path = precision._timings_path()
    path.parent.mkdir(parents=True)
    path.write_text('{"float32": "fast", "bfloat16": 0.1}')
    assert precision.machine_timings() == precision.Timings(0.2, 0.1)
    assert json.loads(path.read_text()) == {"float32": 0.2, "bfloat16": 0.1}


@pytest.mark.integration
@pytest.mark.parametrize("damage", ["delete chat_template.jinja", "truncate tokenizer.json", "empty config",
                                    "no manifest"])
def test_a_damaged_converted_tokenizer_is_converted_again(damage, tmp_path, monkeypatch):
    from specdec.models.registry import resolve
    from specdec.models.tokenizer import Tokenizer, saved_dir

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    gguf = resolve("smollm2-135m")[1]
    first = Tokenizer.from_gguf(gguf)
    chat = [{"role": "user", "content": "Hi"}]
    want = first.encode_chat(chat), first.encode("Hello there", False)
    saved = saved_dir(gguf)
    if damage == "delete chat_template.jinja":
        (saved / "chat_template.jinja").unlink()
    elif damage == "truncate tokenizer.json":
        with (saved / "tokenizer.json").open("r+b") as f:
            f.truncate(100_000)
    elif damage == "empty config":
        (saved / "tokenizer_config.json").write_text("")
    else:
        (saved / "manifest.json").unlink()
    again = Tokenizer.from_gguf(gguf)
    assert (again.encode_chat(chat), again.encode("Hello there", False)) == want
    assert again.has_chat_template


def test_a_kernel_book_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_BOOKS", {})
    (tmp_path / "kernel-checks").write_text("a file where the folder goes")
    w = torch.randn(8, 16)
    with pytest.raises(SpecdecError, match="cannot write .*kernel-checks"):
        kernels.checked(("x", 8, 16), lambda x: x @ w.T, 16, torch.float32)


def test_kernels_are_timed_by_their_own_cost_not_by_waits_for_the_core(monkeypatch):
    """With one thread a kernel's time is the calling thread's CPU time: a kernel that waits (as one does while
    another job holds the core) is not taken for a slow one. Timed by wall clock, the waiting kernel lost here, as
    the native kernels did at first starts beside busy jobs, which then kept the slower choice for good."""
    import time
    from dataclasses import dataclass

    @dataclass
    class Fake:
        work: float                        # seconds of CPU work per call
        wait: float                        # seconds off the CPU per call
        dtype: torch.dtype = torch.float32
        check: kernels.RowCheck = kernels.RowCheck(True, True)
        pair: bool = False
        label: str = "fake"

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            end = time.thread_time() + self.work
            while time.thread_time() < end:
                pass
            time.sleep(self.wait)
            return x[:, :4]

    monkeypatch.setattr(kernels, "TIMED_REPEATS", 2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cost = kernels.seconds_per_call({"busy": Fake(0.002, 0.0), "waits": Fake(0.0002, 0.01)}, torch.randn(4, 16))
    finally:
        torch.set_num_threads(before)
    assert cost["waits"] < cost["busy"] and kernels.tie_break(cost) == "waits"
