"""The native kernels (`attend.c`): built once per machine with the system C compiler, called through ctypes.

A decoding or verification forward scores a handful of tokens per layer, so its cost is per-call
overhead as much as arithmetic: as torch ops, the row-invariant block attention (`attention.attention`)
costs 30-40 ATen calls per layer, 100-270 us on a one-thread AMD EPYC for 1-3 key blocks, and the
composite F.rms_norm about 10 us per call. The C kernels take one call each: `Attend` (q/k norms,
rope, cache writes and attention, each query over its own keys in slot order, so its bits depend on
its keys alone, trees included; its shared arguments checked once per forward), `add_rms_norm`, and
`Q8Head`, an 8-bit LM head as the GGUF stores it (float inputs, or inputs quantized to 8 bits as well:
exact integer block sums), and the row kernels `Q4Linear` (4-bit layers, 8-bit activations) and `Q8Rows`
(8-bit codes with a scale per 32 or 16 inputs); `LayerLoop` runs a whole q4 layer stack in C++ (`layers.cpp`).

Built with `cc -O3 -march=native -mno-avx512f` into $SPECDEC_CACHE/native, keyed by the source, the CPU,
the compiler and its flags; where no compiler is found, the build fails or $SPECDEC_NATIVE=0, `available()` is False
and the forward keeps the torch form (a log line says why).

`LayerLoop` (layers.cpp, C++ against the running torch's headers, built once in 5-15 s) runs a q4 model's layers
in one call per forward: the same kernels in the same order as `decoder.Block` (torch's int4 kernel through
`at::cpu`, the C kernels above, torch's activations), so the same bits, without ~60 us of Python per layer.
$SPECDEC_LOOP=0 or no C++ compiler: the layers run from Python.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from ..errors import SpecdecError

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


def _compile(cmd: list[str], timeout: float, tail: bool = False) -> str:
    """Run a compiler command; "" or the compiler's complaint (its last or first 300 characters)."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode == 0:
        return ""
    err = r.stderr.strip()
    return f"{cmd[0]} failed: {err[-300:] if tail else err[:300]}"


def built(path: Path, build: Callable[[Path], str], what: str) -> str:
    """Make sure the library at `path` is whole: reuse it when the digest written beside it at its build
    matches its bytes; else (none yet, damaged, or from a build that did not finish) build it again with
    `build(out)` ("" or why it failed) into a temporary folder and rename it into place. Returns "" or why
    there is no library."""
    from .registry import exclusive

    digest = path.with_name(path.name + ".sha256")
    if _whole(path, digest):
        return ""
    try:
        with exclusive(path.with_name(f".{path.name}.lock"), f"waiting for another process building {what} ..."):
            if _whole(path, digest):                   # built by the process that held the lock
                return ""
            return _build_into(path, digest, build, what)
    except SpecdecError as e:                          # no lock where the cache cannot be written: no library
        return str(e)


def _whole(path: Path, digest: Path) -> bool:
    """Whether the library at `path` has the digest written beside it at its build."""
    from .registry import file_digest

    try:
        return path.is_file() and digest.is_file() and digest.read_text().strip() == file_digest(path)
    except (OSError, UnicodeDecodeError):
        return False                                   # unreadable: built again


def _build_into(path: Path, digest: Path, build: Callable[[Path], str], what: str) -> str:
    """Build the library with `build(out)` into a temporary folder and rename it into place with its digest."""
    from .registry import file_digest, sweep_stale, write_atomic

    log = logging.getLogger("specdec")
    if path.exists() and digest.exists():
        log.warning("%s does not match the digest of its build (damaged?): building it again", path)
    log.info("building %s ...", what)
    for p in (path, digest):                           # a folder (or anything) where a file belongs
        if p.is_dir() and not p.is_symlink():
            import shutil

            shutil.rmtree(p, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path.parent, ("tmp", ".tmp-"))
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        why = build(out)
        if why:
            return why
        sha = file_digest(out)
        os.replace(out, path)                          # atomic: concurrent builds never see half a file
        write_atomic(digest, sha.encode())
    return ""


