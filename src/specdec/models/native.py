"""The native kernels (`attend.c`): built once per machine with the system C compiler, called through ctypes.

A decoding or verification forward scores a handful of tokens per layer, so its cost is per-call
overhead as much as arithmetic: as torch ops, the row-invariant block attention (`attention.attention`)
costs 30-40 ATen calls per layer, 100-270 us on a one-thread AMD EPYC for 1-3 key blocks, and the
composite F.rms_norm about 10 us per call. The C kernels take one call each: `Attend` (q/k norms,
rope, cache writes and attention, each query over its own keys in slot order, so its bits depend on
its keys alone, trees included; its shared arguments checked once per forward), `add_rms_norm`, and
`Q8Head`, an 8-bit LM head as the GGUF stores it (float inputs, or inputs quantized to 8 bits as well:
exact integer block sums).

Built with `cc -O3 -march=native -mno-avx512f` into $SPECDEC_CACHE/native, keyed by the source, the CPU,
the compiler and its flags; where no compiler is found, the build fails or $SPECDEC_NATIVE=0, `available()` is False
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..cache import ForwardSlots
    from .kernels import RowCheck

SOURCE = Path(__file__).with_name("attend.c")
_LIB: list[ctypes.CDLL] = []       # the loaded kernel, once built
_TRIED: list[str] = []             # why the kernel is not available ("" = it is)

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
DTYPES = (torch.bfloat16, torch.float32)  # the activation dtypes the kernels take


def _compiler() -> str:
    return os.environ.get("CC", "") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") or ""


def _flags() -> list[str]:
    """Compiler flags: this CPU's instructions up to AVX2 (the AVX-512 builds of these loops were no faster
    for attention and 2x slower for the 8-bit head on an AMD EPYC Zen 4), no contraction into fused
    multiply-adds (each loop computes exactly what its C says, whichever loop computes it); no floating-point
    traps assumed (none is ever enabled), so loops with comparisons (softmax's exp clamp) vectorise."""
    return ["-O3", "-march=native", "-mno-avx512f", "-ffp-contract=off", "-fno-trapping-math", "-shared", "-fPIC",
            "-pthread"]


def _library_path(cc: str) -> Path:
    from ..machine import cpu_flags, cpu_model
    from .registry import cache_dir

    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    stamp = "|".join([SOURCE.read_text(), cpu_model(), " ".join(sorted(cpu_flags())), cc, version, *_flags()])
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
                r = subprocess.run([cc, *_flags(), "-o", str(out), str(SOURCE), "-lm"],
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
    fn = lib.specdec_add_rms_norm
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _PTR, ctypes.c_int, _I64, _I64, _PTR, ctypes.c_float, _PTR, _PTR]
    fn = lib.specdec_q8_0_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, ctypes.c_int, _I64, _I64, _PTR, _PTR, _I64, _PTR, ctypes.c_int]
    fn = lib.specdec_q8_0_q8_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, ctypes.c_int, _I64, _I64, _PTR, _PTR, _I64, _PTR, ctypes.c_int, ctypes.c_int]
    lib.specdec_q8x8_isa.restype = ctypes.c_int
    lib.specdec_q8x8_isa.argtypes = [ctypes.c_int]
    _LIB.append(lib)
    return ""


