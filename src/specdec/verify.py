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

Sampled drafts (a draft model or an EAGLE chain sampling x_t from its own q_t):
the classic rule. Keep x_t with probability min(1, p(x_t)/q(x_t)) (its own
uniform u(seed, t, ACCEPT)); at the first rejection sample the recovered token
from norm(max(0, p - q)), if all K survive the bonus token from p, both with
u_t. Its draws are keyed by position too, so they do not depend on batch-mates,
but which positions hold drafts depends on K: the output is the target's
distribution for any policy, and reproducible token for token for a fixed draft
length. A batch may mix both kinds (`Draft.sampled`): rows of point masses (an
EAGLE chain's greedy rows and rows below its sampling temperature, rows drafted
from a prediction) are verified by the point-mass rule beside rows of sampled
drafts, so each row's tokens depend on its own drafts and seed only.

Token trees (point-mass candidates): the walk from the root follows, at each node,
the child whose token is the target's own sample y there; if no child matches, y
is the *recovered* token (the *bonus* token at a leaf). In distribution this is the
sequential rejection over siblings (accept child x with probability p(x) / what is
left, else remove x and renormalise): y lands on a child with that child's
probability under p, and otherwise follows p without the children, renormalised.
Since the walk meets one node per depth, every committed token is the one plain
sampling draws at its position with the same seed: lossless for any way of
building the tree, token-identical to plain decoding when sampling too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import torch
from torch import Tensor

from .errors import SpecdecError
from .sampling import argmax, row_total, sample
from .tree import PAD, TokenTree

ROOT = -1                 # Draft.parents: the draft hangs from the pending token (the tree's root)


def chain_parents(batch: int, k: int, device: torch.device | str) -> Tensor:
    """[batch, k] the parents of a chain: draft i hangs from draft i - 1, the first from the root."""
    return torch.arange(-1, k - 1, device=device).expand(batch, k)


@dataclass(frozen=True)
class Reuse:
    """A self-speculative proposer's own computation of the first `layers` target layers for the rows a chain
    step scores (the pending token, then each draft), for the verification forward to reuse."""
    layers: int                        # N: the scored rows' first N layers are done
    hidden: Tensor                     # [B, K+1, H] the residual stream entering layer N
    k: Tensor                          # [N, B, n_kv, K+1, head_dim] their keys in layers 0..N-1
    v: Tensor                          # [N, B, n_kv, K+1, head_dim] and values

    def first(self, n: int) -> "Reuse":
        """The same for the first n scored rows."""
        return Reuse(self.layers, self.hidden[:, :n], self.k[..., :n, :], self.v[..., :n, :])


