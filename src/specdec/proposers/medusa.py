"""Medusa proposer: a static tree of top-k candidates per head, verified in one target forward."""
from __future__ import annotations

import torch
from torch import Tensor

from ..models.medusa import MedusaHeads
from ..verify import ROOT, Draft, Verdict
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
    feature_layers: tuple[int, ...] = ()                 # the target layers it reads: none

    def __init__(self, heads: MedusaHeads, tree: tuple[tuple[int, ...], ...] = DEFAULT_TREE) -> None:
        self.heads = heads
        self.paths = [p for p in tree if len(p) <= heads.n_heads]
        self.topk = 1 + max(r for p in self.paths for r in p)
        self.feat: dict[int, Tensor] = {}
        self.dim = heads.target[0].config.dim                   # hidden may carry features after it

    def allocate(self, rows: int, slots: int) -> None:
        self.feat = {}

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        for i, (r, p) in enumerate(zip(rows.tolist(), prompts)):
            self.feat[r] = hidden[i, len(p) - 2, :self.dim]         # the last prompt token's final hidden state

    def forget(self) -> None:
        pass                          # nothing outlives a request

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: Tensor) -> None:
        last = verdict.path.gather(1, verdict.num_accepted[:, None])[:, 0]
        for i, r in enumerate(batch.rows.tolist()):
            self.feat[r] = hidden[i, last[i], :self.dim]         # (wider when the target returns features)

    @torch.inference_mode()
    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        """The static tree's paths of up to k tokens: path (r_1, .., r_d) drafts head d's r_d-th best token
        under its prefix path."""
        B = batch.rows.numel()
        f = torch.stack([self.feat[r] for r in batch.rows.tolist()])  # [B, H]
        top = self.heads.logits(f, self.heads.w_sub).topk(self.topk, -1).indices   # [B, heads, topk]
        ids = self.heads.vocab_ids.to(f.device)
        paths = [p for p in self.paths if len(p) <= k]
        tok = torch.empty(B, len(paths), dtype=torch.long, device=f.device)
        for j, p in enumerate(paths):
            tok[:, j] = ids[top[:, len(p) - 1, p[-1]]]
        parents = torch.tensor([paths.index(p[:-1]) if len(p) > 1 else ROOT for p in paths], device=f.device)
        return Draft(tok, parents=parents.expand(B, len(paths)))