def source_stamp() -> str:
    """A short hash of the kernels' source: part of the key of anything timed with them."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


def available(device: torch.device) -> bool:
    """Whether forwards on `device` attend through the native kernel (CPU, a compiler, a successful build)."""
    if device.type != "cpu":
        return False
    if not _TRIED:
        _TRIED.append(_build())
        if _TRIED[0]:
            logging.getLogger("specdec").info("native attention unavailable (%s): using the torch form", _TRIED[0])
    return not _TRIED[0]


class Attend:
    """One forward's native attention: what every layer shares (the rope tables cos, ssin [B, 1, T, hd] (see
    `decoder.rope`), the cache k, v [L, R, nkv, Smax, hd], `where`'s scratch slots, the mask `visible`
    [B, T, S]) checked once per forward; each call runs one layer (`qkv_attend`)."""

    def __init__(self, cos: Tensor, ssin: Tensor, k: Tensor, v: Tensor, where: "ForwardSlots", visible: Tensor,
                 n_heads: int, scale: float) -> None:
        B, T, S = visible.shape
        L, R, nkv, Smax, hd = k.shape
        if where.t != T or where.rows.numel() != B or where.kv_len != S:
            raise ValueError("native attention: the tokens, slots and mask disagree")
        if (not (cos.is_contiguous() and ssin.is_contiguous() and visible.is_contiguous())
                or not (k.is_contiguous() and v.is_contiguous()) or k.dtype != torch.float32 or hd % 8
                or cos.dtype != torch.float32 or ssin.dtype != torch.float32 or cos.shape != ssin.shape
                or cos.shape[-1] != hd or cos.numel() != B * T * hd or visible.dtype != torch.bool):
            raise ValueError("native attention: unsupported layout")
        self._keep = (cos, ssin, k, v, where, visible)                      # the pointers below stay valid
        self.rows, self.width = B * T, (n_heads + 2 * nkv) * hd
        self.out_width = n_heads * hd
        self._layer_bytes = R * nkv * Smax * hd * 4
        self._k, self._v = k.data_ptr(), v.data_ptr()
        self._head = (cos.data_ptr(), ssin.data_ptr())
        self._tail = (where.row_off.data_ptr(), where.at.data_ptr(), Smax * hd, visible.data_ptr(), S, B, T,
                      n_heads, nkv, hd, scale)

    def __call__(self, qkv: Tensor, q_norm: Tensor, k_norm: Tensor, eps: float, layer: int,
                 out_dtype: torch.dtype) -> Tensor:
        """qkv [B*T, (nh + 2 nkv) * hd] (bfloat16 or float32) -> [B*T, nh * hd] in out_dtype (bfloat16 or
        float32): queries and keys roped, after a per-head RMSNorm where q_norm / k_norm are float32 weights
        [hd] (empty: none); keys and values written to `layer`'s scratch slots; each token attends over the
        slots the mask allows."""
        if (qkv.dtype not in DTYPES or out_dtype not in DTYPES or qkv.stride(-1) != 1
                or qkv.shape != (self.rows, self.width)):
            raise ValueError("native attention: unsupported layout")
        out = torch.empty(self.rows, self.out_width, dtype=out_dtype)
        off = layer * self._layer_bytes
        rc = _LIB[0].specdec_qkv_attend(qkv.data_ptr(), qkv.dtype == torch.bfloat16, qkv.stride(0), *self._head,
                                        q_norm.data_ptr() if q_norm.numel() else None,
                                        k_norm.data_ptr() if k_norm.numel() else None, eps, self._k + off,
                                        self._v + off, *self._tail, out.data_ptr(), out_dtype == torch.bfloat16)
        if rc:
            raise MemoryError("native attention: out of memory") if rc == -1 else ValueError("native attention: too many query heads per kv head")
        return out


def qkv_attend(qkv: Tensor, cos: Tensor, ssin: Tensor, q_norm: Tensor, k_norm: Tensor, eps: float,
               k: Tensor, v: Tensor, layer: int, where: "ForwardSlots", visible: Tensor, n_heads: int,
               scale: float, out_dtype: torch.dtype) -> Tensor:
    """One layer's attention from its fused projection (see `Attend`; a forward builds that once)."""
    return Attend(cos, ssin, k, v, where, visible, n_heads, scale)(qkv, q_norm, k_norm, eps, layer, out_dtype)


def add_rms_norm(x: Tensor, o: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + o, RMSNorm(x + o) * w) for the residual stream x [N, D] and a layer's output o [N, D] (empty: nothing
    added, x itself returned), both bfloat16 or float32, w [D] float32; the sum rounded to x's dtype first,
    as torch's add does. One call instead of the 4-5 ATen calls of the torch form (F.rms_norm is composite)."""
    N, D = x.shape
    if (x.dtype not in (torch.bfloat16, torch.float32) or not x.is_contiguous() or w.dtype != torch.float32
            or not w.is_contiguous() or w.shape != (D,)
            or (o.numel() and (o.shape != x.shape or o.dtype != x.dtype or not o.is_contiguous()))):
        raise ValueError("native norm: unsupported layout")
    xo = torch.empty_like(x) if o.numel() else x
    h = torch.empty_like(x)
    rc = _LIB[0].specdec_add_rms_norm(x.data_ptr(), o.data_ptr() if o.numel() else None, x.dtype == torch.bfloat16,
                                      N, D, w.data_ptr(), eps, xo.data_ptr(), h.data_ptr())
    if rc:
        raise MemoryError("native norm: out of memory")
    return xo, h