@dataclass(frozen=True)
class Draft:
    """A step's drafts for a batch: a chain or a token tree over each sequence's pending token.

    A chain is the tree in which draft i hangs from draft i - 1: both are tokens and parents, and a
    draft whose parents say chain is scored and verified as one. Point-mass drafts (probs None) may
    take any shape; drafts sampled from a proposer's q are chains.
    """
    tokens: Tensor                     # [B, K] long draft tokens; PAD = no draft here
    probs: Tensor | None = None        # [B, K, V] the proposer's q; None: point masses (deterministic proposer)
    parents: Tensor | None = None      # [B, K] long: ROOT or an earlier draft's index; not given: a chain
    reuse: Reuse | None = None         # a chain's first layers, computed by the proposer (self-speculation)
    predicted: Tensor | None = None    # [B] bool: rows drafted from the request's predicted output; not given: none
    sampled: Tensor | None = None      # [B] bool: rows whose drafts were drawn from probs, the others' are point
                                       # masses (verified as such); not given: every row where probs is given
    is_chain: bool = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, Tensor) or self.tokens.dim() != 2:
            raise ValueError(f"Draft.tokens must be a [B, K] tensor, got {getattr(self.tokens, 'shape', self.tokens)!r}")
        B, K = self.tokens.shape
        chain = chain_parents(B, K, self.tokens.device)
        given = self.parents is not None                        # not given: a chain, nothing to compare
        if not given:
            object.__setattr__(self, "parents", chain)
        if self.predicted is None:
            object.__setattr__(self, "predicted", torch.zeros(B, dtype=torch.bool, device=self.tokens.device))
        if self.sampled is None:
            object.__setattr__(self, "sampled", torch.full((B,), self.probs is not None, device=self.tokens.device))
        object.__setattr__(self, "is_chain", not given or torch.equal(self.parents, chain))
        if self.probs is not None and not self.is_chain:
            raise ValueError("sampled drafts (with the proposer's q) must be a chain")
        if self.reuse is not None and (not self.is_chain or self.reuse.hidden.shape[1] != K + 1):
            raise ValueError("a draft's reused layers must cover a chain's K + 1 scored rows")

    @staticmethod
    def empty(batch: int, device: torch.device | str) -> "Draft":
        """No drafts: a plain step (one shared instance per batch size and device: a Draft is never changed)."""
        return _empty_draft(batch, torch.device(device))

    @cached_property
    def depth(self) -> Tensor:
        """[B, K] each draft's depth below the pending token (1: its children)."""
        B, K = self.tokens.shape
        if self.is_chain:
            return torch.arange(1, K + 1, device=self.tokens.device).expand(B, K)
        d = torch.ones(B, K, dtype=torch.long, device=self.tokens.device)
        for n in range(1, K):                                   # parents precede children
            par = self.parents[:, n]
            d[:, n] = torch.where(par != ROOT, d.gather(1, par.clamp(min=0)[:, None])[:, 0] + 1, d[:, n])
        return d

    @property
    def length(self) -> int:
        """Drafts on the longest path: a chain's K, a tree's depth."""
        return self.tokens.shape[1] if self.is_chain else int(self.depth.amax())

    def offered(self) -> Tensor:
        """[B] the drafts a row could accept in this step: the depth of its deepest real draft."""
        B, K = self.tokens.shape
        if K == 0:
            return torch.zeros(B, dtype=torch.long, device=self.tokens.device)
        return torch.where(self.tokens != PAD, self.depth, torch.zeros_like(self.tokens)).amax(-1)

    def cut(self, keep: Tensor) -> "Draft":
        """Drafts deeper than keep [B] (a row's remaining room) become PAD."""
        deeper = self.depth > keep[:, None]                     # [B, K]
        if not bool(deeper.any()):
            return self
        return Draft(self.tokens.masked_fill(deeper, PAD), self.probs, self.parents, self.reuse, self.predicted,
                     self.sampled)

    def first_nodes(self, n: int) -> "Draft":
        """At most the first n drafts per row (parents precede children, so a tree stays a tree): what a
        step's forward has room and an exact kernel for."""
        if self.tokens.shape[1] <= n:
            return self
        return Draft(self.tokens[:, :n], None if self.probs is None else self.probs[:, :n], self.parents[:, :n],
                     None if self.reuse is None else self.reuse.first(n + 1), self.predicted, self.sampled)

    def trimmed(self) -> "Draft":
        """Without trailing columns that hold no draft in any row (nothing hangs from them)."""
        real = (self.tokens != PAD).any(0).nonzero()
        k = int(real.amax()) + 1 if real.numel() else 0
        if k == self.tokens.shape[1]:
            return self
        return self.first_nodes(k)

    def tree(self, pending: Tensor) -> TokenTree:
        """The token tree rooted at pending [B]: node 0 the pending token, node i + 1 draft i."""
        parents = torch.where(self.tokens != PAD, self.parents + 1, torch.full_like(self.parents, PAD))
        root = torch.full_like(pending[:, None], PAD)
        return TokenTree(torch.cat([pending[:, None], self.tokens], 1), torch.cat([root, parents], 1))


@lru_cache(maxsize=64)
def _empty_draft(batch: int, device: torch.device) -> Draft:
    return Draft(torch.empty(batch, 0, dtype=torch.long, device=device))


