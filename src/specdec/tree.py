"""Token trees: many candidate continuations scored by the target in one forward.

Node 0 is the root (the pending token, already chosen); every other node is a
draft token whose parent is an earlier node. The target sees the nodes at
positions base + depth under an ancestor-or-self mask, so each node's logits are
exactly those of its own path. Candidates are point masses (deterministic
proposals), so the verifier below is lossless for any way of building the tree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import SpecdecError


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
    """Walk the tree from the root with recursive rejection over siblings (point-mass candidates).

    p [B, N, V]: target probabilities at every node (greedy = one-hot); u [B, N + 1] uniforms.
    At a node, try its children in order: accept child x with probability p(x) / sum(p);
    on rejection zero p(x) and renormalise. If no child survives (or there is none), sample
    the next token from what is left of p: the recovered token, or the bonus at a leaf.
    The result is distributed exactly as p along the path; greedy takes the argmax child.
    """
    B, N, V = p.shape
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    D = N
    out_tok = torch.full((B, D + 1), -1, dtype=torch.long)
    out_path = torch.full((B, D + 1), -1, dtype=torch.long)
    num = torch.zeros(B, dtype=torch.long)
    uu = u.tolist()
    for b in range(B):
        children: dict[int, list[int]] = {}
        for n in range(1, N):
            if toks[b][n] >= 0 and pars[b][n] >= 0:
                children.setdefault(pars[b][n], []).append(n)
        node, a, ui = 0, 0, 0
        out_path[b, 0] = 0
        while True:
            dist = p[b, node].clone()
            nxt = -1
            for c in children.get(node, []):
                x = toks[b][c]
                total = float(dist.sum())
                if total <= 0:
                    break
                if uu[b][min(ui, N)] * total < float(dist[x]):
                    nxt = c
                    ui += 1
                    break
                ui += 1
                dist[x] = 0.0
            if nxt < 0:
                if float(dist.sum()) <= 0:                             # rounding: fall back to p
                    dist = p[b, node]
                cdf = dist.cumsum(0)
                x = int(torch.searchsorted(cdf, torch.tensor([uu[b][min(ui, N)] * float(cdf[-1])]), right=True)[0])
                out_tok[b, a] = min(x, V - 1)
                break
            out_tok[b, a] = toks[b][nxt]
            a += 1
            out_path[b, a] = nxt
            node = nxt
        num[b] = a
    dev = p.device
    return TreeVerdict(num.to(dev), out_tok.to(dev), out_path.to(dev))
