"""Self-speculation: the target's first N layers and a trained exit draft, and their work is reused.

Drafting runs the target's own layers 0..N-1 on the pending token and every draft (one more
single-token forward than a separate draft needs, for the last draft), so the rows the target scores
already have those layers' keys, values and residual stream. The draft hands them over (`Draft.reuse`)
and the verification forward runs only layers N..L-1 (`Transformer.forward_reusing`). With
row-invariant kernels those bits equal what the full forward would compute, so greedy output stays
plain decoding's (tests/test_self.py checks the target's cache bit for bit).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..models.early_exit import EarlyExitDraft
from ..prefix_cache import PREFILL_PIECE
from ..verify import Draft, Reuse
from .base import ActiveBatch
from .draft_model import DraftModelProposer


class SelfProposer(DraftModelProposer):
    name = "self"

    def __init__(self, draft: EarlyExitDraft, min_confidence: float = 0.0) -> None:
        super().__init__(draft, sample_drafts=True, min_confidence=min_confidence)
        self.streams: list[Tensor] = []                         # [B, H] per draft forward: the fed token's stream

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        """Prefill the draft's N layers in the pieces the engine prefills the target in (ending at multiples of
        PREFILL_PIECE): a position's bits depend on its piece's shape where prefill kernels are not
        row-invariant (the 4-bit mode's dense prefill), and the reused layers must see the target's own."""
        self.cache.truncate(rows, torch.zeros_like(rows))
        dev = self.model.device
        for r, tokens in zip(rows.tolist(), prompts):
            n = len(tokens) - 1                                  # the prompt; its first token comes with propose
            row = torch.tensor([r], device=dev)
            for a in range(0, n, PREFILL_PIECE):
                b = min(n, a + PREFILL_PIECE)
                self.model.prefill(torch.tensor([tokens[a:b]], device=dev), torch.arange(a, b, device=dev)[None],
                                   self.cache, row)
                self.cache.commit(row, torch.arange(b - a, device=dev)[None], torch.tensor([b - a], device=dev))
            self.fed[r] = n

    def _step(self, tokens: Tensor, rows: Tensor, take: Tensor) -> Tensor:
        logits = super()._step(tokens, rows, take)
        s = self.model.last_stream                              # [B, T, H]
        self.streams.append(s[torch.arange(s.shape[0], device=s.device), take - 1])
        return logits

    def catch_up(self, rows: Tensor, histories: list[list[int]]) -> Tensor:
        logits = super().catch_up(rows, histories)
        self.streams = self.streams[-1:]                        # the pending token's (a long catch-up takes several steps)
        return logits

    @torch.inference_mode()
    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        self.streams = []
        draft = super().propose(batch, k)
        B, K = draft.tokens.shape
        rows = batch.rows.to(self.model.device)
        if len(self.streams) == K:                              # the last draft's layers too (logits unused)
            self._step(draft.tokens[:, K - 1:].clamp(min=0), rows, torch.ones(B, dtype=torch.long, device=rows.device))
            self.drafted += 1
        hidden = torch.stack(self.streams, 1)                   # [B, m, H] pending, then fed drafts
        if hidden.shape[1] < K + 1:                             # drafting stopped early: rows past it are PAD
            hidden = torch.cat([hidden, hidden.new_zeros(B, K + 1 - hidden.shape[1], hidden.shape[2])], 1)
        start = self.cache.lengths[rows] - 1 - self.drafted                       # [B] the pending token's slot
        slots = (start[:, None] + torch.arange(K + 1, device=rows.device)).clamp(max=self.cache.slots - 1)
        k, v = self.cache.gather(rows, slots)                   # [N, B, n_kv, K+1, hd] each
        return Draft(draft.tokens, draft.probs, reuse=Reuse(k.shape[0], hidden, k, v), sampled=draft.sampled)
