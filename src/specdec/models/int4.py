"""The GGUF's own 4-bit weights, computed by torch's CPU int4 kernel (the `q4` compute mode).

Decoding on a few CPU cores is bound by the bytes of weights read per token: 4-bit blocks read
a quarter of bfloat16's. torch's `_weight_int4pack_mm_for_cpu` multiplies bfloat16 activations
by group-wise 4-bit weights, w = (q - 8) * scale + zero per group of 32 along the input
dimension, and gives every row the same bits whatever the row count (it runs each row through
the same k-order accumulation; `kernels.check_rows` confirms it on this machine at load time),
so it needs no pair trick. GGUF block formats map onto it exactly up to the scales' rounding
to bfloat16:

- Q4_0 (32 weights, fp16 d): w = d (q - 8), so scale = d, zero = 0;
- Q4_1 (32 weights, fp16 d and m): w = d * q + m, so scale = d, zero = m + 8 d;
- Q4_K (256-weight super-blocks, fp16 d and dmin, 6-bit sub-scales sc_j and mins m_j per 32):
  w = d sc_j q - dmin m_j, so scale = d sc_j, zero = 8 d sc_j - dmin m_j.
Fused linears stored wholly in formats of signed codes and a scale per 32 weights (Q8_0, Q5_0, and Q4_0
where a part is not 4-bit) or per 16 (Q6_K: d sc_j) are exactly 8-bit codes q and those scales, w = d q
(`Blocks8`), which the native 8-bit kernels compute (`native.Q8Rows`). Tensors in other formats keep a
dequantized kernel (see `Transformer.pack`).

An 8-bit Q8_0 LM head (32 int8 codes q and an fp16 d per block: w = d q) is exactly two 4-bit
halves, q = 16 hi + lo with hi in [-8, 7] and lo in [0, 16): one int4 call over K doubled,
[x | x] against [hi | lo], hi with scale 16 d and zero 0, lo with scale d and zero 8 d. It reads
half the bytes of a bfloat16 head; whether it is faster than the dense head depends on the CPU
and the row count, so `Transformer.pack` measures both once per machine (`kernels.fastest`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .kernels import RowCheck, checked

GROUP = 32
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q5_0", "Q4_0", "Q6_K")   # w = d q: signed codes, a scale per 32 (Q6_K: per 16) inputs
HEAD_TYPES = ("Q8_0",)    # LM head formats computed as 4-bit halves
HEAD = (-1, "lm_head")    # the LM head's key among the (layer, linear name) keys of 4-bit kernels
NATIVE_HEAD = (-1, "native-q8")  # an 8-bit head through the native kernel (`native.Q8Head`), another candidate
NATIVE_HEAD_Q8X8 = (-1, "native-q8x8")  # the same with 8-bit activations (integer dot products), another
NATIVE_HEAD_Q8R = (-1, "native-q8r")    # that arithmetic in 16-row groups (`native.Q8Rows`), another


@dataclass(frozen=True)
class Blocks4:
    """A [N, K] weight as 4-bit codes with a scale and zero per group of GROUP along K (float32)."""
    q: np.ndarray         # [N, K] uint8 in [0, 16)
    scale: np.ndarray     # [N, K // GROUP]
    zero: np.ndarray      # [N, K // GROUP]  w = (q - 8) * scale + zero

    def rows(self, idx: np.ndarray) -> "Blocks4":
        return Blocks4(self.q[idx], self.scale[idx], self.zero[idx])

    @staticmethod
    def cat(parts: list["Blocks4"]) -> "Blocks4":
        return Blocks4(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("q", "scale", "zero")))

    def dequantize(self) -> np.ndarray:
        """[N, K] float32 weights (what the kernel computes with, before bfloat16 rounding of the scales)."""
        N, K = self.q.shape
        q = self.q.reshape(N, K // GROUP, GROUP).astype(np.float32) - 8
        return (q * self.scale[..., None] + self.zero[..., None]).reshape(N, K)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[n, ..., width/2] bytes holding `width` 4-bit codes (low nibbles first, then high) -> [n, ..., width]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def blocks_q4_0(data: np.ndarray, shape: tuple[int, int]) -> Blocks4:
    """Q4_0 rows (N rows of K // 32 blocks: fp16 d, 16 bytes of codes) -> Blocks4."""
    N, K = shape
    b = np.ascontiguousarray(data).reshape(N, K // 32, 18)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    return Blocks4(_nibbles(b[..., 2:], 32).reshape(N, K), d, np.zeros_like(d))


def blocks_q4_1(data: np.ndarray, shape: tuple[int, int]) -> Blocks4:
    """Q4_1 rows (N rows of K // 32 blocks: fp16 d, fp16 m, 16 bytes of codes) -> Blocks4."""
    N, K = shape
    b = np.ascontiguousarray(data).reshape(N, K // 32, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = _nibbles(b[..., 4:], 32).reshape(N, K)
    return Blocks4(q, d, m + 8 * d)


def blocks_q4_k(data: np.ndarray, shape: tuple[int, int]) -> Blocks4:
    """Q4_K rows (super-blocks of 256: fp16 d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of codes)."""
    from gguf.quants import Q4_K

    N, K = shape
    nb = K // 256
    b = np.ascontiguousarray(data).reshape(N * nb, 144)
    d = b[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32)
    sc, mn = Q4_K.get_scale_min(b[:, 4:16].copy())                          # [N*nb, 8] each
    scale = d[:, None] * sc.astype(np.float32)
    zero = 8 * scale - dmin[:, None] * mn.astype(np.float32)
    q = _nibbles(b[:, 16:].reshape(N * nb, 4, 32), 64)                      # 4 chunks of 64: sub-blocks 2i, 2i+1
    return Blocks4(q.reshape(N, K), scale.reshape(N, nb * 8), zero.reshape(N, nb * 8))


def blocks_q8_0_halves(data: np.ndarray, shape: tuple[int, int]) -> Blocks4:
    """Q8_0 rows (N rows of K // 32 blocks: fp16 d, 32 int8 codes) -> the [N, 2K] Blocks4 of its two
    4-bit halves [hi | lo]: d q = 16 d hi + d lo, q = 16 hi + lo, hi in [-8, 7], lo in [0, 16)."""
    N, K = shape
    b = np.ascontiguousarray(data).reshape(N, K // 32, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)     # [N, K / 32]
    q = b[..., 2:].copy().view(np.int8)                                     # [N, K / 32, 32]
    hi, lo = q >> 4, q & 15                                                 # arithmetic shift: floor(q / 16)
    codes = np.concatenate([(hi + 8).reshape(N, K), lo.reshape(N, K)], 1).astype(np.uint8)
    return Blocks4(codes, np.concatenate([16 * d, d], 1), np.concatenate([np.zeros_like(d), 8 * d], 1))


def read_head(tensor) -> Blocks4:
    """A GGUF LM head stored as Q8_0 -> the Blocks4 of its two 4-bit halves, [N, 2K]."""
    shape = (int(tensor.shape[1]), int(tensor.shape[0]))
    if tensor.tensor_type.name != "Q8_0":
        raise ValueError(f"not an LM head format computed as 4-bit halves: {tensor.tensor_type.name}")
    return blocks_q8_0_halves(tensor.data, shape)


def read_blocks(tensor) -> Blocks4:
    """A GGUF tensor stored as Q4_1 or Q4_K -> Blocks4 (rows = the weight's output dimension)."""
    shape = (int(tensor.shape[1]), int(tensor.shape[0]))                   # GGUF lists dims innermost first
    kind = tensor.tensor_type.name
    if kind == "Q4_0":
        return blocks_q4_0(tensor.data, shape)
    if kind == "Q4_1":
        return blocks_q4_1(tensor.data, shape)
    if kind == "Q4_K":
        return blocks_q4_k(tensor.data, shape)
    raise ValueError(f"not a 4-bit block format: {kind}")


@dataclass(frozen=True)
class Blocks8:
    """A [N, K] weight as signed 8-bit codes with a scale per `sub` (32 or 16) inputs along K: w = q d."""
    q: np.ndarray         # [N, K] int8
    d: np.ndarray         # [N, K // sub] float32

    @property
    def sub(self) -> int:
        return self.q.shape[1] // self.d.shape[1]

    def rows(self, idx: np.ndarray) -> "Blocks8":
        return Blocks8(self.q[idx], self.d[idx])

    @staticmethod
    def cat(parts: list["Blocks8"]) -> "Blocks8":
        """Rows of all parts; if any has a scale per 16 inputs, the others' scales are repeated to match."""
        sub = min(p.sub for p in parts)
        return Blocks8(np.concatenate([p.q for p in parts]),
                       np.concatenate([np.repeat(p.d, p.sub // sub, axis=1) for p in parts]))

    def dequantize(self) -> np.ndarray:
        """[N, K] float32 weights, exactly the GGUF's dequantization."""
        N, K = self.q.shape
        return (self.d[..., None] * self.q.reshape(N, K // self.sub, self.sub).astype(np.float32)).reshape(N, K)


def _q6_k_scales(blocks: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks [n, 210] (128 bytes of low bits, 64 of high, 16 int8 scales, fp16 d) -> [n, 16] float32
    scales d sc_j, one per 16 weights, as gguf computes them."""
    return blocks[:, 208:210].copy().view(np.float16).astype(np.float32) * blocks[:, 192:208].view(np.int8).astype(np.float32)


def read_blocks8(tensor) -> Blocks8:
    """A GGUF tensor stored as Q8_0, Q5_0, Q4_0 (an fp16 scale d per 32 weights, its first 2 bytes) or Q6_K (a
    scale d sc_j per 16) -> Blocks8. gguf dequantizes each weight as the float32 scale times its integer code, so
    the codes are those products divided by the scale (rounded: Q6_K's products may round in their last bit)."""
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind not in INT8_TYPES:
        raise ValueError(f"not a format of 8-bit codes and one scale per block: {kind}")
    N, K = int(tensor.shape[1]), int(tensor.shape[0])
    blocks = np.ascontiguousarray(tensor.data).reshape(N * (K // 256 if kind == "Q6_K" else K // GROUP), -1)
    if kind == "Q6_K":
        d = _q6_k_scales(blocks).reshape(N, K // 16)
    else:
        d = blocks[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float32).reshape(N, K // GROUP)
    sub = K // d.shape[1]
    w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(N, K // sub, sub)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[..., None] != 0, np.rint(w / d[..., None]), 0)
    return Blocks8(q.astype(np.int8).reshape(N, K), d)


@dataclass(frozen=True)
class Int4Linear:
    """A linear layer [N, K] in torch's packed int4 layout, bfloat16 scales and zeros; with copies = 2, a
    layer [N, K / 2] whose weight is the sum of the two halves of K (an 8-bit head: `blocks_q8_0_halves`)."""
    packed: Tensor        # [N, K / 2] uint8
    scale_zero: Tensor    # [K / GROUP, N, 2] bfloat16
    check: RowCheck
    copies: int = 1       # the input enters this many times along K: x [M, K / copies]

    dtype = torch.bfloat16  # of its inputs and outputs
    pair = False          # rows are bit-identical for any row count, a lone one included (checked)
    fuses_top = False

    @property
    def label(self) -> str:
        return "torch int4" if self.copies == 1 else "torch int4 (8-bit as 4-bit halves)"

    def __call__(self, x: Tensor) -> Tensor:
        """x [M, K / copies] bfloat16 -> [M, N] bfloat16"""
        if self.copies > 1:
            x = x.repeat(1, self.copies)                                    # [M, K]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zero)

    @staticmethod
    def of(blocks: Blocks4, copies: int = 1) -> "Int4Linear":
        q = torch.from_numpy(blocks.q.astype(np.int32))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.stack([torch.from_numpy(blocks.scale).t(), torch.from_numpy(blocks.zero).t()], -1)
        return Int4Linear.packed_as(packed, sz.to(torch.bfloat16).contiguous(), copies)

    @staticmethod
    def packed_as(packed: Tensor, scale_zero: Tensor, copies: int = 1) -> "Int4Linear":
        """The kernel of weights already in torch's int4 layout, its rows checked on this machine."""
        unchecked = Int4Linear(packed, scale_zero, RowCheck(True, True), copies)
        n_out, n_in = scale_zero.shape[1], scale_zero.shape[0] * GROUP // copies
        key = ("int4", n_out, n_in) if copies == 1 else ("int4", n_out, n_in, "copies", copies)
        return Int4Linear(packed, scale_zero, checked(key, unchecked, n_in, torch.bfloat16), copies)
