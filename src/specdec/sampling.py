"""The one sampling transform: logits -> probabilities, shared by draft and target.

Speculative sampling is exact only if the draft's q and the target's p come
from the same transform (temperature, top-k, top-p). Greedy (temperature 0) is
the point mass on the argmax, so one verifier serves both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import SpecdecError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 means greedy
    top_k: int = 0                    # 0 means off
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise SpecdecError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SpecdecError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise SpecdecError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise SpecdecError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class BatchSampling:
    """Per-sequence sampling parameters as tensors, so one transform serves a mixed batch."""
    temperature: Tensor   # [B] float32, 0 = greedy
    top_k: Tensor         # [B] long, 0 = off
    top_p: Tensor         # [B] float32

    @staticmethod
    def of(params: list[SamplingParams], device: torch.device | str = "cpu") -> "BatchSampling":
        return BatchSampling(
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        )

    def select(self, idx: Tensor) -> "BatchSampling":
        return BatchSampling(self.temperature[idx], self.top_k[idx], self.top_p[idx])


def to_probs(logits: Tensor, s: BatchSampling) -> Tensor:
    """logits [B, T, V] (any float) -> probabilities [B, T, V] float32.

    Greedy rows become the one-hot of the argmax (first index on ties).
    """
    logits = logits.float()
    B, T, V = logits.shape
    greedy = s.temperature <= 0                                                 # [B]
    if bool(greedy.all()):
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    temp = torch.where(greedy, torch.ones_like(s.temperature), s.temperature)
    x = logits / temp[:, None, None]
    if bool((s.top_k > 0).any()):
        k = torch.where(s.top_k > 0, s.top_k.clamp(max=V), torch.full_like(s.top_k, V))   # [B]
        kth = torch.topk(x, int(k.max()), dim=-1).values                       # [B, T, kmax] descending
        thresh = kth.gather(-1, (k - 1)[:, None, None].expand(B, T, 1))         # [B, T, 1]
        x = x.masked_fill(x < thresh, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if bool((s.top_p < 1).any()):
        sp, si = probs.sort(dim=-1, descending=True, stable=True)
        before = sp.cumsum(-1) - sp                                             # mass strictly before each token
        drop = before >= s.top_p[:, None, None]                                 # top-1 always kept
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None, None], onehot, probs)
    return probs


def sample(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling: probs [..., V], uniforms u [...] in [0, 1) -> indices [...]."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


def uniforms(rngs: list[torch.Generator], n: int, device: torch.device | str = "cpu") -> Tensor:
    """[B, n] uniforms, row b drawn from its own generator (so a sequence's draws do not depend on its batch)."""
    return torch.stack([torch.rand(n, generator=g) for g in rngs]).to(device)


def make_rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
