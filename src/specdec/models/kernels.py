"""Linear-layer kernels whose rows do not depend on how many rows share a call, checked on this machine.

Verifying K drafts must give bit for bit the logits that K+1 one-token steps would, so a row's
result may not depend on the row count M of the GEMM it is part of. CPU libraries pick kernels
by M, shape and instruction set, so this is measured, never assumed: every weight packed here
is checked (`check_rows`) with the kernel that will run it, once per machine, torch build and
thread count for each kernel and shape (the results are kept in the cache directory).

oneDNN prepacked for a few rows (PACK_ROWS) gives rows that are invariant for every M >= 2 on the
CPUs measured. A lone row (M = 1) takes another path whose bits differ for some shapes always
(float32 [576 x 1536] on AVX-512) and for others only for some inputs (bfloat16 [576 x 1536]:
13 of 200 random inputs on an AVX-512-BF16 EPYC), so no check can prove a lone row safe: it is
always computed as a pair of copies of itself. Packed for PACK_ROWS rows, two rows cost what
one does (prepacking for 1 row, as torch does by default, made the pair cost ~2x).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from ..sampling import argmax


PACK_ROWS = 8             # oneDNN's row hint when prepacking: 1 makes a lone row take a gemv path
CHECK_COUNTS = (2, 3, 5, 8, 17, 33)  # row counts tried at every offset of CHECK_OFFSETS (the others once each)
CHECK_OFFSETS = (0, 1, 7)  # where a call's rows start among the check's inputs
CHECK_VERSION = 2         # of `check_rows` (part of the book's name: a stronger check is run again): 2 = every
                          # row count up to the limit (oneDNN's bfloat16 [576 x 576] at 2 threads on an Intel Xeon
                          # with AMX gave calls of 25-32 rows other bits than calls of 64; 17 and 33 rows passed)
CHECK_ROWS = 64           # the most rows per call a check can prove; larger calls go in chunks
ROW_LIMITS = (64, 32, 16, 8, 4, 2)   # rows per call tried, largest first (AMX switches kernels above 32)


@dataclass(frozen=True)
class RowCheck:
    """Whether a kernel's rows kept their bits whatever the row count of the call, on the inputs tried."""
    many_rows: bool       # for 2 <= M <= max_rows rows, each row's bits are those it gets among max_rows rows
    lone_row: bool        # a lone row (M = 1) got those bits too
    max_rows: int = CHECK_ROWS  # the most rows per call with those bits: `linear` splits larger calls

    @property
    def verdict(self) -> str:
        if not self.many_rows:
            return "NOT row-invariant"
        limit = f" up to {self.max_rows} rows per call" if self.max_rows < CHECK_ROWS else ""
        return "row-invariant" + limit + ("" if self.lone_row else " for 2+ rows (a lone row differs)")


def check_inputs(n_in: int, dtype: torch.dtype) -> Tensor:
    """[CHECK_ROWS, n_in] fixed random rows at scales from 0.1 to ~6 (rounding hides some differences)."""
    g = torch.Generator().manual_seed(0)
    scale = 0.1 + torch.arange(CHECK_ROWS, dtype=torch.float32)[:, None] % 7
    return (torch.randn(CHECK_ROWS, n_in, generator=g) * scale).to(dtype)


def check_calls(limit: int, n: int, every_count: bool = True) -> list[tuple[int, int]]:
    """(rows, offset) of the calls `check_rows` compares for a limit of `limit` rows among n check inputs: the
    sampled counts at every offset of CHECK_OFFSETS and, with `every_count`, every other count from 2 to the
    limit once, its call placed by turns at the start, one row in and at the end of the inputs (where a split
    of a call's rows among threads showed other bits)."""
    sampled = [(m, j) for m in (*CHECK_COUNTS, limit) if m <= limit for j in CHECK_OFFSETS if j + m <= n]
    if not every_count:
        return sampled
    return sampled + [(m, (0, 1, n - m)[m % 3]) for m in range(2, limit) if m not in CHECK_COUNTS]


