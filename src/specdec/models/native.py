"""The native attention kernel (`attend.c`): built once per machine with the system C compiler, called
through ctypes.

A decoding or verification forward scores a handful of queries against the cache in every layer;
as torch ops, the row-invariant block attention (`attention.attention`) costs 30-40 ATen calls per
layer, 100-270 us on a one-thread AMD EPYC for 1-3 key blocks, more than the layer's four 4-bit
linears together. The C kernel walks each query's visible keys in slot order, so a query's bits
depend on its keys alone (row invariance by construction, trees included), in one call per layer.

Built with `cc -O3 -march=native` into $SPECDEC_CACHE/native, keyed by the source, the CPU and the
compiler; where no compiler is found, the build fails or $SPECDEC_NATIVE=0, `available()` is False
and the forward keeps the torch form (a log line says why).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("attend.c")
_LIB: list[ctypes.CDLL] = []       # the loaded kernel, once built
_TRIED: list[str] = []             # why the kernel is not available ("" = it is)

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _compiler() -> str:
    return os.environ.get("CC", "") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") or ""


def _library_path(cc: str) -> Path:
    from ..machine import cpu_flags, cpu_model
    from .registry import cache_dir

    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    stamp = "|".join([SOURCE.read_text(), cpu_model(), " ".join(sorted(cpu_flags())), cc, version])
    return cache_dir() / "native" / f"attend-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.so"


def _build() -> str:
    """Load (building if needed) the kernel; returns "" or why it is not available."""
    if os.environ.get("SPECDEC_NATIVE", "1") == "0":
        return "disabled by SPECDEC_NATIVE=0"
    cc = _compiler()
    if not cc:
        return "no C compiler found (cc, gcc or clang; or set $CC)"
    try:
        path = _library_path(cc)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                out = Path(tmp) / path.name
                r = subprocess.run([cc, "-O3", "-march=native", "-shared", "-fPIC", "-o", str(out), str(SOURCE), "-lm"],
                                   capture_output=True, text=True, timeout=120)
                if r.returncode != 0:
                    return f"{cc} failed: {r.stderr.strip()[:300]}"
                os.replace(out, path)                          # atomic: concurrent builds never see half a file
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not build or load it: {e}"
    fn = lib.specdec_attend
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR,
                   _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _PTR]
    _LIB.append(lib)
    return ""


def available(device: torch.device) -> bool:
    """Whether forwards on `device` attend through the native kernel (CPU, a compiler, a successful build)."""
    if device.type != "cpu":
        return False
    if not _TRIED:
        _TRIED.append(_build())
        if _TRIED[0]:
            logging.getLogger("specdec").info("native attention unavailable (%s): using the torch form", _TRIED[0])
    return not _TRIED[0]


def attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> Tensor:
    """q [B, nh, T, hd] float32 (last dim contiguous); k, v [B, nkv, S, hd] float32 views of cache rows
    (rows of hd contiguous, v strided as k); visible [B, T, S] bool, contiguous -> [B, T, nh * hd]."""
    B, nh, T, hd = q.shape
    nkv, S = k.shape[1], k.shape[2]
    if q.stride(3) != 1 or k.stride()[2:] != (hd, 1) or v.stride() != k.stride() or hd % 8:
        raise ValueError("native attention: unsupported layout")
    out = torch.empty(B, T, nh * hd, dtype=torch.float32)
    rc = _LIB[0].specdec_attend(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
                                k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
                                visible.data_ptr(), B, nh, nkv, T, S, hd, scale, out.data_ptr())
    if rc:
        raise MemoryError("native attention: out of memory")
    return out


def describe(device: torch.device) -> str:
    """What decoding attends through on `device`, for `specdec info` and /health."""
    if available(device):
        return "native kernel (attend.c)"
    return "torch ops" + (f" ({_TRIED[0]})" if _TRIED and _TRIED[0] else "")
