"""Converted weights on disk, so that a GGUF file is dequantized and packed once, not at every start.

An entry holds what `gguf_loader.read_gguf` makes of a file for one compute form: the configuration,
the dequantized weights and the 4-bit and 8-bit kernels' packed codes and scales. It is keyed by the file's
SHA-256, the weights' dtype, the 4-bit form, the torch version and torch's CPU kernel family (the
int4 packing is the kernel's own layout). Entries are written whole and renamed into place, so a
killed writer leaves nothing half-read; an unreadable or damaged entry (a checksum of its tensors) is converted
again. The checksum is read once per version of an entry's file and boot of the machine, then remembered
(`verified`). The file hash is remembered per `registry.file_stamp` (path, size, times, inode), so a start reads
only the entry; files with the same bytes (copies, links) share one entry.
Delete `$SPECDEC_CACHE/weights` (default `~/.cache/specdec/weights`) to reclaim the space.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import logging
import re
import signal
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from .config import ModelConfig
from .int4 import Int4Linear
from .registry import cache_dir, file_sha256, file_stamp, read_book, remember, remove_lock, write_atomic_by

FORMAT = 8               # 2: the 4-bit kernels' `copies` (an 8-bit LM head as two 4-bit halves); 3: the Q8_0 head;
                         # 4: the native 4-bit layout; 5: layers of 8-bit codes, Q4_0 as 4-bit; 6: Q6_K as 8-bit codes;
                         # 7: a checksum of the tensors in the metadata; 8: RoPE scaling in the configuration


def entry(path: Path, dtype: torch.dtype, int4: bool) -> Path:
    """Where the converted weights of `path` in this form live (whether or not they exist yet)."""
    dt = str(dtype).removeprefix("torch.")
    cap = torch.backends.cpu.get_cpu_capability().lower()
    form = f"{dt}-{'q4' if int4 else 'dense'}-torch{torch.__version__.split('+')[0]}-{cap}-v{FORMAT}"
    digest = file_sha256(path)[:16]
    folder = cache_dir() / "weights"
    if folder not in _SWEPT:                                            # once per process
        _SWEPT.add(folder)
        for lock in folder.glob(".*.safetensors.lock"):                 # of entries never written or removed
            if not lock.with_name(lock.name[1:-len(".lock")]).exists():
                remove_lock(lock)
    same = sorted(folder.glob(f"*-{digest}-{form}.safetensors"))     # the same bytes under another name
    where = same[0] if same else folder / f"{path.stem}-{digest}-{form}.safetensors"
    for old in superseded(where):
        old.unlink(missing_ok=True)
        remove_lock(old.with_name(f".{old.name}.lock"))
    return where


_SWEPT: set[Path] = set()


def write(where: Path, weights) -> None:
    """Store `weights` (a `gguf_loader.Weights`) at `where`."""
    import os

    from safetensors.torch import save_file

    tensors = {f"state.{k}": v.contiguous() for k, v in weights.state.items()}
    for (i, name), k in weights.int4.items():
        tensors[f"int4.{i}.{name}.packed"] = k.packed
        tensors[f"int4.{i}.{name}.scale_zero"] = k.scale_zero
        tensors[f"int4.{i}.{name}.copies"] = torch.tensor([k.copies])
    for k, v in weights.q8_head.items():
        tensors[f"q8head.{k}"] = v
    for prefix, layouts in (("q4n", weights.q4), ("q8n", weights.q8)):
        for (i, name), layout in layouts.items():
            for part, v in layout.items():
                tensors[f"{prefix}.{i}.{name}.{part}"] = v
    meta = {"format": str(FORMAT), "config": json.dumps(dataclasses.asdict(weights.config)), "checksum": checksum(tensors)}

    def fill(fd: int, tmp: str) -> None:             # straight from the tensors: no copy of the entry in memory
        os.close(fd)
        save_file(tensors, tmp, metadata=meta)

    write_atomic_by(where, fill)


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """A checksum of the tensors' bytes, in name order: per tensor the sum of its 64-bit words (mod 2**64) and of
    its last bytes, chained. A flipped bit always changes it, a zeroed block all but surely; it runs at about memory
    speed (twice a CRC-32's), so `read` checks every entry at every start."""
    import numpy as np

    total = 0
    for name in sorted(tensors):
        raw = tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy()       # [bytes] a view, no copy
        words = len(raw) // 8
        part = int(raw[:words * 8].view(np.uint64).sum(dtype=np.uint64)) + int(raw[words * 8:].sum(dtype=np.uint64))
        total = _chained(total, name, part, len(raw))
    return f"{total:016x}"


def _chained(total: int, name: str, part: int, length: int) -> int:
    """The running checksum after tensor `name` of `length` bytes whose words and tail bytes sum to `part`."""
    return (total * 1_000_003 + part + length + sum(name.encode())) % (1 << 64)


CHUNK = 1 << 22                 # bytes per read of `file_checksum` (a multiple of 8)


def file_checksum(where: Path) -> str:
    """`checksum` of the tensors stored at `where`, read from the file in chunks rather than through the tensors'
    memory map: a start then keeps resident only the pages its kernels touch (a q4 start, e.g., not the dense
    prefill weights of a model it never prefills, nor the candidates its kernel checks did not choose)."""
    import numpy as np

    total = 0
    buf = bytearray(CHUNK)
    with open(where, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        start = 8 + size
        for name in sorted(k for k in header if k != "__metadata__"):
            begin, end = (start + o for o in header[name]["data_offsets"])
            length, part, tail = end - begin, 0, b""
            f.seek(begin)
            for at in range(begin, end, CHUNK):
                n = f.readinto(memoryview(buf)[:min(CHUNK, end - at)])
                if n != min(CHUNK, end - at):
                    raise OSError(f"{where} ends inside tensor {name}")
                words = n // 8
                part += int(np.frombuffer(buf, np.uint64, words).sum(dtype=np.uint64))
                tail = bytes(buf[words * 8:n])                      # only the tensor's last chunk has one
            part += sum(tail)
            total = _chained(total, name, part, length)
    return f"{total:016x}"


SETTLED_SECONDS = 2.0           # a file changed this long ago cannot share its times with a change to come


def boot_id() -> str:
    """This boot of the machine, or '' where the system does not tell it."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def verified(where: Path, want: str) -> bool:
    """Whether the entry at `where` holds the bytes of checksum `want` (its metadata's). The file is read and
    summed (`file_checksum`, 0.15-0.2 s for a 750 MB entry) once per version of the file (`registry.file_stamp`:
    size, modification and change times, inode) and boot, then remembered in `verified.json` beside it: a
    rewrite or an edit in place gives the file new times, a crash that left zeroed blocks a new boot. Only a file
    settled for SETTLED_SECONDS is remembered, so a change right after the check cannot keep its times."""
    boot, st = boot_id(), where.stat()
    stamp, book = file_stamp(where), where.parent / "verified.json"
    known = read_book(book)
    if boot and known.get(stamp) == f"{boot}:{want}":
        return True
    if file_checksum(where) != want:
        return False
    if boot and time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > SETTLED_SECONDS * 1e9:
        remember(book, known, stamp, f"{boot}:{want}", keep=lambda v: v.startswith(f"{boot}:"))
    return True


def superseded(where: Path) -> list[Path]:
    """Entries of the same file, torch and kernel family that an older cache format wrote, in any form (dtype,
    q4 or dense): no start reads them again. (Other torch versions' entries stay: another environment may share
    the cache.)"""
    name = re.fullmatch(r"(.*-[0-9a-f]{16})-.+-(torch[^-]+-[^-]+)-v\d+\.safetensors", where.name)
    if name is None:
        return []
    head, machine = name.groups()
    older = rf"{re.escape(head)}-[^-]+-(q4|dense)-{re.escape(machine)}-v(\d+)\.safetensors"
    return [p for p in where.parent.glob(f"{glob.escape(head)}-*-{glob.escape(machine)}-v*.safetensors")
            if (m := re.fullmatch(older, p.name)) and int(m.group(2)) < FORMAT]     # a newer version's stay


@contextmanager
def interrupts_noted(noted: list[int]) -> Iterator[None]:
    """Note a Ctrl-C (in `noted`) while the block runs, besides raising KeyboardInterrupt: inside a native
    call (safetensors' reads) it can surface as another exception (ValueError, SystemError). Only the main
    thread with Python's default handler is watched."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def note(signum: int, frame: object) -> None:
        noted.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def read(where: Path):
    """The `gguf_loader.Weights` stored at `where`, or None when there is no readable entry."""
    from safetensors import safe_open

    from .gguf_loader import Weights

    if not where.is_file():
        return None
    noted: list[int] = []
    try:
        with interrupts_noted(noted), safe_open(str(where), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != str(FORMAT):
                return None
            cfg = ModelConfig(**json.loads(meta["config"]))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception:                     # any unreadable or foreign entry: convert again
        if noted:                         # ... unless it was Ctrl-C, mangled by the native read
            raise KeyboardInterrupt from None
        return None
    try:
        damaged = not verified(where, meta["checksum"])
    except (OSError, ValueError, KeyError, TypeError):
        damaged = True
    if damaged:
        logging.getLogger("specdec").warning("%s is damaged (its bytes do not match their checksum): converting again",
                                             where)
        return None
    state = {k[len("state."):]: v for k, v in tensors.items() if k.startswith("state.")}
    int4 = {}
    for k in tensors:
        if k.startswith("int4.") and k.endswith(".packed"):
            _, i, name, _ = k.split(".")
            stem = f"int4.{i}.{name}"
            int4[(int(i), name)] = Int4Linear.packed_as(tensors[f"{stem}.packed"], tensors[f"{stem}.scale_zero"],
                                                        int(tensors[f"{stem}.copies"]))
    q8_head = {k[len("q8head."):]: v for k, v in tensors.items() if k.startswith("q8head.")}
    layouts: dict[str, dict[tuple[int, str], dict[str, torch.Tensor]]] = {"q4n": {}, "q8n": {}}
    for k, v in tensors.items():
        if k.startswith(("q4n.", "q8n.")):
            prefix, i, name, part = k.split(".")
            layouts[prefix].setdefault((int(i), name), {})[part] = v
    return Weights(cfg, state, int4, q8_head, layouts["q4n"], layouts["q8n"])