def check_draft(draft: object, batch: int, k: int, vocab: int) -> None:
    """A one-line SpecdecError where a proposer's `propose(batch, k)` broke the Proposer contract, which the
    verifier trusts: a Draft of `batch` rows; ids in [0, vocab) or PAD; parents ROOT or an earlier draft; at
    most k drafts along a path; a sampled row's q [V] finite, non-negative, summing to 1 and positive at its
    draft (a q that is not would make the rejection rule keep drafts the target would not sample)."""
    def broke(why: str) -> SpecdecError:
        return SpecdecError(f"a proposer broke the Proposer contract: {why}")

    if not isinstance(draft, Draft):
        raise broke(f"propose returned {type(draft).__name__}, not a Draft")
    t = draft.tokens
    if t.dtype != torch.long or t.shape[0] != batch:
        raise broke(f"draft tokens must be long [{batch}, K], got {str(t.dtype).removeprefix('torch.')} {list(t.shape)}")
    K = t.shape[1]
    if K == 0 and draft.parents.shape == t.shape:
        return                                                                        # no drafts: nothing to trust
    real = t != PAD                                                                   # [B, K]
    wrong = t[real & ((t < 0) | (t >= vocab))]
    if wrong.numel():
        raise broke(f"draft tokens must be ids in [0, {vocab}) or PAD ({PAD}), got {sorted(set(wrong.tolist()))[:4]}")
    p = draft.parents                                                                 # [B, K]
    earlier = torch.arange(K, device=p.device)                                        # [K] a parent comes before
    if p.shape != t.shape or p.dtype != torch.long or (K and bool(((p < ROOT) | (p >= earlier)).any())):
        raise broke(f"parents must be long {list(t.shape)}, each ROOT ({ROOT}) or an earlier draft's index")
    if K and draft.length > k:
        raise broke(f"asked for at most {k} drafts along a path, got {draft.length}")
    if draft.probs is None:
        return
    q = draft.probs
    if q.shape != (batch, K, vocab) or not q.is_floating_point():
        raise broke(f"q must be floating [{batch}, {K}, {vocab}], got {str(q.dtype).removeprefix('torch.')} "
                    f"{list(q.shape)}")
    rows = real & draft.sampled[:, None]                                             # [B, K] drafts drawn from q
    if not bool(rows.any()):
        return
    # reductions over q, no copies of it (a large batch's q holds B * K * V numbers)
    least = q.amin(-1)[rows]                                                         # [n]
    total = q.sum(-1, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)[rows]   # [n]
    if not bool((least >= 0).all()) or not bool(torch.isfinite(total).all()):      # NaN fails >= 0
        raise broke("q must be finite and non-negative")
    if float((total - 1).abs().amax()) > max(1e-3, 2 * torch.finfo(q.dtype).eps):    # a bfloat16 q rounds more
        raise broke(f"each sampled draft's q must sum to 1, got {float(total[(total - 1).abs().argmax()]):.6g}")
    if bool((q.gather(-1, t.clamp(min=0)[..., None])[..., 0][rows] <= 0).any()):
        raise broke("a sampled draft must have q(draft) > 0")


@dataclass(frozen=True)
class Verdict:
    """What a step keeps, for chains and trees alike."""
    num_accepted: Tensor             # [B] accepted drafts
    tokens: Tensor                   # [B, D+1] accepted drafts then the recovered/bonus token, PAD after;
                                     # D: the deepest draft (a chain's K)
    path: Tensor                     # [B, D+1] the committed scored rows (0: the pending token, i: draft
                                     # i - 1), PAD after; a chain's is its prefix
    target_tokens: Tensor            # [B, N] the target's own token after every scored row (drawn with that
                                     # position's uniform; greedy: its argmax), for Jacobi-style proposers
    num_new: Tensor = field(init=False)   # [B] tokens committed this step: num_accepted + 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_new", self.num_accepted + 1)


def verify(draft: Draft, p: Tensor, u_target: Tensor, u_accept: Tensor) -> Verdict:
    """A chain: draft [B, K]; p [B, K+1, V] target probabilities; u_target [B, K+1] the target's uniforms
    at the positions p decides, u_accept [B, K] the acceptance tests' (used by sampled drafts only). Rows of
    point masses (draft.sampled False) are verified as such also beside rows of sampled drafts, so a row's
    tokens depend on its own drafts only."""
    if draft.probs is None or not bool(draft.sampled.any()):
        return verify_point_masses(draft.tokens, p, u_target)
    sampled = verify_sampled(draft.tokens, draft.probs, p, u_target, u_accept)
    if bool(draft.sampled.all()):
        return sampled
    point = verify_point_masses(draft.tokens, p, u_target)
    rows = draft.sampled[:, None]
    return Verdict(torch.where(draft.sampled, sampled.num_accepted, point.num_accepted),
                   torch.where(rows, sampled.tokens, point.tokens), torch.where(rows, sampled.path, point.path),
                   point.target_tokens)


def verify_point_masses(x: Tensor, p: Tensor, u_target: Tensor) -> Verdict:
    """x [B, K] drafts (PAD = none); p [B, K+1, V]; u_target [B, K+1]: follow the drafts while they are
    the target's own samples."""
    return follow(x, sample(p, u_target))


def verify_greedy(x: Tensor, logits: Tensor) -> Verdict:
    """verify_point_masses for rows that all decode greedily, from their logits [B, K+1, V]: the target's token
    is the argmax (the first index on ties), which is what sampling its one-hot gives for any uniform."""
    return follow(x, argmax(logits))


