"""A separate small draft model with its own KV cache.

Drafting feeds the tokens the draft has not seen yet (the last committed ones),
then k-1 of its own guesses one at a time, committing them provisionally; after
verification the cache is truncated back to the accepted prefix.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..models.base import CausalLM
from ..sampling import sample, to_probs, uniforms
from ..verify import Draft, Verdict
from .base import ActiveBatch


class DraftModelProposer:
    name = "draft"

    def __init__(self, model: CausalLM, sample_drafts: bool = True, min_confidence: float = 0.0) -> None:
        self.model = model
        self.sample_drafts = sample_drafts          # False: draft greedily even when the target samples
        self.min_confidence = min_confidence        # stop a sequence's drafting below this top probability
        self.fed: dict[int, int] = {}               # row -> history tokens in the draft cache
        self.drafted = 0                            # provisional tokens committed in the last propose

    def allocate(self, rows: int, slots: int) -> None:
        self.cache = self.model.new_cache(rows, slots)

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        """Prefill the draft on each new sequence but its last token (which the first propose feeds), one
        sequence per forward: the batch it joins may be at any length, and a padded catch-up over all
        rows would write a whole prompt of scratch after the longest of them."""
        self.cache.truncate(rows, torch.zeros_like(rows))
        dev = self.model.device
        for r, tokens in zip(rows.tolist(), prompts):
            n = len(tokens) - 1
            if n > 0:
                row = torch.tensor([r], device=dev)
                self.model.prefill(torch.tensor([tokens[:n]], device=dev), torch.arange(n, device=dev)[None],
                                   self.cache, row)
                self.cache.commit(row, torch.arange(n, device=dev)[None], torch.tensor([n], device=dev))
            self.fed[r] = n

    def _step(self, tokens: Tensor, rows: Tensor, take: Tensor) -> Tensor:
        """Feed tokens [B, T]; commit `take` [B] of them; return logits [B, V] at index take-1."""
        dev = self.model.device
        start = self.cache.lengths[rows]
        pos = (start[:, None] + torch.arange(tokens.shape[1], device=dev)).clamp(max=self.model.max_seq_len - 1)
        h = self.model(tokens, pos, self.cache, rows)
        self.cache.commit(rows, torch.arange(tokens.shape[1], device=dev).expand_as(tokens), take)
        return self.model.lm_head(h[torch.arange(h.shape[0], device=dev), take - 1])

    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        dev = self.model.device
        rows = batch.rows.to(dev)
        B = rows.numel()
        new = [t[self.fed[r]:] for r, t in zip(rows.tolist(), batch.tokens)]
        take = torch.tensor([len(n) for n in new], device=dev)
        inp = torch.zeros(B, int(take.max()), dtype=torch.long, device=dev)
        for i, n in enumerate(new):
            inp[i, :len(n)] = torch.tensor(n)
        for r, t in zip(rows.tolist(), batch.tokens):
            self.fed[r] = len(t)
        greedy_only = bool((batch.sampling.temperature <= 0).all()) or not self.sample_drafts
        tokens = torch.full((B, k), -1, dtype=torch.long, device=dev)
        qs: list[Tensor] = []
        alive = torch.ones(B, dtype=torch.bool, device=dev)
        logits = self._step(inp, rows, take)
        self.drafted = 0
        for i in range(k):
            if greedy_only:
                x = logits.argmax(-1)
                conf = torch.softmax(logits, -1).amax(-1) if self.min_confidence > 0 else None
            else:
                q = to_probs(logits[:, None], batch.sampling)[:, 0]             # [B, V]
                x = sample(q, uniforms(batch.rngs, 1, dev)[:, 0])
                qs.append(q)
                conf = q.amax(-1)
            if conf is not None and i > 0:
                alive &= conf >= self.min_confidence
            tokens[:, i] = torch.where(alive, x, torch.full_like(x, -1))
            if i == k - 1 or not bool(alive.any()):
                break
            logits = self._step(x[:, None], rows, torch.ones(B, dtype=torch.long, device=dev))
            self.drafted += 1
        probs = torch.stack(qs, 1) if qs else None
        if probs is not None and probs.shape[1] < k:
            probs = torch.cat([probs, torch.zeros(B, k - probs.shape[1], probs.shape[2], device=dev)], 1)
        return Draft(tokens, probs)

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: Tensor) -> None:
        rows = batch.rows.to(self.model.device)
        keep = verdict.num_accepted.to(rows.device).clamp(max=self.drafted)   # drafted tokens that stay in the cache
        base = self.cache.lengths[rows] - self.drafted
        self.cache.truncate(rows, base + keep)
        for r, n in zip(rows.tolist(), (base + keep).tolist()):
            self.fed[r] = n
        self.drafted = 0                      # a step without propose (K = 0) has nothing to roll back
