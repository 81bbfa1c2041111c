"""Linear-layer kernels whose rows do not depend on how many rows share a call, checked on this machine.

Verifying K drafts must give bit for bit the logits that K+1 one-token steps would, so a row's
result may not depend on the row count M of the GEMM it is part of. CPU libraries pick kernels
by M, shape and instruction set, so this is measured, never assumed: every weight packed here
is checked on the spot (`check_rows`) with the kernel that will run it.

oneDNN prepacked for a few rows (PACK_ROWS) gives rows that are invariant for every M >= 2 on the
CPUs measured. A lone row (M = 1) takes another path whose bits differ for some shapes always
(float32 [576 x 1536] on AVX-512) and for others only for some inputs (bfloat16 [576 x 1536]:
13 of 200 random inputs on an AVX-512-BF16 EPYC), so no check can prove a lone row safe: it is
always computed as a pair of copies of itself. Packed for PACK_ROWS rows, two rows cost what
one does (prepacking for 1 row, as torch does by default, made the pair cost ~2x).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

PACK_ROWS = 8             # oneDNN's row hint when prepacking: 1 makes a lone row take a gemv path
CHECK_COUNTS = (2, 3, 5, 8, 17, 33)  # row counts compared against a forward of CHECK_ROWS rows
CHECK_ROWS = 48


@dataclass(frozen=True)
class RowCheck:
    """Whether a kernel's rows kept their bits whatever the row count of the call, on the inputs tried."""
    many_rows: bool       # for M >= 2 rows, each row's bits are those it gets among CHECK_ROWS rows
    lone_row: bool        # a lone row (M = 1) got those bits too

    @property
    def verdict(self) -> str:
        if not self.many_rows:
            return "NOT row-invariant"
        return "row-invariant" + ("" if self.lone_row else " for 2+ rows (a lone row differs)")


def check_inputs(n_in: int, dtype: torch.dtype) -> Tensor:
    """[CHECK_ROWS, n_in] fixed random rows at scales from 0.1 to ~6 (rounding hides some differences)."""
    g = torch.Generator().manual_seed(0)
    scale = 0.1 + torch.arange(CHECK_ROWS, dtype=torch.float32)[:, None] % 7
    return (torch.randn(CHECK_ROWS, n_in, generator=g) * scale).to(dtype)


def check_rows(fn: Callable[[Tensor], Tensor], x: Tensor) -> RowCheck:
    """Bit-for-bit check of fn ([M, in] -> [M, out]) on x [CHECK_ROWS, in]: the rows of fn(x[j:j+M])
    against the same rows of fn(x), for M in CHECK_COUNTS and offsets 0, 1 and 7; every row alone."""
    ref = fn(x)
    many = all(torch.equal(fn(x[j:j + m]), ref[j:j + m]) for m in CHECK_COUNTS for j in (0, 1, 7) if j + m <= len(x))
    lone = all(torch.equal(fn(x[j:j + 1]), ref[j:j + 1]) for j in range(len(x)))
    return RowCheck(many, lone)


@dataclass(frozen=True)
class PackedLinear:
    """A oneDNN-prepacked linear weight and what the check found about this machine's kernel for it."""
    weight: Tensor        # opaque packed copy of [out, in]
    dtype: torch.dtype    # of its inputs and outputs
    check: RowCheck

    pair = True           # a lone row is computed as two copies of it (see the module docstring)

    def __call__(self, x: Tensor) -> Tensor:
        """x [M, in] -> [M, out]"""
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")


def packed_linear_available(device: torch.device) -> bool:
    """Whether oneDNN prepacked linears run here (CPU builds of torch with mkldnn)."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_CHECKED: dict[tuple, RowCheck] = {}   # (kind, out, in, dtype, ...) -> result: kernels are chosen by shape


def checked(key: tuple, kernel: Callable[[Tensor], Tensor], n_in: int, dtype: torch.dtype) -> RowCheck:
    """`check_rows` of `kernel`, run once per process for each `key` (a kernel family and its shape)."""
    if key not in _CHECKED:
        _CHECKED[key] = check_rows(kernel, check_inputs(n_in, dtype))
    return _CHECKED[key]


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

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class Kernel(Protocol):
    """A linear layer's kernel: x [M, in] in `dtype` -> [M, out]; `pair`: compute a lone row as two."""
    dtype: torch.dtype
    check: RowCheck
    pair: bool

    def __call__(self, x: Tensor) -> Tensor: ...


def linear(x: Tensor, w: Tensor, packed: dict[str, Kernel], name: str) -> Tensor:
    """x [..., in] @ w.T through the kernel `name` if there is one (inputs cast to its dtype, the result
    back to x's), else F.linear.

    A lone row goes as a pair where the kernel asks for it (F.linear always: CPU BLAS takes a gemv
    path for one row), so decoding one token and verifying drafts agree bit for bit.
    """
    p = packed.get(name)
    if x.numel() == x.shape[-1] and (p is None or p.pair):                  # one row, any leading shape
        return linear(x.reshape(1, -1).expand(2, -1), w, packed, name)[0].view(*x.shape[:-1], -1)
    if p is None:
        return F.linear(x, w)
    return p(x.reshape(-1, x.shape[-1]).to(p.dtype)).to(x.dtype).view(*x.shape[:-1], -1)
