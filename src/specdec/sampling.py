"""The one sampling transform (logits -> probabilities, shared by draft and target) and the
random numbers every sampled token is drawn with.

Speculative sampling is exact only if the draft's q and the target's p come
from the same transform (temperature, top-k, top-p). Greedy (temperature 0) is
the point mass on the argmax, so one verifier serves both.

Randomness is counter-based: the uniform that decides a sequence's token at position t
is a hash of (seed, t, stream) (`position_uniforms`), not the next number of a generator.
So a sequence's samples depend on its seed alone, not on its batch-mates, on how many
drafts a step proposes, or on which steps the clock made speculative.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import torch
from torch import Tensor

from .errors import SpecdecError


def cut(text: str, limit: int = 40) -> str:
    """`text` cut to `limit` characters (an error message quoting a value stays one short line)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def as_integer(x: object, refusal: str) -> int:
    """`x` as a Python int where it is an integer of any kind (numpy's included, booleans not); else
    SpecdecError(refusal)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise SpecdecError(refusal)
    return int(x)


def as_real(x: object, refusal: str) -> float:
    """`x` as a Python float where it is a real number of any kind that a float holds (booleans not); else
    SpecdecError(refusal)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise SpecdecError(refusal)
    try:
        return float(x)
    except (OverflowError, ValueError):
        raise SpecdecError(refusal) from None


TOP_K_ALL = 1 << 62       # any top_k at least the vocabulary keeps every token; larger ones are held at this


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 means greedy
    top_k: int = 0                    # 0 means off
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        # numbers of any kind (numpy scalars too) are taken as Python's own; booleans and others are refused
        refusal = f"temperature must be a finite number >= 0, got {cut(repr(self.temperature))}"
        temperature = as_real(self.temperature, refusal)
        if not math.isfinite(temperature) or temperature < 0:
            raise SpecdecError(refusal)
        refusal = f"top_k must be an integer >= 0 (0 = off), got {cut(repr(self.top_k))}"
        top_k = as_integer(self.top_k, refusal)
        if top_k < 0:
            raise SpecdecError(refusal)
        refusal = f"top_p must be in [0, 1] (0: the most likely token only), got {cut(repr(self.top_p))}"
        top_p = as_real(self.top_p, refusal)
        if not 0.0 <= top_p <= 1.0:
            raise SpecdecError(refusal)
        refusal = f"seed must be an integer in [-2^63, 2^64), got {cut(repr(self.seed))}"
        seed = as_integer(self.seed, refusal)
        if not -(1 << 63) <= seed < 1 << 64:
            raise SpecdecError(refusal)
        for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MIN_TEMPERATURE = 1e-30   # smaller positive temperatures compute as this one (the same distribution in float32)
MAX_TEMPERATURE = 1e30    # and larger ones as this (uniform over what top-k / top-p keep; float32 ends at 3.4e38)


