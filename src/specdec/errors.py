"""The one exception type users see: a clear message, never a traceback."""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class SpecdecError(ValueError):
    """Bad input or an unusable resource, with a message meant for the user."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) that stopped a command with something to say (e.g. where its state was saved)."""


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM (`kill`; a background job ignores Ctrl-C's SIGINT) raises KeyboardInterrupt as
    Ctrl-C does, so work that keeps what it has (a checkpoint, finished rows) keeps it either way. Only the main
    thread can take signals; elsewhere the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def is_allocation_failure(e: BaseException) -> bool:
    """Whether `e` is an allocator's failure: MemoryError, torch's out-of-memory, the CPU allocator's RuntimeError."""
    import torch

    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


def requested_size(e: BaseException) -> str:
    """The size an allocator's failure asked for, as " (one of them N GiB)"; "" where its message does not say."""
    import re

    wanted = re.search(r"allocate (\d+) bytes", str(e))
    return f" (one of them {int(wanted.group(1)) / 2**30:.1f} GiB)" if wanted else ""
