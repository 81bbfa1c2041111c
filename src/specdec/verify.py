"""Verification: keep what the target would have produced, provably.

Walk the drafts left to right: keep draft x with probability min(1, p(x)/q(x));
at the first rejection sample the *recovered* token from norm(max(0, p - q));
if all K survive, sample the *bonus* token from the target's last distribution.
Greedy is the same rule with p a point mass. A deterministic proposer is the
point mass q = one-hot(x): accept with probability p(x), recover from p without x.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import sample

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .tree import TokenTree


@dataclass(frozen=True)
class Draft:
    tokens: Tensor                   # [B, K] long, -1 = no draft at this position
    probs: Tensor | None = None      # [B, K, V] proposer's q; None = deterministic proposer (point mass)
    tree: "TokenTree | None" = None  # a token tree (root = pending token) instead of a chain; tokens unused


@dataclass(frozen=True)
class Verdict:
    num_accepted: Tensor             # [B] accepted drafts
    tokens: Tensor                   # [B, K+1] accepted drafts then the recovered/bonus token, -1 padded

    @property
    def num_new(self) -> Tensor:     # [B] tokens committed this step
        return self.num_accepted + 1

    @property
    def path(self) -> Tensor:        # [B, K+1] scored rows that are committed (a chain: its prefix)
        B, K1 = self.tokens.shape
        return torch.arange(K1, device=self.tokens.device).expand(B, K1)


def verify(draft: Draft, p: Tensor, u_accept: Tensor, u_final: Tensor) -> Verdict:
    """draft [B, K]; p [B, K+1, V] target probabilities; u_accept [B, K], u_final [B] uniforms."""
    x = draft.tokens
    B, K = x.shape
    valid = x >= 0
    xs = x.clamp(min=0)
    p_x = p[:, :K].gather(-1, xs[..., None]).squeeze(-1)                       # [B, K]
    if draft.probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft.probs.gather(-1, xs[..., None]).squeeze(-1)
    ratio = p_x / q_x.clamp(min=1e-30)
    accept = valid & (u_accept < ratio)                                         # u < min(1, ratio)
    num_accepted = accept.long().cumprod(-1).sum(-1)                            # [B]

    # distribution of the final token: residual at the first rejection, else the bonus position
    pos = num_accepted                                                          # [B] in [0, K]
    final = p[torch.arange(B), pos]                                             # [B, V]
    rejected = pos < K
    if bool(rejected.any()):
        posc = pos.clamp(max=K - 1)
        xr = xs[torch.arange(B), posc]                                          # [B] rejected draft
        vr = valid[torch.arange(B), posc] & rejected                            # a real draft was rejected
        if draft.probs is None:
            q = torch.zeros_like(final).scatter_(-1, xr[:, None], 1.0)
        else:
            q = draft.probs[torch.arange(B), posc]
        resid = (final - q).clamp(min=0)
        mass = resid.sum(-1, keepdim=True)
        resid = torch.where(mass > 0, resid / mass.clamp(min=1e-30), final)   # p == q cannot reject; guard rounding
        final = torch.where(vr[:, None], resid, final)                         # padded position: plain p
    last = sample(final, u_final)                                               # [B]
    ar = torch.arange(K + 1, device=x.device)
    out = torch.cat([x, torch.full((B, 1), -1, dtype=x.dtype, device=x.device)], 1)
    out = torch.where(ar[None] < num_accepted[:, None], out, torch.full_like(out, -1))
    out.scatter_(1, num_accepted[:, None], last[:, None])
    return Verdict(num_accepted, out)