def _build() -> str:
    """Load (building if needed) the kernel; returns "" or why it is not available."""
    from ..machine import env_switch

    if not env_switch("SPECDEC_NATIVE"):
        return "disabled by SPECDEC_NATIVE=0"
    cc = _compiler()
    if not cc:
        return "no C compiler found (cc, gcc or clang; or set $CC)"
    try:
        path = _library_path(cc)
        why = built(path, lambda out: _compile([cc, *_flags(), "-o", str(out), str(SOURCE), "-lm"], 120),
                    "the native kernels for this CPU (once; a few seconds)")
        if why:
            return why
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not build or load it: {e}"
    fn = lib.specdec_qkv_attend
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, ctypes.c_int, _I64, _PTR, _PTR, _PTR, _PTR, ctypes.c_float, _PTR, _PTR,
                   _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _PTR, ctypes.c_int,
                   _PTR, _I64]
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
    lib.specdec_rows_linear.restype = ctypes.c_int
    lib.specdec_rows_linear.argtypes = [ctypes.c_int, _PTR, ctypes.c_int, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR,
                                        ctypes.c_int, ctypes.c_int]
    lib.specdec_q8x8_isa.argtypes = [ctypes.c_int]
    _LIB.append(lib)
    return ""


LOOP_SOURCE = Path(__file__).with_name("layers.cpp")
_LOOP: list[ctypes.CDLL] = []      # the loaded layer loop, once built
_LOOP_TRIED: list[str] = []        # why it is not available ("" = it is)


def _cxx() -> str:
    return os.environ.get("CXX", "") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++") or ""


def _loop_flags() -> list[str]:
    """Flags of the layer loop: built against the running torch's headers and libraries, with its C++ ABI."""
    base = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-O2", "-std=c++20", "-fopenmp", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{base / 'include'}",
            f"-L{base / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{base / 'lib'}"]


def _build_loop() -> str:
    """Load (building if needed, 5-15 s once) the layer loop; returns "" or why it is not available."""
    from ..machine import env_switch

    if not env_switch("SPECDEC_LOOP"):
        return "disabled by SPECDEC_LOOP=0"
    if not available(torch.device("cpu")):
        return "no native kernels"
    cxx = _cxx()
    if not cxx:
        return "no C++ compiler found (c++, g++ or clang++; or set $CXX)"
    from .registry import cache_dir

    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
        stamp = "|".join([LOOP_SOURCE.read_text(), torch.__version__, cxx, version, *_loop_flags()])
        path = cache_dir() / "native" / f"layers-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.so"
        why = built(path, lambda out: _compile([cxx, str(LOOP_SOURCE), "-o", str(out), *_loop_flags()], 300, tail=True),
                    "the native layer loop for this torch (once; 5-15 s)")
        if why:
            return why
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not build or load it: {e}"
    lib.specdec_loop_new.restype = _PTR
    lib.specdec_loop_new.argtypes = [_I64, _I64, ctypes.c_double, ctypes.c_int, ctypes.c_int, _PTR, _PTR, _PTR, _PTR]
    lib.specdec_loop_free.restype = None
    lib.specdec_loop_free.argtypes = [_PTR]
    lib.specdec_loop_linear.restype = ctypes.c_int
    lib.specdec_loop_linear.argtypes = [_PTR, _I64, ctypes.c_int, _PTR, _I64, _I64, _PTR, _I64]
    lib.specdec_q4_threads.restype = ctypes.c_int
    lib.specdec_q4_threads.argtypes = [_PTR, _PTR, _PTR, ctypes.c_int, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR,
                                       ctypes.c_int, ctypes.c_int, ctypes.c_int, _PTR, _PTR]
    lib.specdec_loop_rows.restype = ctypes.c_int
    lib.specdec_loop_rows.argtypes = [_PTR, _I64, ctypes.c_int, _PTR, ctypes.c_int, _PTR, _PTR, _PTR, _I64, _I64,
                                      ctypes.c_int, _I64]
    lib.specdec_loop_onednn.restype = ctypes.c_int
    lib.specdec_loop_onednn.argtypes = [_PTR, _I64, ctypes.c_int, _PTR, ctypes.c_int, ctypes.c_int, _I64]
    lib.specdec_loop_norms.restype = ctypes.c_int
    lib.specdec_loop_norms.argtypes = [_PTR, _I64, *[_PTR] * 6, ctypes.c_int]
    lib.specdec_loop_run.restype = ctypes.c_int
    lib.specdec_loop_run.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR]
    _LOOP.append(lib)
    return ""