def check_rows(fn: Callable[[Tensor], Tensor], x: Tensor, every_count: bool = True) -> RowCheck:
    """Bit-for-bit check of fn ([M, in] -> [M, out]) on x [CHECK_ROWS, in], for the largest limit L in
    ROW_LIMITS that passes: the rows of fn(x[j:j+M]) against the same rows of x computed in calls of L
    rows (other neighbours, other places in the call), for every M from 2 to L (`check_calls`; without
    `every_count` the sampled counts only: for the native kernels, whose rows get the same operations
    whatever the row or thread count by construction, the check confirms that); then every row alone
    against them.

    Kernels may switch algorithm with the row count (oneDNN's AMX bfloat16 kernels do above 32 rows) and,
    with several threads, split a call's rows among them by its row count, so a kernel invariant only up
    to L rows is used in calls of at most L rows, and no row count up to L goes unchecked."""
    for limit in ROW_LIMITS:
        ref = torch.cat([fn(c) for c in x.split(limit)])                   # [CHECK_ROWS, out] in calls of `limit`
        if all(torch.equal(fn(x[j:j + m]), ref[j:j + m]) for m, j in check_calls(limit, len(x), every_count)):
            lone = all(torch.equal(fn(x[j:j + 1]), ref[j:j + 1]) for j in range(len(x)))
            return RowCheck(True, lone, limit)
    return RowCheck(False, False, 1)


@dataclass(frozen=True)
class PackedLinear:
    """A oneDNN-prepacked linear weight and what the check found about this machine's kernel for it."""
    weight: Tensor        # opaque packed copy of [out, in]
    dtype: torch.dtype    # of its inputs and outputs
    check: RowCheck

    pair = True           # a lone row is computed as two copies of it (see the module docstring)
    label = "oneDNN prepacked"
    fuses_top = False

    def __call__(self, x: Tensor) -> Tensor:
        """x [M, in] -> [M, out]"""
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")