def follow(x: Tensor, y: Tensor) -> Verdict:
    """Drafts x [B, K] followed while they equal the target's tokens y [B, K+1]."""
    K = x.shape[1]
    if K == 0:                                                                  # plain decoding: y is the new token
        return Verdict(torch.zeros_like(y[:, 0]), y, torch.zeros_like(y), y)
    follows = (x != PAD) & (x == y[:, :K])                                      # [B, K]
    num_accepted = follows.long().cumprod(-1).sum(-1)                           # [B]
    return _chain_verdict(y, num_accepted, y)


def verify_sampled(x: Tensor, q: Tensor, p: Tensor, u_target: Tensor, u_accept: Tensor) -> Verdict:
    """x [B, K] drafts sampled from q [B, K, V]; p [B, K+1, V]; u_target [B, K+1], u_accept [B, K]."""
    B, K = x.shape
    if K == 0:                                                                  # nothing drafted: plain sampling
        return verify_point_masses(x, p, u_target)
    rows = torch.arange(B, device=x.device)
    valid = x != PAD
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
    y = torch.cat([x, torch.full((B, 1), PAD, dtype=x.dtype, device=x.device)], 1)
    y[rows, num_accepted] = last
    return _chain_verdict(y, num_accepted, sample(p, u_target))


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) [..., V]: what a rejection leaves of p. Where nothing is left (p == q cannot
    reject; only rounding gets here) p itself."""
    r = (p - q).clamp(min=0)
    mass = row_total(r)                               # the same bits alone or beside other rows
    return torch.where(mass > 0, r / mass.clamp(min=1e-30), p)


def _chain_verdict(y: Tensor, num_accepted: Tensor, target_tokens: Tensor) -> Verdict:
    """y [B, K+1] accepted drafts then the final token -> tokens and path, PAD after index num_accepted."""
    ar = torch.arange(y.shape[1], device=y.device).expand_as(y)
    kept = ar <= num_accepted[:, None]
    return Verdict(num_accepted, torch.where(kept, y, torch.full_like(y, PAD)),
                   torch.where(kept, ar, torch.full_like(ar, PAD)), target_tokens)


def verify_tree(tree: TokenTree, p: Tensor, u: Tensor) -> Verdict:
    """Walk the tree from the root along the target's own samples (see the module docstring).

    p [B, N, V]: target probabilities at every node (greedy = one-hot); u [B, N]: the uniform of the
    position each node's distribution decides (the node's position + 1).
    """
    y = sample(p, u)                                                      # [B, N] the target's token after each node
    child = matching_child(tree, y)                                       # [B, N]
    B, N = y.shape
    D = int(tree.depth().amax())                                          # deepest node
    rows = torch.arange(B, device=y.device)
    out_tok = torch.full((B, D + 1), PAD, dtype=torch.long, device=y.device)
    out_path = torch.full((B, D + 1), PAD, dtype=torch.long, device=y.device)
    out_path[:, 0] = 0
    node = torch.zeros(B, dtype=torch.long, device=y.device)             # [B] where each walk stands
    num = torch.zeros(B, dtype=torch.long, device=y.device)              # [B] accepted nodes
    walking = torch.ones(B, dtype=torch.bool, device=y.device)
    for d in range(D + 1):
        out_tok[:, d] = torch.where(walking, y[rows, node], out_tok[:, d])
        nxt = child[rows, node]
        walking &= nxt != PAD
        if d == D or not bool(walking.any()):
            break
        node = torch.where(walking, nxt, node)
        out_path[:, d + 1] = torch.where(walking, node, out_path[:, d + 1])
        num += walking.long()
    return Verdict(num, out_tok, out_path, y)


def matching_child(tree: TokenTree, y: Tensor) -> Tensor:
    """y [B, N] a token per node -> [B, N] the first child of each node whose token is y there, PAD if none."""
    B, N = y.shape
    par = tree.parents.clamp(min=0)                                       # [B, N]
    real = (tree.tokens != PAD) & (tree.parents != PAD)
    hit = real & (tree.tokens == y.gather(1, par))                        # [B, N] node c is its parent's y
    ids = torch.arange(N, device=y.device).expand(B, N)
    first = torch.full((B, N), N, dtype=torch.long, device=y.device)
    first.scatter_reduce_(1, par, torch.where(hit, ids, torch.full_like(ids, N)), "amin")
    return torch.where(first < N, first, torch.full_like(first, PAD))
