"""Medusa proposer: a static tree of top-k candidates per head, verified in one target forward."""
from __future__ import annotations

import torch
from torch import Tensor

from ..models.medusa import MedusaHeads
from ..tree import TokenTree, TreeVerdict
from ..verify import Draft, Verdict
from .base import ActiveBatch

# Candidate paths as ranks into each head's top-k (Medusa-style static tree, 16 nodes).
DEFAULT_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (1, 0), (0, 2), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 0, 0),
)


class MedusaProposer:
    name = "medusa"

    def __init__(self, heads: MedusaHeads, tree: tuple[tuple[int, ...], ...] = DEFAULT_TREE) -> None:
        self.heads = heads
        self.paths = [p for p in tree if len(p) <= heads.n_heads]
        self.parent = [self.paths.index(p[:-1]) + 1 if len(p) > 1 else 0 for p in self.paths]
        self.topk = 1 + max(r for p in self.paths for r in p)
        self.feat: dict[int, Tensor] = {}

    def allocate(self, rows: int, slots: int) -> None:
        self.feat = {}

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        for i, (r, p) in enumerate(zip(rows.tolist(), prompts)):
            self.feat[r] = hidden[i, len(p) - 2]                     # the last prompt token's feature

    def commit(self, batch: ActiveBatch, verdict: Verdict | TreeVerdict, hidden: Tensor) -> None:
        last = verdict.path.gather(1, verdict.num_accepted[:, None])[:, 0]
        for i, r in enumerate(batch.rows.tolist()):
            self.feat[r] = hidden[i, last[i]]

    @torch.inference_mode()
    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        B = batch.rows.numel()
        f = torch.stack([self.feat[r] for r in batch.rows.tolist()])  # [B, H]
        top = self.heads.logits(f, self.heads.w_sub).topk(self.topk, -1).indices   # [B, K, topk]
        ids = self.heads.vocab_ids.to(f.device)
        paths = [p for p in self.paths if len(p) <= k]
        n = len(paths)
        tok = torch.empty(B, n + 1, dtype=torch.long, device=f.device)
        tok[:, 0] = torch.tensor([t[-1] for t in batch.tokens], device=f.device)
        par = torch.full((B, n + 1), -1, dtype=torch.long, device=f.device)
        for j, p in enumerate(paths):
            d = len(p) - 1
            tok[:, j + 1] = ids[top[:, d, p[-1]]]
            par[:, j + 1] = self.parent[self.paths.index(p)]
        return Draft(torch.zeros(B, 1, dtype=torch.long, device=f.device), None, TokenTree(tok, par))