def loop_available() -> bool:
    """Whether the layer loop (`LayerLoop`) is built and loaded here."""
    if not _LOOP_TRIED:
        _LOOP_TRIED.append(_build_loop())
        if _LOOP_TRIED[0]:
            logging.getLogger("specdec").info("native layer loop unavailable (%s): layers run from Python", _LOOP_TRIED[0])
    return not _LOOP_TRIED[0]


class _Plan(ctypes.Structure):
    """`specdec_plan` of layers.cpp: one forward's attention arguments shared by every layer."""
    _fields_ = [("cos", _PTR), ("ssin", _PTR), ("k", _PTR), ("v", _PTR), ("layer_bytes", _I64), ("row_off", _PTR),
                ("at", _PTR), ("head_stride", _I64), ("mask", _PTR), ("S", _I64), ("B", _I64), ("T", _I64),
                ("nh", _I64), ("nkv", _I64), ("hd", _I64), ("scale", ctypes.c_float), ("pos", _PTR),
                ("pos_limit", _I64)]


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
    """One forward's native attention: what every layer shares (the rope rows cos, ssin [B, 1, T, hd] (see
    `decoder.rope`), the cache k, v [L, R, nkv, Smax, hd], `where`'s scratch slots, the mask `visible`
    [B, T, S]) checked once per forward; each call runs one layer (`qkv_attend`). `Attend.causal` is the same
    for a causal chain, from the whole rope tables and the tokens' positions, with no mask to build."""

    def __init__(self, cos: Tensor, ssin: Tensor, k: Tensor, v: Tensor, where: "ForwardSlots", visible: Tensor,
                 n_heads: int, scale: float) -> None:
        B, T, S = visible.shape
        hd = k.shape[-1]
        if (not (cos.is_contiguous() and ssin.is_contiguous() and visible.is_contiguous())
                or cos.dtype != torch.float32 or ssin.dtype != torch.float32 or cos.shape != ssin.shape
                or cos.shape[-1] != hd or cos.numel() != B * T * hd or visible.dtype != torch.bool):
            raise ValueError("native attention: unsupported layout")
        self._setup(B, T, S, k, v, where, n_heads, scale, (cos.data_ptr(), ssin.data_ptr()), visible.data_ptr(),
                    (None, 0), (cos, ssin, visible))

    @classmethod
    def causal(cls, cos: Tensor, ssin: Tensor, positions: Tensor, k: Tensor, v: Tensor, where: "ForwardSlots",
               n_heads: int, scale: float) -> "Attend":
        """A causal chain: the tables cos, ssin [P, hd] float32 whole, positions [B, T] int64 the tokens' rows in
        them (one outside fails the call: a ValueError); token t of row b sees its row's slots up to at + t."""
        B, T = positions.shape
        if (not (cos.is_contiguous() and ssin.is_contiguous() and positions.is_contiguous())
                or cos.dtype != torch.float32 or ssin.dtype != torch.float32 or cos.shape != ssin.shape
                or cos.dim() != 2 or cos.shape[1] != k.shape[-1] or positions.dtype != torch.int64):
            raise ValueError("native attention: unsupported layout")
        attend = cls.__new__(cls)
        attend._setup(B, T, where.kv_len, k, v, where, n_heads, scale, (cos.data_ptr(), ssin.data_ptr()), None,
                      (positions.data_ptr(), cos.shape[0]), (cos, ssin, positions))
        return attend

    def _setup(self, B: int, T: int, S: int, k: Tensor, v: Tensor, where: "ForwardSlots", n_heads: int, scale: float,
               head: tuple[int, int], mask: int | None, pos: tuple[int | None, int], keep: tuple) -> None:
        L, R, nkv, Smax, hd = k.shape
        if where.t != T or where.rows.numel() != B or where.kv_len != S:
            raise ValueError("native attention: the tokens, slots and mask disagree")
        if not (k.is_contiguous() and v.is_contiguous()) or k.dtype != torch.float32 or hd % 8:
            raise ValueError("native attention: unsupported layout")
        self._keep = (k, v, where, *keep)                                    # the pointers below stay valid
        self.rows, self.width, self.layers = B * T, (n_heads + 2 * nkv) * hd, L
        self.out_width = n_heads * hd
        self._layer_bytes = R * nkv * Smax * hd * 4
        self._k, self._v = k.data_ptr(), v.data_ptr()
        self._head, self._pos = head, pos
        self._tail = (where.row_off.data_ptr(), where.at.data_ptr(), Smax * hd, mask, S, B, T, n_heads, nkv, hd, scale)
        self._plan: list[_Plan] = []                                          # `plan`, once asked for

    def plan(self) -> _Plan:
        """These arguments as the C struct `LayerLoop` takes (made once per forward, whatever calls ask)."""
        if not self._plan:
            self._plan.append(_Plan(*self._head, self._k, self._v, self._layer_bytes, *self._tail, *self._pos))
        return self._plan[0]

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
                                        self._v + off, *self._tail, out.data_ptr(), out_dtype == torch.bfloat16,
                                        *self._pos)
        if rc:
            raise {-1: MemoryError("native attention: out of memory"),
                   -3: ValueError("native attention: a position outside the rope tables")}.get(
                rc, ValueError("native attention: too many query heads per kv head"))
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


