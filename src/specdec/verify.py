"""Verification: keep what the target would have produced, provably.

The target scores the pending token and K drafts in one forward: p_t for every
position t it decides. Each sequence's token at position t is decided by its own
uniform u_t = u(seed, t, TARGET) (`sampling.position_uniforms`).

Point-mass drafts (every deterministic proposer: n-gram, EAGLE, hybrid; greedy
drafting): the target's token at t is y_t = sample(p_t, u_t), computed for every
scored position. Drafts are *accepted* while draft x_t == y_t; the first y_t that
differs is the *recovered* token, and y after the last draft the *bonus* token.
This is the rejection rule for q = one-hot(x): x is accepted with probability
p(x) = min(1, p(x)/q(x)), and on rejection y is distributed as
norm(max(0, p - one-hot(x))), p without x. Better: every committed token is
exactly the token plain sampling draws with the same seed, so the sampled output
of a point-mass method is token-identical to plain decoding's, whatever K, the
draft policy, the batch or the clock (greedy: p is one-hot and y_t the argmax).

Sampled drafts (a draft model sampling x_t from its own q_t): the classic rule.
Keep x_t with probability min(1, p(x_t)/q(x_t)) (its own uniform u(seed, t,
ACCEPT)); at the first rejection sample the recovered token from
norm(max(0, p - q)), if all K survive the bonus token from p, both with u_t. Its
draws are keyed by position too, so they do not depend on batch-mates, but which
positions hold drafts depends on K: the output is the target's distribution for
any policy, and reproducible token for token for a fixed draft length.
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


def verify(draft: Draft, p: Tensor, u_target: Tensor, u_accept: Tensor) -> Verdict:
    """draft [B, K]; p [B, K+1, V] target probabilities; u_target [B, K+1] the target's uniforms at the
    positions p decides, u_accept [B, K] the acceptance tests' (used by sampled drafts only)."""
    if draft.probs is None:
        return verify_point_masses(draft.tokens, p, u_target)
    return verify_sampled(draft.tokens, draft.probs, p, u_target, u_accept)


def verify_point_masses(x: Tensor, p: Tensor, u_target: Tensor) -> Verdict:
    """x [B, K] drafts (-1 = none); p [B, K+1, V]; u_target [B, K+1]: follow the drafts while they are
    the target's own samples."""
    K = x.shape[1]
    y = sample(p, u_target)                                                     # [B, K+1] the target's tokens
    follows = (x >= 0) & (x == y[:, :K])                                        # [B, K]
    num_accepted = follows.long().cumprod(-1).sum(-1)                           # [B]
    return Verdict(num_accepted, _committed(y, num_accepted))


def verify_sampled(x: Tensor, q: Tensor, p: Tensor, u_target: Tensor, u_accept: Tensor) -> Verdict:
    """x [B, K] drafts sampled from q [B, K, V]; p [B, K+1, V]; u_target [B, K+1], u_accept [B, K]."""
    B, K = x.shape
    if K == 0:                                                                  # nothing drafted: plain sampling
        return verify_point_masses(x, p, u_target)
    rows = torch.arange(B, device=x.device)
    valid = x >= 0
    xs = x.clamp(min=0)
    p_x = p[:, :K].gather(-1, xs[..., None]).squeeze(-1)                       # [B, K]
    q_x = q.gather(-1, xs[..., None]).squeeze(-1)
    accept = valid & (u_accept < p_x / q_x.clamp(min=1e-30))                    # u < min(1, p/q)
    num_accepted = accept.long().cumprod(-1).sum(-1)                            # [B] in [0, K]

    # the final token: recovered at the first rejection of a real draft, else the bonus (or plain p
    # where the row had no draft left)
    final = p[rows, num_accepted]                                               # [B, V]
    at = num_accepted.clamp(max=K - 1)                                          # [B] the rejected position
    rejected = (num_accepted < K) & valid[rows, at]                             # [B] a real draft was rejected
    if bool(rejected.any()):
        final = torch.where(rejected[:, None], residual(final, q[rows, at]), final)
    last = sample(final, u_target.gather(1, num_accepted[:, None])[:, 0])      # [B]
    y = torch.cat([x, torch.full((B, 1), -1, dtype=x.dtype, device=x.device)], 1)
    y[rows, num_accepted] = last
    return Verdict(num_accepted, _committed(y, num_accepted))


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) [..., V]: what a rejection leaves of p. Where nothing is left (p == q cannot
    reject; only rounding gets here) p itself."""
    r = (p - q).clamp(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=1e-30), p)


def _committed(y: Tensor, num_accepted: Tensor) -> Tensor:
    """y [B, K+1] accepted drafts then the final token -> the same with -1 after index num_accepted."""
    ar = torch.arange(y.shape[1], device=y.device)
    return torch.where(ar[None] <= num_accepted[:, None], y, torch.full_like(y, -1))
