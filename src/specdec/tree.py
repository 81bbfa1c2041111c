"""Token trees: many candidate continuations scored by the target in one forward.

Node 0 is the root (the pending token, already chosen); every other node is a
draft token whose parent is an earlier node. The target sees the nodes at
positions base + depth under an ancestor-or-self mask, so each node's logits are
exactly those of its own path.

Candidates are point masses (deterministic proposals). Verification walks from
the root: at a node of depth d the target's token is y = sample(p_node, u) with
the sequence's uniform for position base + d + 1 (`sampling.position_uniforms`);
the child whose token is y is *accepted* and the walk goes on from it; if no
child has token y, y is the *recovered* token (or the *bonus* token at a leaf).
In distribution this is the sequential rejection over siblings (accept child x
with probability p(x) / what is left, else remove x and renormalise): y lands on
a child with that child's probability under p, and otherwise follows p without
the children, renormalised. And since the walk meets one node per depth, every
committed token is the one plain sampling draws at its position with the same
seed: lossless for any way of building the tree, token-identical to plain
decoding when sampling too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import SpecdecError
from .sampling import sample


MAX_TREE_BUDGET = 64      # nodes per tree: the exact (batch-invariant) tree forward takes up to 72 tokens


@dataclass(frozen=True)
class TreeShape:
    """How EAGLE drafts: `topk` children per expanded node and depth, the best `budget` nodes kept.

    topk 1 is a plain chain (verified as one, no tree mask); the depth is the draft length K.
    """

    topk: int = 1
    budget: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.topk <= 16:
            raise SpecdecError(f"tree topk must be in [1, 16], got {self.topk}")
        if not self.topk <= self.budget <= MAX_TREE_BUDGET:
            raise SpecdecError(f"tree budget must be in [topk={self.topk}, {MAX_TREE_BUDGET}], got {self.budget}")

    @staticmethod
    def parse(text: str) -> "TreeShape":
        """"TOPKxBUDGET", e.g. "4x16"; "1" (or "1xN") is a chain."""
        topk, _, budget = text.strip().lower().partition("x")
        if not topk.isdigit() or (budget and not budget.isdigit()):
            raise SpecdecError(f"a tree shape is TOPKxBUDGET (e.g. 4x16) or 1 for a chain, got {text!r}")
        return TreeShape(int(topk), int(budget) if budget else max(16, int(topk)))

    def __str__(self) -> str:
        return "chain" if self.topk == 1 else f"{self.topk}x{self.budget}"


@dataclass(frozen=True)
class TokenTree:
    tokens: Tensor          # [B, N] node tokens; node 0 = root; -1 = padding node
    parents: Tensor         # [B, N] parent node index; -1 for the root and padding

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def depth(self) -> Tensor:
        """[B, N] depth of every node (root 0); padding nodes get 0."""
        B, N = self.parents.shape
        d = torch.zeros(B, N, dtype=torch.long, device=self.parents.device)
        for n in range(1, N):                                   # parents precede children
            par = self.parents[:, n]
            d[:, n] = torch.where(par >= 0, d.gather(1, par.clamp(min=0)[:, None])[:, 0] + 1, d[:, n])
        return d

    def mask(self) -> Tensor:
        """[B, N, N] bool: node i may attend to node j iff j is i or an ancestor of i (padding sees itself)."""
        B, N = self.parents.shape
        m = torch.eye(N, dtype=torch.bool, device=self.parents.device).expand(B, N, N).clone()
        for n in range(1, N):
            par = self.parents[:, n]
            has = par >= 0
            anc = m[torch.arange(B), par.clamp(min=0)]               # [B, N] ancestors-or-self of the parent
            m[:, n] |= anc & has[:, None]
        return m


def chain_tree(pending: Tensor, drafts: Tensor) -> TokenTree:
    """A chain as a tree: pending [B], drafts [B, K] (-1 padded) -> N = K + 1 nodes."""
    B, K = drafts.shape
    tokens = torch.cat([pending[:, None], drafts], 1)
    parents = torch.arange(-1, K, device=drafts.device).expand(B, K + 1).clone()
    parents[tokens < 0] = -1
    return TokenTree(tokens, parents)


@dataclass(frozen=True)
class TreeVerdict:
    num_accepted: Tensor    # [B] accepted draft nodes on the path
    tokens: Tensor          # [B, D+1] accepted tokens then the recovered/bonus token, -1 padded
    path: Tensor            # [B, D+1] node indices of the committed rows: root, accepted nodes; -1 padded

    @property
    def num_new(self) -> Tensor:
        return self.num_accepted + 1


def verify_tree(tree: TokenTree, p: Tensor, u: Tensor) -> TreeVerdict:
    """Walk the tree from the root along the target's own samples (see the module docstring).

    p [B, N, V]: target probabilities at every node (greedy = one-hot); u [B, N]: the uniform of the
    position each node's distribution decides (the node's position + 1).
    """
    y = sample(p, u)                                                      # [B, N] the target's token after each node
    child = matching_child(tree, y)                                       # [B, N]
    B, N = y.shape
    D = int(tree.depth().amax())                                          # deepest node
    rows = torch.arange(B, device=y.device)
    out_tok = torch.full((B, D + 1), -1, dtype=torch.long, device=y.device)
    out_path = torch.full((B, D + 1), -1, dtype=torch.long, device=y.device)
    out_path[:, 0] = 0
    node = torch.zeros(B, dtype=torch.long, device=y.device)             # [B] where each walk stands
    num = torch.zeros(B, dtype=torch.long, device=y.device)              # [B] accepted nodes
    walking = torch.ones(B, dtype=torch.bool, device=y.device)
    for d in range(D + 1):
        out_tok[:, d] = torch.where(walking, y[rows, node], out_tok[:, d])
        nxt = child[rows, node]
        walking &= nxt >= 0
        if d == D or not bool(walking.any()):
            break
        node = torch.where(walking, nxt, node)
        out_path[:, d + 1] = torch.where(walking, node, out_path[:, d + 1])
        num += walking.long()
    return TreeVerdict(num, out_tok, out_path)


def matching_child(tree: TokenTree, y: Tensor) -> Tensor:
    """y [B, N] a token per node -> [B, N] the first child of each node whose token is y there, -1 if none."""
    B, N = y.shape
    par = tree.parents.clamp(min=0)                                       # [B, N]
    real = (tree.tokens >= 0) & (tree.parents >= 0)
    hit = real & (tree.tokens == y.gather(1, par))                        # [B, N] node c is its parent's y
    ids = torch.arange(N, device=y.device).expand(B, N)
    first = torch.full((B, N), N, dtype=torch.long, device=y.device)
    first.scatter_reduce_(1, par, torch.where(hit, ids, torch.full_like(ids, N)), "amin")
    return torch.where(first < N, first, torch.full_like(first, -1))