def describe_loop(model) -> str:
    """How `model`'s layers run, for `specdec info` and /health."""
    loop = getattr(model, "loop", None)
    if loop is not None:
        return f"native (layers.cpp: one call per forward; prompts too, {loop.max_rows} tokens per forward)"
    if _LOOP_TRIED and _LOOP_TRIED[0]:
        return f"Python ({_LOOP_TRIED[0]})"
    return "Python (the native loop takes models whose every layer is 4-bit)"


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
    fuses_top = False

    @property
    def label(self) -> str:
        return "native 8-bit x 8-bit" if self.quantized else "native 8-bit"

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
        check = checked((name, *q.shape), head, q.shape[1], torch.bfloat16, every_count=False)
        return Q8Head(q, d, check, quantized, isa)


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


NO_NORM = torch.empty(0)   # `LayerLoop._run` without the final norm


class LayerLoop:
    """A decoder's layers run by one native call per forward (layers.cpp): the same kernels as the Python loop
    of `decoder.Block` in the same order, so the same bits, without the Python between them. For the q4 mode:
    4-bit linears (torch's int4 kernel or `Q4Linear`), linears of 8-bit codes (`Q8Rows`), and linears stored in
    other formats through their oneDNN-prepacked weights; `of` says None otherwise."""

    def __init__(self, lib: ctypes.CDLL, handle: int, keep: list, max_rows: int, dtype: torch.dtype) -> None:
        self._lib, self._handle, self._keep = lib, handle, keep
        self.max_rows, self.dtype = max_rows, dtype
        # freed with the loop; not at interpreter exit (the process's memory goes anyway, and a second Ctrl-C
        # landing in a finalizer then printed "Exception ignored" with a traceback)
        weakref.finalize(self, lib.specdec_loop_free, handle).atexit = False

    @staticmethod
    def of(model) -> "LayerLoop | None":
        """The loop of a packed `decoder.Transformer`, or None where it cannot run it (a linear not int4, an 8-bit
        head pair, other activation dtypes, no compiler)."""
        from .int4 import Int4Linear
        from .kernels import PackedLinear

        cfg = model.config
        layers = list(model.layers)
        if model.dtype not in DTYPES or not layers or model.device.type != "cpu":
            return None
        kernels = [[layer.packed.get(n) for n in ("wqkv", "wo", "w13", "w2")] for layer in layers]
        if not any(isinstance(k, (Int4Linear, Q4Linear, Q8Rows)) for ks in kernels for k in ks):
            return None                                       # not the q4 mode: its linears are cheap to call
        if not all((isinstance(k, Int4Linear) and k.copies == 1 or isinstance(k, (Q4Linear, Q8Rows))
                    or isinstance(k, PackedLinear) and k.dtype in DTYPES) and k.check.many_rows
                   for ks in kernels for k in ks):
            return None
        if not loop_available():
            return None
        lib = _LOOP[0]
        handle = lib.specdec_loop_new(len(layers), cfg.dim, cfg.norm_eps, int(cfg.gelu),
                                      int(model.dtype == torch.bfloat16), _entry("specdec_attend_rope"),
                                      _entry("specdec_attend_heads"),
                                      _entry("specdec_add_rms_norm"), _entry("specdec_q8_quantize"))
        if not handle:
            raise MemoryError("native layer loop: out of memory")
        keep: list = []
        loop = LayerLoop(lib, handle, keep, min(k.check.max_rows for ks in kernels for k in ks), model.dtype)
        names = ("attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")
        for i, (layer, ks) in enumerate(zip(layers, kernels)):
            for which, k in enumerate(ks):
                if isinstance(k, Q4Linear):
                    keep += [k.codes, k.scale, k.zero]
                    rc = lib.specdec_loop_rows(handle, i, which, _entry(_ROWS_ENTRY[ROWS_Q4]), k.threads, k.codes.data_ptr(),
                                               k.scale.data_ptr(), k.zero.data_ptr(), *k.shape, k.isa, k.check.max_rows)
                elif isinstance(k, Q8Rows):
                    keep += [k.codes, k.d]
                    rc = lib.specdec_loop_rows(handle, i, which, _entry(_ROWS_ENTRY[k.kind]), k.threads, k.codes.data_ptr(),
                                               k.d.data_ptr(), k.d.data_ptr(), *k.shape, k.isa, k.check.max_rows)
                elif isinstance(k, PackedLinear):
                    keep.append(k.weight)
                    rc = lib.specdec_loop_onednn(handle, i, which, k.weight._cdata, int(k.dtype == torch.bfloat16),
                                                 int(k.pair), k.check.max_rows)
                else:
                    keep += [k.packed, k.scale_zero]
                    n_out, n_in = k.scale_zero.shape[1], k.scale_zero.shape[0] * 32
                    rc = lib.specdec_loop_linear(handle, i, which, k.packed.data_ptr(), n_out, n_in,
                                                 k.scale_zero.data_ptr(), k.check.max_rows)
                if rc:
                    raise RuntimeError("native layer loop: could not take a linear")
            norms = [layer._w32(n).contiguous() if hasattr(layer, n) else None for n in names]
            keep += [w for w in norms if w is not None]
            if lib.specdec_loop_norms(handle, i, *[w.data_ptr() if w is not None else None for w in norms],
                                      int(cfg.is_local(i))):
                raise RuntimeError("native layer loop: could not take the norms")
        return loop

    def __call__(self, x: Tensor, o: Tensor, first: int, last: int, attend: Attend,
                 local: Attend) -> tuple[Tensor, Tensor]:
        """Layers [first, last) on x [N, D] before o [N, D] (empty: nothing to add), attending through the
        forward's plans (`local` for sliding-window layers) -> that last layer's (x, o), as `decoder.Block`."""
        return self._run(x, o, first, last, attend, local, NO_NORM)

    def normed(self, x: Tensor, o: Tensor, first: int, last: int, attend: Attend, local: Attend,
               w: Tensor) -> tuple[Tensor, Tensor]:
        """Layers [first, last) as `__call__`, then the final norm with float32 weight w [D] in the same call
        -> (the residual stream x + o [N, D], its norm [N, D]): `decoder.Transformer.final_norm`'s bits without
        a second trip from Python (the first Python after a forward's weights went through the caches is slow)."""
        if w.dtype != torch.float32 or not w.is_contiguous() or w.shape != x.shape[-1:]:
            raise ValueError("native layer loop: unsupported final norm")
        return self._run(x, o, first, last, attend, local, w)

    def _run(self, x: Tensor, o: Tensor, first: int, last: int, attend: Attend, local: Attend,
             w: Tensor) -> tuple[Tensor, Tensor]:
        if x.dtype != self.dtype or not x.is_contiguous() or (o.numel() and (o.dtype != x.dtype or not o.is_contiguous())):
            raise ValueError("native layer loop: unsupported layout")
        if last > min(attend.layers, local.layers):
            raise ValueError(f"native layer loop: layers [{first}, {last}) but a cache of {attend.layers}")
        x_out, o_out = torch.empty_like(x), torch.empty_like(x)
        g, l = attend.plan(), local.plan()
        rc = self._lib.specdec_loop_run(self._handle, first, last, x.data_ptr(), o.data_ptr() if o.numel() else None,
                                        x.shape[0], ctypes.byref(g), ctypes.byref(l),
                                        w.data_ptr() if w.numel() else None, x_out.data_ptr(), o_out.data_ptr())
        if rc:
            raise {-1: MemoryError("native layer loop: out of memory"),
                   -2: ValueError("native layer loop: too many query heads per kv head"),
                   -4: ValueError("native layer loop: more rows than a linear's checked limit"),
                   -5: ValueError(f"native layer loop: no layers [{first}, {last})"),
                   -6: ValueError("native layer loop: a position outside the rope tables")}.get(
                rc, RuntimeError(f"native layer loop: torch error (code {rc})"))
        return x_out, o_out