def describe(device: torch.device) -> str:
    """What decoding attends through on `device`, for `specdec info` and /health."""
    if available(device):
        return "native kernel (attend.c)"
    return "torch ops" + (f" ({_TRIED[0]})" if _TRIED and _TRIED[0] else "")


@dataclass(frozen=True)
class Q8Head:
    """An 8-bit LM head as the GGUF stores it (Q8_0: int8 codes, a scale per 32 inputs) through the native
    kernel: half the bytes of a bfloat16 head, every output the same operations whatever the row count
    or thread count (rows keep their bits by construction; `kernels.checked` confirms it anyway).
    quantized: the inputs are quantized to Q8_0 as well and each block is an integer dot product, as
    llama.cpp computes a Q8_0 head (exact integer sums: cheap, the same bits on every instruction set)."""
    q: Tensor             # [N, K] int8
    d: Tensor             # [N, K / 32] float32
    check: "RowCheck"
    quantized: bool = False
    isa: int = 2          # the quantized form's instructions at most: 0 plain C, 1 AVX2, 2 AVX-512 VNNI (same bits)

    dtype = torch.bfloat16  # of its inputs (float32 outputs)
    pair = False

    def __call__(self, x: Tensor) -> Tensor:
        """x [M, K] bfloat16 -> [M, N] float32"""
        M, K = x.shape
        if x.dtype != torch.bfloat16 or K != self.q.shape[1]:
            raise ValueError(f"Q8 head: expected bfloat16 [M, {self.q.shape[1]}], got {x.dtype} {list(x.shape)}")
        x = x.contiguous()
        out = torch.empty(M, self.q.shape[0], dtype=torch.float32)
        args = (x.data_ptr(), 1, M, K, self.q.data_ptr(), self.d.data_ptr(), self.q.shape[0], out.data_ptr(),
                torch.get_num_threads())
        rc = _LIB[0].specdec_q8_0_q8_matmul(*args, self.isa) if self.quantized else _LIB[0].specdec_q8_0_matmul(*args)
        if rc:
            raise MemoryError("Q8 head: out of memory")
        return out

    @staticmethod
    def of(q: Tensor, d: Tensor, quantized: bool = False) -> "Q8Head":
        """The head of codes q [N, K] int8 and scales d [N, K / 32] float32, its rows checked on this machine."""
        from .kernels import RowCheck, checked

        isa = q8x8_isa()
        head = Q8Head(q, d, RowCheck(True, True), quantized, isa)
        name = "native-q8x8" if quantized else "native-q8"
        return Q8Head(q, d, checked((name, *q.shape), head, q.shape[1], torch.bfloat16), quantized, isa)


def q8x8_isa(limit: int = 2) -> int:
    """The instructions the quantized 8-bit head runs here (0 plain C, 1 AVX2, 2 AVX-512 VNNI), at most `limit`
    and at most AVX2 under SPECDEC_ISA=avx2. Every level gives the same bits (exact integer block sums)."""
    from ..machine import probe

    return _LIB[0].specdec_q8x8_isa(min(limit, 1) if probe().isa_limit == "avx2" else limit)


def q8_0_codes(data, shape: tuple[int, int]) -> dict[str, Tensor]:
    """Q8_0 bytes of a [N, K] weight (N rows of K / 32 blocks: fp16 d, 32 int8 codes) -> {"q": [N, K] int8,
    "d": [N, K / 32] float32}: what `Q8Head` computes with."""
    import numpy as np

    N, K = shape
    b = np.ascontiguousarray(data).reshape(N, K // 32, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 2:].copy().view(np.int8).reshape(N, K)
    return {"q": torch.from_numpy(q), "d": torch.from_numpy(d)}
