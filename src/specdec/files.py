"""Checks of the paths a command will write, made before any work (a run must not learn at its end that it
cannot keep what it computed)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from .errors import SpecdecError


def writable_dir(d: Path, what: str) -> None:
    """Create directory `d` (and its parents) if needed and check a file can be written in it; else a one-line
    error naming `what` (e.g. "--out")."""
    if d.exists() and not d.is_dir():
        raise SpecdecError(f"{what} {d} is a file, not a directory")
    probe = d / f".specdec-probe-{os.getpid()}"
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise SpecdecError(f"cannot write {what} {d}: {e.strerror or e}") from None


def writable_file(path: Path, what: str) -> None:
    """`path` can be written: not a directory, its folder creatable and writable."""
    if path.is_dir():
        raise SpecdecError(f"{what} {path} is a directory; give a file path")
    writable_dir(path.parent, f"the folder of {what}")


@contextlib.contextmanager
def no_empty_dirs_left(d: Path) -> Iterator[None]:
    """Where the block fails (an error, Ctrl-C), `d` and the parents it lacked on entry are removed again if they
    are empty: a command that made its output directory and then stopped leaves no trace."""
    made = [p for p in (d, *d.parents) if not p.exists()]
    try:
        yield
    except BaseException:
        for p in made:
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        raise