Q4_GROUP = 16   # output rows per group of the native 4-bit layout


def q4_fits(shape: tuple[int, int]) -> bool:
    """Whether a [N, K] weight fits the native 4-bit layout (whole groups of 16 rows, blocks of 32 inputs)."""
    return shape[0] % Q4_GROUP == 0 and shape[1] % 32 == 0


def q4_layout(q, scale, zero) -> dict[str, Tensor]:
    """4-bit blocks (codes q [N, K] in [0, 16), scale, zero [N, K / 32]: w = (q - 8) scale + zero, `int4.Blocks4`)
    -> the native layout of `Q4Linear` (see attend.c): {"codes": [N / 16, K / 32, 256] uint8, "scale", "zero":
    [N / 16, K / 32, 16] float32}."""
    import numpy as np

    N, K = q.shape
    if not q4_fits((N, K)):
        raise ValueError(f"native 4-bit layout: [{N}, {K}] is not whole groups of 16 rows and blocks of 32")
    nb = K // 32
    c = np.asarray(q, dtype=np.uint8).reshape(N // Q4_GROUP, Q4_GROUP, nb, 4, 2, 4)   # [g, r, b, part, half, j]
    c = c.transpose(0, 2, 3, 1, 4, 5)                                                  # [g, b, part, r, half, j]
    codes = (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(N // Q4_GROUP, nb, 256)

    def grouped(a):
        a = np.asarray(a, dtype=np.float32).reshape(N // Q4_GROUP, Q4_GROUP, nb).transpose(0, 2, 1)
        return torch.from_numpy(np.ascontiguousarray(a))
    return {"codes": torch.from_numpy(np.ascontiguousarray(codes)), "scale": grouped(scale), "zero": grouped(zero)}


def _entry(name: str) -> int:
    """The address of attend.c's function `name`, for layers.cpp."""
    return ctypes.cast(getattr(_LIB[0], name), _PTR).value


ROWS_Q4, ROWS_Q8, ROWS_Q8H = 0, 1, 2   # attend.c's row kernels: 4-bit codes, 8-bit codes, 8-bit codes with half-block scales
_ROWS_ENTRY = {ROWS_Q4: "specdec_q4_q8_matmul", ROWS_Q8: "specdec_q8r_q8_matmul", ROWS_Q8H: "specdec_q8h_q8_matmul"}


# Threads pay for a native linear from about 750 KB of codes, 1.5M 4-bit weights, by default (measured on an AMD
# EPYC Zen 4, 2 threads: the [3072 x 576] gate/up layer 39 -> 25 us for 1 row, 81 -> 49 us for 5; the [576 x 1536]
# layer was slower on 2 threads than on 1, 51 -> 61 us for 5 rows); a model's layers time both at the first start.
PARALLEL_CODE_BYTES = 750_000


NO_TOP = torch.empty(0, dtype=torch.int64)   # `_rows_linear` without the argmax


def _rows_linear(kind: int, x: Tensor, codes: Tensor, scale: Tensor, zero: Tensor, isa: int, threads: bool,
                 what: str, top: bool = False) -> tuple[Tensor, Tensor]:
    """x [M, K] (bfloat16 or float32, checked by the caller) -> float32 [M, N] through attend.c's row kernel `kind`
    (ROWS_Q4, ROWS_Q8, ROWS_Q8H): with `threads` over torch's threads where the layer loop is built, as it runs
    them, else on one thread (the same bits either way); and with `top` (only where the layer loop is built) each
    row's argmax [M] int64 from the same call (attend.c's specdec_row_top), else an empty [0]."""
    x = x.contiguous()
    M, K, N = x.shape[0], codes.shape[1] * 32, codes.shape[0] * Q4_GROUP
    out = torch.empty(M, N, dtype=torch.float32)
    best = torch.empty(M, dtype=torch.int64) if top else NO_TOP
    args = (x.data_ptr(), x.dtype == torch.bfloat16, M, K, codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), N,
            out.data_ptr(), 0, isa)
    if loop_available():
        rc = _LOOP[0].specdec_q4_threads(_entry("specdec_q8_quantize"), _entry(_ROWS_ENTRY[kind]), *args,
                                         int(threads), _entry("specdec_row_top") if top else 0,
                                         best.data_ptr() if top else 0)
    elif top:
        raise RuntimeError(f"{what}: no fused argmax without the native layer loop")
    else:
        rc = _LIB[0].specdec_rows_linear(kind, *args)
    if rc:
        raise MemoryError(f"{what}: out of memory") if rc == -1 else RuntimeError(f"{what}: error {rc}")
    return out, best


def q8_rows_layout(q: Tensor, d: Tensor) -> dict[str, Tensor]:
    """8-bit codes q [N, K] int8 and scales d [N, K / 32] (`q8_0_codes`, `int4.Blocks8`) or [N, K / 16] (a scale
    per 16 inputs: Q6_K) -> the 16-row layout of `Q8Rows` (see attend.c): {"codes": [N / 16, K / 32, 512] int8,
    "d": [N / 16, K / 32, 16] float32, or [N / 16, K / 32, 32] (the 16 rows' scales of inputs 0-15, then 16-31)}."""
    N, K = q.shape
    if not q4_fits((N, K)):
        raise ValueError(f"8-bit row layout: [{N}, {K}] is not whole groups of 16 rows and blocks of 32")
    nb, halves = K // 32, d.shape[1] // (K // 32)
    if halves not in (1, 2) or d.shape != (N, nb * halves):
        raise ValueError(f"8-bit row layout: scales {list(d.shape)} for [{N}, {K}]: one per 32 or 16 inputs")
    words = q.contiguous()
    if words.storage_offset() % 4:
        words = words.clone()                          # 32-bit words need an aligned start
    # a block's codes move 4 at a time: [N/16, 16, nb, 8] words of 4 codes -> [N/16, nb, 8, 16] -> [N/16, nb, 512] int8
    codes = words.view(torch.int32).reshape(N // Q4_GROUP, Q4_GROUP, nb, 8).permute(0, 2, 3, 1)
    codes = codes.contiguous().view(torch.int8).reshape(N // Q4_GROUP, nb, 512)
    d = d.reshape(N // Q4_GROUP, Q4_GROUP, nb, halves).permute(0, 2, 3, 1).reshape(N // Q4_GROUP, nb, halves * Q4_GROUP)
    return {"codes": codes, "d": d.contiguous()}


@dataclass(frozen=True)
class Q8Rows:
    """A linear of 8-bit codes with a scale per 32 inputs (Q8_0, Q5_0, Q4_0: an LM head, a model's layers, an
    EAGLE-3 head's linears) or per 16 (Q6_K layers: `kind` ROWS_Q8H) in 16-row groups (`q8_rows_layout`) against inputs quantized to 8 bits: exact
    integer block sums and one float sum per output in block order, so the same bits for any row count, thread
    count or instruction set; one block's codes serve up to 8 input rows, and the rows are split over torch's
    threads where the layer loop is built."""
    codes: Tensor         # [N / 16, K / 32, 512] int8
    d: Tensor             # [N / 16, K / 32, 16] float32, or [N / 16, K / 32, 32]: a scale per 16 inputs
    check: "RowCheck"
    isa: int = 2
    dtype: torch.dtype = torch.bfloat16   # of its inputs (bfloat16 or float32: the same values quantized; float32 out)
    threads: bool = True  # its output groups split over torch's threads (else on the calling thread)

    pair = False

    @property
    def label(self) -> str:
        return "native 8-bit x 8-bit (16-row groups)" + ("" if self.kind == ROWS_Q8 else ", scales per 16")

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in)"""
        return self.codes.shape[0] * Q4_GROUP, self.codes.shape[1] * 32

    @property
    def kind(self) -> int:
        """attend.c's kernel: ROWS_Q8 (a scale per 32 inputs), ROWS_Q8H (per 16)"""
        return ROWS_Q8 if self.d.shape[-1] == Q4_GROUP else ROWS_Q8H

    def _check(self, x: Tensor) -> None:
        K = self.shape[1]
        if x.dtype not in DTYPES or x.dim() != 2 or x.shape[1] != K:
            raise ValueError(f"8-bit linear: expected [M, {K}] bfloat16 or float32, got {x.dtype} {list(x.shape)}")

    def __call__(self, x: Tensor) -> Tensor:
        """x [M, K] bfloat16 or float32 -> [M, N] float32"""
        self._check(x)
        return _rows_linear(self.kind, x, self.codes, self.d, self.d, self.isa, self.threads, "8-bit linear")[0]

    @property
    def fuses_top(self) -> bool:
        return loop_available()

    def with_top(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [M, K] -> (this linear's [M, N] float32, each row's argmax [M] int64) from one native call (`fuses_top`)."""
        self._check(x)
        return _rows_linear(self.kind, x, self.codes, self.d, self.d, self.isa, self.threads, "8-bit linear", True)

    @staticmethod
    def of(q: Tensor, d: Tensor) -> "Q8Rows":
        """The linear of codes q [N, K] int8 and scales d [N, K / 32] (an LM head: bfloat16 inputs), its rows
        checked on this machine."""
        return Q8Rows.of_layout(q8_rows_layout(q, d), torch.bfloat16)

    @staticmethod
    def of_layout(layout: dict[str, Tensor], dtype: torch.dtype = torch.float32) -> "Q8Rows":
        """The linear of a `q8_rows_layout`, inputs cast to `dtype` (float32, as `Q4Linear`: a layer's bfloat16
        or float32 activations enter as they are), its rows checked on this machine."""
        from .kernels import RowCheck, checked

        isa = q8x8_isa()
        k = Q8Rows(layout["codes"], layout["d"], RowCheck(True, True), isa, dtype,
                   layout["codes"].numel() >= PARALLEL_CODE_BYTES)
        key = ("native-q8r", *k.shape) if k.kind == ROWS_Q8 else ("native-q8h", *k.shape)
        return replace(k, check=checked(key, k, k.shape[1], torch.bfloat16, every_count=False))


@dataclass(frozen=True)
class Q4Linear:
    """A 4-bit linear layer (`q4_layout`) through the native kernel, inputs quantized to 8 bits per block of 32
    as llama.cpp does for its 4-bit formats: integer block sums, then a fixed float order per output, so every
    row gets the same operations whatever the row count, thread count or instruction set (`kernels.checked`
    confirms it). One block's codes serve several input rows: a verification of K drafts costs far less
    than K + 1 forwards of one row."""
    codes: Tensor         # [N / 16, K / 32, 256] uint8
    scale: Tensor         # [N / 16, K / 32, 16] float32
    zero: Tensor          # [N / 16, K / 32, 16] float32
    check: "RowCheck"
    isa: int = 2          # instructions at most: 0 plain C, 1 AVX2, 2 AVX-512 VNNI (the same bits)
    threads: bool = True  # its output groups split over torch's threads (else on the calling thread)

    dtype = torch.float32  # of its inputs and outputs (the layer loop feeds bfloat16 directly: the same values)
    pair = False
    label = "native 4-bit x 8-bit"

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in)"""
        return self.codes.shape[0] * Q4_GROUP, self.codes.shape[1] * 32

    def _check(self, x: Tensor) -> None:
        K = self.shape[1]
        if x.dtype not in DTYPES or x.dim() != 2 or x.shape[1] != K:
            raise ValueError(f"Q4 linear: expected [M, {K}] float32 or bfloat16, got {x.dtype} {list(x.shape)}")

    def __call__(self, x: Tensor) -> Tensor:
        """x [M, K] float32 (or bfloat16) -> [M, N] float32"""
        self._check(x)
        return _rows_linear(ROWS_Q4, x, self.codes, self.scale, self.zero, self.isa, self.threads, "Q4 linear")[0]

    @property
    def fuses_top(self) -> bool:
        return loop_available()

    def with_top(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [M, K] -> (this linear's [M, N] float32, each row's argmax [M] int64) from one native call (`fuses_top`)."""
        self._check(x)
        return _rows_linear(ROWS_Q4, x, self.codes, self.scale, self.zero, self.isa, self.threads, "Q4 linear", True)

    @staticmethod
    def of(layout: dict[str, Tensor]) -> "Q4Linear":
        """The kernel of a `q4_layout`, its rows checked on this machine."""
        from .kernels import RowCheck, checked

        isa = q8x8_isa()
        k = Q4Linear(layout["codes"], layout["scale"], layout["zero"], RowCheck(True, True), isa,
                     layout["codes"].numel() >= PARALLEL_CODE_BYTES)
        check = checked(("native-q4", *k.shape), k, k.shape[1], torch.float32, every_count=False)
        return replace(k, check=check)
