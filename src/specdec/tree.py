"""Token trees: many candidate continuations scored by the target in one forward.

Node 0 is the root (the pending token, already chosen); every other node is a
draft token whose parent is an earlier node. The target sees the nodes at
positions base + depth under an ancestor-or-self mask, so each node's logits are
exactly those of its own path. Verification walks the tree (`verify.verify_tree`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import SpecdecError

PAD = -1                  # no token here: a padded draft, tree node, verdict token or path entry; a node
                          # without a parent (the root, padding) has parent PAD too
MAX_TREE_BUDGET = 64      # nodes per tree: the exact (batch-invariant) tree forward takes up to 72 tokens


@dataclass(frozen=True)
class TreeShape:
    """How EAGLE drafts: `topk` children per expanded node and depth, the best `budget` nodes kept.

    topk 1 is a plain chain (verified as one, no tree mask); the depth is the draft length K.
    """

    topk: int = 1
    budget: int = 16

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.topk, self.budget)):
            raise SpecdecError(f"a tree shape takes integers, got topk={self.topk!r}, budget={self.budget!r}")
        if not 1 <= self.topk <= 16:
            raise SpecdecError(f"tree topk must be in [1, 16], got {self.topk}")
        if not self.topk <= self.budget <= MAX_TREE_BUDGET:
            raise SpecdecError(f"tree budget must be in [topk={self.topk}, {MAX_TREE_BUDGET}], got {self.budget}")

    @staticmethod
    def parse(text: str) -> "TreeShape":
        """"TOPKxBUDGET", e.g. "4x16"; "1" (or "1xN") is a chain."""
        topk, x, budget = text.strip().lower().partition("x")
        if not topk.isdecimal() or (x and not budget.isdecimal()):
            raise SpecdecError(f"a tree shape is TOPKxBUDGET (e.g. 4x16) or 1 for a chain, got {text!r}")
        return TreeShape(int(topk), int(budget) if budget else max(16, int(topk)))

    def __str__(self) -> str:
        return "chain" if self.topk == 1 else f"{self.topk}x{self.budget}"


@dataclass(frozen=True)
class TokenTree:
    tokens: Tensor          # [B, N] node tokens; node 0 = root; PAD = padding node
    parents: Tensor         # [B, N] parent node index; PAD for the root and padding

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def depth(self) -> Tensor:
        """[B, N] depth of every node (root 0); padding nodes get 0."""
        B, N = self.parents.shape
        d = torch.zeros(B, N, dtype=torch.long, device=self.parents.device)
        for n in range(1, N):                                   # parents precede children
            par = self.parents[:, n]
            d[:, n] = torch.where(par != PAD, d.gather(1, par.clamp(min=0)[:, None])[:, 0] + 1, d[:, n])
        return d

    def mask(self) -> Tensor:
        """[B, N, N] bool: node i may attend to node j iff j is i or an ancestor of i (padding sees itself)."""
        B, N = self.parents.shape
        m = torch.eye(N, dtype=torch.bool, device=self.parents.device).expand(B, N, N).clone()
        for n in range(1, N):
            par = self.parents[:, n]
            has = par != PAD
            anc = m[torch.arange(B), par.clamp(min=0)]               # [B, N] ancestors-or-self of the parent
            m[:, n] |= anc & has[:, None]
        return m


def chain_tree(pending: Tensor, drafts: Tensor) -> TokenTree:
    """A chain as a tree: pending [B], drafts [B, K] (PAD padded) -> N = K + 1 nodes."""
    B, K = drafts.shape
    tokens = torch.cat([pending[:, None], drafts], 1)
    parents = torch.arange(-1, K, device=drafts.device).expand(B, K + 1).clone()
    parents[tokens == PAD] = PAD
    return TokenTree(tokens, parents)