@dataclass(frozen=True)
class BatchSampling:
    """Per-sequence sampling parameters as tensors, so one transform serves a mixed batch."""
    temperature: Tensor   # [B] float32, 0 = greedy
    top_k: Tensor         # [B] long, 0 = off
    top_p: Tensor         # [B] float32
    greedy: bool = field(init=False)   # every row decodes greedily
    # what to_probs asks of every step, worked out once per batch (each small ATen call costs tens of microseconds
    # right after a forward has streamed the weights through the caches)
    divisor: Tensor = field(init=False)       # [B] float32: the temperature as divided by (1 for greedy rows)
    greedy_rows: Tensor = field(init=False)   # [B] bool
    any_greedy: bool = field(init=False)      # some row decodes greedily
    any_top_k: bool = field(init=False)       # some row has a top-k
    any_nucleus: bool = field(init=False)     # some row has top-p < 1

    def __post_init__(self) -> None:
        greedy = self.temperature <= 0                                          # [B]
        # below MIN_TEMPERATURE the quotient would overflow float32 (inf - inf = NaN in the softmax), above
        # MAX_TEMPERATURE the temperature itself (every logit 0: top-k would keep all); the clamps change no
        # distribution: logits that differ at all are e^(1e23) apart at the one, within 1e-29 of equal at the other
        divisor = torch.where(greedy, torch.ones_like(self.temperature),
                              self.temperature.clamp(min=MIN_TEMPERATURE, max=MAX_TEMPERATURE))
        for name, value in (("greedy", bool(greedy.all())), ("divisor", divisor), ("greedy_rows", greedy),
                            ("any_greedy", bool(greedy.any())), ("any_top_k", bool((self.top_k > 0).any())),
                            ("any_nucleus", bool((self.top_p < 1).any()))):
            object.__setattr__(self, name, value)

    @staticmethod
    def of(params: list[SamplingParams], device: torch.device | str = "cpu") -> "BatchSampling":
        return BatchSampling(
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([min(p.top_k, TOP_K_ALL) for p in params], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        )

    def select(self, idx: Tensor) -> "BatchSampling":
        return BatchSampling(self.temperature[idx], self.top_k[idx], self.top_p[idx])


def argmax(x: Tensor) -> Tensor:
    """x.argmax(-1): the first index of the largest value (NaN counting as the largest), through numpy's vectorised
    kernel for a float32 CPU tensor: torch's CPU argmax compares one element at a time (125 us for a
    49,152-token row on an AMD EPYC Zen 3, numpy's 4 us)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad or x.dim() == 0:
        return x.argmax(-1)
    return torch.from_numpy(np.asarray(x.numpy().argmax(-1), dtype=np.int64))


def to_probs(logits: Tensor, s: BatchSampling) -> Tensor:
    """logits [B, T, V] (any float) -> probabilities [B, T, V] float32.

    In order: divide by the temperature; top-k keeps every token whose logit is at least the k-th
    largest (ties at the boundary all stay, as in transformers); softmax; top-p keeps the smallest
    prefix of the distribution sorted by descending probability (equal ones by token id) whose mass
    reaches top_p (the most likely token always stays: top_p 0 keeps it alone), renormalised. Greedy rows
    become the one-hot of the argmax (first index on ties). Each row's result depends only on its own logits and
    parameters, bit for bit, whatever else the batch holds.
    """
    logits = logits.float()
    B, T, V = logits.shape
    if s.greedy:
        return torch.zeros_like(logits).scatter_(-1, argmax(logits)[..., None], 1.0)
    x = logits / s.divisor[:, None, None]                                       # (BatchSampling: the clamps)
    if s.any_top_k:
        cuts = (s.top_k > 0) & (s.top_k < V)                                    # [B] rows whose top-k drops tokens
        if bool(cuts.any()):              # (a top-k of V or more keeps every token: such rows are not searched)
            k = torch.where(cuts, s.top_k, torch.ones_like(s.top_k))            # [B]
            kth = torch.topk(x, int(k[cuts].max()), dim=-1).values             # [B, T, kmax] descending
            thresh = kth.gather(-1, (k - 1)[:, None, None].expand(B, T, 1))     # [B, T, 1]
            thresh = thresh.masked_fill(~cuts[:, None, None], float("-inf"))
            x = x.masked_fill(x < thresh, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if s.any_nucleus:                                                           # other rows untouched
        at = (s.top_p < 1).nonzero()[:, 0]                                      # [n] rows with top-p
        every = len(at) == B                                                    # the usual case: no copies
        top_p = s.top_p[at, None].expand(len(at), T).reshape(-1)                # [n*T]
        cut = top_p_cut((probs if every else probs[at]).reshape(-1, V), top_p).view(len(at), T, V)
        if every:
            probs = cut
        else:
            probs[at] = cut
    if s.any_greedy:
        onehot = torch.zeros_like(probs).scatter_(-1, argmax(logits)[..., None], 1.0)
        probs = torch.where(s.greedy_rows[:, None, None], onehot, probs)
    return probs


NUCLEUS_WINDOWS = (256, 4096)   # candidates a row's top-p cut is looked for among, before sorting the whole row
NUCLEUS_MARGIN = 1e-5           # how far a window's mass must pass top_p for the window to decide the cut


def top_p_cut(probs: Tensor, top_p: Tensor) -> Tensor:
    """probs [N, V] float32 (softmax rows), top_p [N] -> each row's top-p cut, renormalised [N, V]: the same bits
    as top_p_cut_by_sort, without sorting the whole vocabulary where a row's nucleus lies in its most likely few.

    A row's m most likely tokens (torch.topk: any order among ties), put in the order of the full sort
    (descending probability, equal ones by id), are the full sort's first s tokens, s the number of them above
    the m-th probability (every token above it is among them, with all its equals). Where those s carry at least
    top_p + NUCLEUS_MARGIN, every later token has at least that much mass before it (less the float32 roundings
    of the cumulative sum, which accumulates in float64, far below the margin) and is dropped, and the cumulative
    sums over the first s are the full sort's own: the cut is decided within the window, bit for bit. Rows it
    does not decide try the next window, then the full sort."""
    N, V = probs.shape
    out = torch.empty_like(probs)
    todo = torch.arange(N, device=probs.device)
    for m in NUCLEUS_WINDOWS:
        if m >= V or len(todo) == 0:
            break
        rows, p = (probs, top_p) if len(todo) == N else (probs[todo], top_p[todo])
        vals, ids = rows.topk(m, dim=-1)                                        # [n, m] the m most likely
        by_id = ids.argsort(dim=-1)
        vals, ids = vals.gather(-1, by_id), ids.gather(-1, by_id)
        vals, order = vals.sort(dim=-1, descending=True, stable=True)          # the full sort's order
        ids = ids.gather(-1, order)
        above = vals > vals[:, -1:]                                             # [n, m] the full sort's first s
        mass = vals.cumsum(-1)                                                  # [n, m] as the full sort sums
        s = above.sum(-1)                                                       # [n]
        decided = (s > 0) & (mass.gather(-1, (s - 1).clamp(min=0)[:, None])[:, 0] >= p + NUCLEUS_MARGIN)
        keep = ((mass - vals) < p[:, None]) & above
        keep[:, 0] = True                            # the most likely token stays (top_p may round to 0 in float32)
        cut = torch.zeros_like(rows).scatter_(-1, ids, vals.masked_fill(~keep, 0.0))
        cut = cut / row_total(cut)
        if bool(decided.all()) and len(todo) == N:
            return cut                                                          # the usual case: one window
        out[todo[decided]] = cut[decided]
        todo = todo[~decided]
    if len(todo):
        out[todo] = top_p_cut_by_sort(probs[todo], top_p[todo])
    return out


def top_p_cut_by_sort(probs: Tensor, top_p: Tensor) -> Tensor:
    """probs [N, V], top_p [N] -> the top-p cut, renormalised [N, V], by sorting whole rows (the definition)."""
    sp, si = probs.sort(dim=-1, descending=True, stable=True)
    before = sp.cumsum(-1) - sp                                                 # mass strictly before each token
    drop = before >= top_p[:, None]
    drop[:, 0] = False                                # the most likely token stays (top_p may round to 0 in float32)
    cut = torch.zeros_like(probs).scatter_(-1, si, sp.masked_fill(drop, 0.0))
    return cut / row_total(cut)


def row_total(x: Tensor) -> Tensor:
    """x [..., V] -> its sum over the last dim [..., 1], with the same bits for a row whatever the tensor's shape:
    torch splits a lone row's `sum` across threads (a [1, 1, V] row of plain decoding) but not the rows of a
    batch or a verification forward, so `sum` rounds a row differently alone; a cumulative sum runs along each
    row in order."""
    return x.cumsum(-1)[..., -1:]


def sample(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling: probs [..., V] (need not sum to one), uniforms u [...] in [0, 1) -> indices [...].

    The first index whose cumulative mass exceeds u * total: never a token of probability zero (u < 1
    has 53 bits, so u * total < total in float64). The cumulative mass is summed in float64: in float32 its
    rounding, relative to the total, swallows a long tail (at 262,144 tokens, 1e-4 of the mass unreachable)."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    idx = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


# ---- counter-based random streams -------------------------------------------------------------
class Stream(IntEnum):
    """Independent random streams of one sequence (see position_uniforms)."""
    TARGET = 1      # the target's token at a position: plain sampling, recovered and bonus tokens
    ACCEPT = 2      # the acceptance test of a sampled draft at a position
    DRAFT = 3       # a proposer's own sampling of its draft at a position


_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15                       # splitmix64's increment (the golden ratio)
_STREAM_SALT = {s: (0x632BE59BD9B4E019 * int(s)) & _MASK for s in Stream}
_SEED_SALT = 0xD1B54A32D192ED03                   # derive_seed's key


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic): a bijection with full avalanche."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _splitmix(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Output number counters + 1 of splitmix64 started at `keys` (uint64 arrays that broadcast)."""
    return _mix(keys + (counters + np.uint64(1)) * np.uint64(_GAMMA))


def _as_uint64(x: Tensor) -> np.ndarray:
    """int64 tensor -> uint64 array with the same bits (two's complement)."""
    return np.ascontiguousarray(x.detach().to("cpu", torch.int64).numpy()).view(np.uint64)


def position_uniforms(seeds: Tensor, positions: Tensor, stream: Stream) -> Tensor:
    """seeds [B] int64, positions [B, n] int64 -> uniforms [B, n] float64 in [0, 1).

    A stateless hash of (seed, stream, position): output number position + 1 of splitmix64 started at
    a key mixed from the seed and the stream, its top 53 bits as a float64 (exact). The same on every machine
    and device, whatever else is computed: a sequence's draws depend on nothing but its seed and the positions
    asked for, not on its batch, the draft length or the order of calls.
    """
    if positions.numel() <= FEW_UNIFORMS:
        return _few_uniforms(seeds.tolist(), positions.tolist(), stream).view(positions.shape).to(positions.device)
    keys = _mix(_mix(_as_uint64(seeds)) ^ np.uint64(_STREAM_SALT[stream]))       # [B]
    bits = _splitmix(keys[:, None], _as_uint64(positions))                        # [B, n]
    u = (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    return torch.from_numpy(u).to(positions.device)


FEW_UNIFORMS = 64   # up to this many, position_uniforms hashes in Python integers (a step's few: ~10 us, not ~150)


def _mix_int(z: int) -> int:
    """_mix on one Python integer in [0, 2**64)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _few_uniforms(seeds: list[int], positions: list[list[int]], stream: Stream) -> Tensor:
    """position_uniforms over Python integers, flattened [B * n]: the same bits (arithmetic modulo 2**64 is numpy's
    uint64)."""
    salt = _STREAM_SALT[stream]
    keys = [_mix_int(_mix_int(s & _MASK) ^ salt) for s in seeds]                       # [B]
    return torch.tensor([(_mix_int((k + ((p + 1) & _MASK) * _GAMMA) & _MASK) >> 11) * 2.0 ** -53
                         for k, row in zip(keys, positions) for p in row], dtype=torch.float64)


def seed_tensor(seeds: list[int], device: torch.device | str = "cpu") -> Tensor:
    """Python integer seeds (any size, any sign) -> [B] int64, each taken modulo 2**64."""
    wrapped = [(s & _MASK) - (1 << 64) if s & _MASK >= 1 << 63 else s & _MASK for s in seeds]
    return torch.tensor(wrapped, dtype=torch.int64, device=device)


def step_seeds(seeds: Tensor, starts: Tensor) -> Tensor:
    """seeds [B], starts [B] int64 -> [B] int64: the seeds of one drafting step that starts at `starts`.

    A sampling proposer draws its drafts from position_uniforms(step_seeds(seeds, start), positions,
    Stream.DRAFT): fresh draws at every step (each step starts at a later position), so nothing a
    step reveals about its drafts (how far it drafted, how long that took) bears on a later step's."""
    return torch.from_numpy(_splitmix(_mix(_as_uint64(seeds)), _as_uint64(starts)).view(np.int64)).to(seeds.device)


def derive_seed(seed: int, index: int) -> int:
    """A seed in [0, 2**62) for prompt `index` of a list sampled with `seed` (distinct per index)."""
    key = _mix(np.array([(seed ^ _SEED_SALT) & _MASK], dtype=np.uint64))
    return int(_splitmix(key, np.array([index], dtype=np.uint64))[0] >> np.uint64(2))