def packed_linear_available(device: torch.device) -> bool:
    """Whether oneDNN prepacked linears run here (CPU builds of torch with mkldnn)."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_BOOKS: dict[Path, dict[str, list]] = {}    # book file -> repr(key) -> [many_rows, lone_row, max_rows] or [choice]
TIMED_ROWS = (1, 4, 8)    # row counts `fastest` times: plain decoding, and verifying 3 or 7 drafts
TIMED_REPEATS = 7         # calls per candidate and row count (interleaved; the fastest counts)
TIE_MARGIN = 0.05         # kernels whose timed costs are this close count as tied (`tie_break`)
_HELD: list[bool] = []    # this process holds the book's lock (`_locked_book`)


def book_path() -> Path:
    """Where this machine's check results are kept: one file per CPU, torch build, ISA limit and thread count
    (what decides which kernel runs), under $SPECDEC_CACHE/kernel-checks."""
    from ..machine import probe

    m = probe()
    stamp = f"{m.cpu}|{torch.__version__}|{m.torch_capability}|{m.isa_limit}|{torch.get_num_threads()}|{CHECK_VERSION}"
    return _book_file(stamp, os.environ.get("SPECDEC_CACHE", ""))


@functools.cache                     # a start asks about 360 times (every kernel's check and choice)
def _book_file(stamp: str, cache_setting: str) -> Path:
    from .registry import cache_dir

    return cache_dir() / "kernel-checks" / f"{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.json"


@functools.cache                     # once per process
def announce() -> None:
    """One log line (stderr under the CLI) before the first kernel check or timing a start pays for."""
    logging.getLogger("specdec").info("checking and timing the kernels for this CPU and thread count (once; kept "
                                      "in %s) ...", book_path().parent)


def checked(key: tuple, kernel: Callable[[Tensor], Tensor], n_in: int, dtype: torch.dtype,
            every_count: bool = True) -> RowCheck:
    """`check_rows` of `kernel`, run once per machine for each `key` (a kernel family and its shape: kernels
    are chosen by those, not by the values) and kept in `book_path()`, so a start does not pay for it again
    (the LM head's check alone took ~0.4 s)."""
    name = repr(key)
    entry = _book().get(name)
    if not _row_entry(entry):                                                  # absent, an older layout, damaged
        with _locked_book() as book:                                           # another process may have it now
            entry = book.get(name)
            if not _row_entry(entry):
                announce()
                c = check_rows(kernel, check_inputs(n_in, dtype), every_count)
                entry = book[name] = [c.many_rows, c.lone_row, c.max_rows]
    return RowCheck(*entry)


def _row_entry(entry: object) -> bool:
    """Whether a book entry reads as what `checked` writes: [many_rows: bool, lone_row: bool, max_rows: int >= 1]."""
    return (isinstance(entry, list) and len(entry) == len(RowCheck.__dataclass_fields__)
            and isinstance(entry[0], bool) and isinstance(entry[1], bool)
            and type(entry[2]) is int and entry[2] >= 1)


def _choice_entry(entry: object, makers: dict) -> bool:
    """Whether a book entry reads as what `fastest` writes, naming one of `makers`: [choice, {name: ms}]."""
    return isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and entry[0] in makers


def _read_book(path: Path) -> dict[str, list]:
    try:
        book = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return book if isinstance(book, dict) else {}


def _book() -> dict[str, list]:
    """This machine's book of checks and choices (read once per process)."""
    path = book_path()
    if path not in _BOOKS:
        _BOOKS[path] = _read_book(path)
    return _BOOKS[path]


@contextmanager
def _locked_book() -> Iterator[dict[str, list]]:
    """The book as it is on disk now, merged into this process's, under an exclusive lock (concurrent first
    starts add entries one after another instead of the last writer's file winning); written back at exit.
    An entry on disk wins over this process's: every process then follows the first choice made."""
    from .registry import exclusive, write_atomic

    if _HELD:                                      # nested (a choice's candidates check their rows): held already
        yield _book()
        return
    path = book_path()
    with exclusive(path.with_suffix(".lock"), "waiting for another process checking this machine's kernels ..."):
        _HELD.append(True)
        try:
            book = _book()
            book.update(_read_book(path))
            yield book
            write_atomic(path, json.dumps(book, indent=1).encode())
        finally:
            _HELD.clear()


def timing_clock() -> Callable[[], float]:
    """The clock kernels are timed by: with one torch thread, the calling thread's CPU time (every candidate runs
    in that thread, and the time it waits for the core while other work runs is not its cost); with more, wall
    time (the kernel's other threads are not the caller's)."""
    import time

    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def runnable_tasks() -> int:
    """Threads ready to run on this machine now, this process's included (/proc/loadavg; 0 where unknown)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0


def seconds_per_call(kernels: dict[str, Kernel], w: Tensor) -> dict[str, float]:
    """Per kernel of x [M, in] @ w.T (w [out, in]), called through `linear` as a model calls it: the sum over
    M in TIMED_ROWS of its fastest call (TIMED_REPEATS calls each, the kernels interleaved), on `timing_clock`.
    With one thread another job on the machine does not count; with more, a busy machine stalls the kernels'
    threads at every call, so the timings may not be an idle machine's: said once on stderr (`busy_note`)."""
    clock = timing_clock()
    x = check_inputs(w.shape[1], w.dtype)
    times: dict[str, dict[int, list[float]]] = {n: {m: [] for m in TIMED_ROWS} for n in kernels}
    for name, k in kernels.items():
        linear(x[:1], w, {name: k}, name)                                   # warm-up
    busy = 0
    for _ in range(TIMED_REPEATS):
        busy += runnable_tasks() > (os.cpu_count() or 1)
        for m in TIMED_ROWS:
            for name, k in kernels.items():
                t0 = clock()
                linear(x[:m], w, {name: k}, name)
                times[name][m].append(clock() - t0)
    if torch.get_num_threads() > 1 and busy > TIMED_REPEATS // 2:
        busy_note()
    return {n: sum(min(ts) for ts in by_m.values()) for n, by_m in times.items()}


@functools.cache
def busy_note() -> None:
    """Say once that kernels were timed on several threads while other work ran on the CPU."""
    logging.getLogger("specdec").warning(
        "timing the kernels on %d threads while other work runs on this CPU: the choices kept (in %s) may be "
        "slower than an idle machine's; delete that file to time them again when it is idle (greedy text may "
        "change with the kernels)", torch.get_num_threads(), book_path())


def fastest(key: tuple, makers: dict[str, Callable[[], Kernel]], w: Tensor) -> Kernel:
    """The kernel for w [out, in] (dense, the values the kernels compute with) among those `makers` build:
    the fastest (`seconds_per_call`) of those whose rows passed their check (the first if none did). Timed
    once per machine for each `key` (the candidates and their shape) and kept in `book_path()`, so every
    start of the same machine runs the same kernel, hence gives the same bits."""
    name = repr(("fastest", *key))
    entry = _book().get(name)
    if _choice_entry(entry, makers):
        return makers[entry[0]]()
    with _locked_book() as book:
        entry = book.get(name)
        if _choice_entry(entry, makers):                                          # another process chose meanwhile
            return makers[entry[0]]()
        announce()
        built = {n: make() for n, make in makers.items()}
        valid = {n: k for n, k in built.items() if k.check.many_rows} or dict([next(iter(built.items()))])
        cost = seconds_per_call(valid, w) if len(valid) > 1 else {n: 0.0 for n in valid}
        choice = tie_break(cost)
        book[name] = [choice, {n: round(c * 1000, 2) for n, c in cost.items()}]   # the choice, and ms per TIMED_ROWS
    return built[choice]


def tie_break(cost: dict[str, float]) -> str:
    """The kernel to keep for these costs: the first by name among those within TIE_MARGIN of the cheapest,
    so that timing noise between first starts rarely flips a near-tie (the kernels' bits differ in the last
    place, and so, in near-ties of the target's own, may greedy text)."""
    best = min(cost.values())
    return min(n for n, c in cost.items() if c <= best * (1 + TIE_MARGIN))


def pack(w: Tensor, rows: int = PACK_ROWS) -> PackedLinear:
    """A prepacked copy of w [out, in] for about `rows` input rows, its rows checked on this machine
    (once per shape and dtype per process: the kernel is chosen by those, not by the values)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)
    kernel = PackedLinear(packed, w.dtype, RowCheck(True, True))
    return PackedLinear(packed, w.dtype, checked(("onednn", *w.shape, w.dtype, rows), kernel, w.shape[1], w.dtype))


@dataclass(frozen=True)
class DenseLinear:
    """F.linear on a dense weight [out, in] (shared, not copied): for prefills of many rows, whose bits
    must depend only on the prompt piece, not agree with decoding (BLAS picks kernels by row count)."""
    weight: Tensor

    check = RowCheck(many_rows=False, lone_row=False)   # not row-invariant: never batched across prompts
    pair = True
    label = "F.linear"
    fuses_top = False

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class Kernel(Protocol):
    """A linear layer's kernel: x [M, in] in `dtype` -> [M, out]; `pair`: compute a lone row as two; `label`:
    what it is, for `specdec info`; `fuses_top`: `with_top` gives each row's argmax from the kernel's own call."""
    dtype: torch.dtype
    check: RowCheck
    pair: bool
    label: str
    fuses_top: bool

    def __call__(self, x: Tensor) -> Tensor: ...

    def with_top(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [M, in] -> ([M, out] float32, each row's argmax [M] int64); only where `fuses_top`."""
        ...


def linear(x: Tensor, w: Tensor, packed: dict[str, Kernel], name: str) -> Tensor:
    """x [..., in] @ w.T through the kernel `name` if there is one (inputs cast to its dtype, the result
    back to x's), else F.linear.

    A lone row goes as a pair where the kernel asks for it (F.linear always: CPU BLAS takes a gemv
    path for one row), and more rows than the kernel's checked limit go in chunks of that limit,
    so decoding one token and verifying drafts agree bit for bit.
    """
    p = packed.get(name)
    if x.numel() == x.shape[-1] and (p is None or p.pair):                  # one row, any leading shape
        return linear(x.reshape(1, -1).expand(2, -1), w, packed, name)[0].view(*x.shape[:-1], -1)
    if p is None:
        return F.linear(x, w)
    # casts and reshapes only where they change something: each ATen call costs microseconds, ~120 per token
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])                # [M, in]
    if rows.dtype != p.dtype:
        rows = rows.to(p.dtype)
    limit = p.check.max_rows if p.check.many_rows else len(rows)           # a failed check proves no limit
    if len(rows) <= limit:
        out = p(rows)
    else:                                                                   # a last chunk of one row is paired too
        out = torch.cat([p(c) if len(c) > 1 or not p.pair else p(c.expand(2, -1))[:1] for c in rows.split(limit)])
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], -1)


def linear_top(x: Tensor, w: Tensor, packed: dict[str, Kernel], name: str) -> tuple[Tensor, Tensor]:
    """(`linear`(x, w, packed, name) as float32, its argmax over the last dimension): x [..., in] -> [..., out],
    [...] int64, the first index of the largest (a NaN counting as the largest, as `sampling.argmax`). A kernel that
    `fuses_top` finds the argmax in its own call, while the outputs are still in the caches (an LM head's greedy
    tokens: after a forward has streamed the weights, every further call finds its code and data cold)."""
    p = packed.get(name)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])                # [M, in]
    if p is not None and p.fuses_top and not p.pair and (not p.check.many_rows or len(rows) <= p.check.max_rows):
        out, top = p.with_top(rows if rows.dtype == p.dtype else rows.to(p.dtype))
        return (out, top) if x.dim() == 2 else (out.view(*x.shape[:-1], -1), top.view(x.shape[:-1]))
    out = linear(x, w, packed, name).float()
    return out, argmax(out)
