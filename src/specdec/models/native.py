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
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..cache import ForwardSlots

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
    fn = lib.specdec_qkv_attend
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, ctypes.c_int, _I64, _PTR, _PTR, _PTR, _PTR, ctypes.c_float, _PTR, _PTR,
                   _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _PTR, ctypes.c_int]
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


def qkv_attend(qkv: Tensor, cos: Tensor, ssin: Tensor, q_norm: Tensor, k_norm: Tensor, eps: float,
               k: Tensor, v: Tensor, layer: int, where: "ForwardSlots", visible: Tensor, n_heads: int,
               scale: float, out_dtype: torch.dtype) -> Tensor:
    """A layer's attention from its fused projection: qkv [B*T, (nh + 2 nkv) * hd] (bfloat16 or float32) ->
    [B*T, nh * hd] in out_dtype (bfloat16 or float32). Queries and keys are roped (cos, ssin [B, 1, T, hd],
    see `decoder.rope`), after a per-head RMSNorm where q_norm / k_norm are float32 weights [hd] (empty: none);
    keys and values go into the cache k, v [L, R, nkv, Smax, hd] at `where`'s scratch slots of `layer`;
    each token attends over the slots `visible` [B, T, S] allows."""
    B, T, S = visible.shape
    L, R, nkv, Smax, hd = k.shape
    if where.t != T or where.rows.numel() != B or qkv.shape[0] != B * T or where.kv_len != S:
        raise ValueError("native attention: the tokens, slots and mask disagree")
    if (qkv.dtype not in (torch.bfloat16, torch.float32) or out_dtype not in (torch.bfloat16, torch.float32)
            or qkv.stride(-1) != 1 or not (cos.is_contiguous() and ssin.is_contiguous() and visible.is_contiguous())
            or not (k.is_contiguous() and v.is_contiguous()) or k.dtype != torch.float32 or hd % 8
            or cos.dtype != torch.float32 or ssin.dtype != torch.float32 or cos.shape != ssin.shape
            or cos.shape[-1] != hd or cos.numel() != B * T * hd
            or visible.dtype != torch.bool or qkv.shape[-1] != (n_heads + 2 * nkv) * hd):
        raise ValueError("native attention: unsupported layout")
    out = torch.empty(B * T, n_heads * hd, dtype=out_dtype)
    layer_bytes = layer * R * nkv * Smax * hd * 4
    norms = [w.data_ptr() if w.numel() else None for w in (q_norm, k_norm)]           # None: NULL, no norm
    rc = _LIB[0].specdec_qkv_attend(qkv.data_ptr(), qkv.dtype == torch.bfloat16, qkv.stride(0), cos.data_ptr(),
                                    ssin.data_ptr(), norms[0], norms[1], eps, k.data_ptr() + layer_bytes,
                                    v.data_ptr() + layer_bytes, where.row_off.data_ptr(), where.at.data_ptr(),
                                    Smax * hd, visible.data_ptr(), S, B, T, n_heads, nkv, hd, scale,
                                    out.data_ptr(), out_dtype == torch.bfloat16)
    if rc:
        raise MemoryError("native attention: out of memory") if rc == -1 else ValueError("native attention: too many query heads per kv head")
    return out


def describe(device: torch.device) -> str:
    """What decoding attends through on `device`, for `specdec info` and /health."""
    if available(device):
        return "native kernel (attend.c)"
    return "torch ops" + (f" ({_TRIED[0]})" if _TRIED and _TRIED[0] else "")
