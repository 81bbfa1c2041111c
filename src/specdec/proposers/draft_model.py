"""A separate small draft model with its own KV cache.

Drafting feeds the tokens the draft has not seen yet (the last committed ones),
then k-1 of its own guesses one at a time, committing them provisionally; after
verification the cache is truncated back to the accepted prefix.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..models.attention import INVARIANT_MAX_T
from ..models.base import CausalLM
from ..sampling import Stream, argmax, position_uniforms, sample, step_seeds, to_probs
from ..tree import PAD
from ..verify import Draft, Verdict
from .base import ActiveBatch


def same_prefix(drafts: Tensor, committed: Tensor, n: int) -> Tensor:
    """[B] how many of the first n drafts [B, k] equal the committed tokens [B, D] (a wrapper, e.g.
    predicted outputs, may have scored other drafts than these)."""
    n = min(n, drafts.shape[1], committed.shape[1])
    if n == 0:
        return torch.zeros(committed.shape[0], dtype=torch.long, device=committed.device)
    return (drafts[:, :n].to(committed.device) == committed[:, :n]).long().cumprod(-1).sum(-1)


class DraftModelProposer:
    name = "draft"
    feature_layers: tuple[int, ...] = ()                 # the target layers it reads: none

    def __init__(self, model: CausalLM, sample_drafts: bool = True, min_confidence: float = 0.0) -> None:
        self.model = model
        self.sample_drafts = sample_drafts          # False: draft greedily even when the target samples
        self.min_confidence = min_confidence        # a sequence stops drafting below this top probability
        self.fed: dict[int, int] = {}               # row -> history tokens in the draft cache
        self.drafted = 0                            # provisional tokens committed in the last propose
        self.last = torch.zeros(0, 0, dtype=torch.long)   # [B, k] the drafts of the last propose

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
        """Up to k drafts per sequence: sampled from the draft's q (with the sequence's transform) where
        the sequence samples and sample_drafts is on, its argmax otherwise. A sequence stops drafting
        where its own confidence (the top probability it drafts from) falls below min_confidence; the
        batch drafts until every sequence has stopped, and no sequence's draws depend on how long."""
        dev = self.model.device
        rows = batch.rows.to(dev)
        B = rows.numel()
        logits = self.catch_up(rows, batch.tokens)                             # [B, V] for the first draft
        samples = (batch.sampling.temperature.to(dev) > 0) & self.sample_drafts  # [B] rows that sample drafts
        sampled = bool(samples.any())
        first = torch.tensor([len(t) for t in batch.tokens], device=dev)        # [B] the first draft's position
        u = position_uniforms(step_seeds(batch.seeds.to(dev), first),
                              first[:, None] + torch.arange(k, device=dev), Stream.DRAFT)   # [B, k]
        tokens = torch.full((B, k), PAD, dtype=torch.long, device=dev)
        qs: list[Tensor] = []
        alive = torch.ones(B, dtype=torch.bool, device=dev)
        self.drafted = 0
        for i in range(k):
            if sampled:
                qs.append(to_probs(logits[:, None], batch.sampling)[:, 0])      # [B, V]; greedy rows: one-hot
                x = sample(qs[-1], u[:, i])
            else:
                x = argmax(logits)
            if i > 0 and self.min_confidence > 0:
                conf = torch.softmax(logits.float(), -1).amax(-1)               # [B] rows drafting greedily
                if sampled:
                    conf = torch.where(samples, qs[-1].amax(-1), conf)          # rows sampling: their q's top
                alive &= conf >= self.min_confidence
            tokens[:, i] = torch.where(alive, x, torch.full_like(x, PAD))
            if i == k - 1 or not bool(alive.any()):
                break
            logits = self._step(x[:, None], rows, torch.ones(B, dtype=torch.long, device=dev))
            self.drafted += 1
        self.last = tokens
        if not sampled:
            return Draft(tokens)
        probs = torch.stack(qs, 1)                                              # [B, <=k, V]
        if probs.shape[1] < k:
            probs = torch.cat([probs, torch.zeros(B, k - probs.shape[1], probs.shape[2], device=dev)], 1)
        return Draft(tokens, probs)

    def catch_up(self, rows: Tensor, histories: list[list[int]]) -> Tensor:
        """Feed every row the history tokens its cache lacks; the draft's logits [B, V] after the last.

        In forwards of at most INVARIANT_MAX_T tokens: longer ones take other kernels (SDPA), whose bits
        differ from what the target computed for the same tokens one step at a time, and a self-speculative
        draft hands its keys and values to verification (a long followed prediction, or many steps
        without drafts, leave that many tokens to catch up)."""
        dev = self.model.device
        new = [t[self.fed[r]:] for r, t in zip(rows.tolist(), histories)]
        for r, t in zip(rows.tolist(), histories):
            self.fed[r] = len(t)
        while True:
            long = [i for i, n in enumerate(new) if len(n) > INVARIANT_MAX_T]
            if not long:
                break
            idx = torch.tensor(long, device=dev)
            inp = torch.tensor([new[i][:INVARIANT_MAX_T] for i in long], device=dev)     # [b, T]
            self._step(inp, rows[idx], torch.full((len(long),), INVARIANT_MAX_T, device=dev))
            for i in long:
                new[i] = new[i][INVARIANT_MAX_T:]
        take = torch.tensor([len(n) for n in new], device=dev)
        inp = torch.zeros(len(new), int(take.max()), dtype=torch.long, device=dev)
        for i, n in enumerate(new):
            inp[i, :len(n)] = torch.tensor(n)
        return self._step(inp, rows, take)

    def forget(self) -> None:
        pass                          # nothing outlives a request

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: Tensor) -> None:
        rows = batch.rows.to(self.model.device)
        keep = verdict.num_accepted.to(rows.device).clamp(max=self.drafted)   # drafted tokens that stay in the cache
        keep = torch.minimum(keep, same_prefix(self.last, verdict.tokens, self.drafted))
        base = self.cache.lengths[rows] - self.drafted
        self.cache.truncate(rows, base + keep)
        for r, n in zip(rows.tolist(), (base + keep).tolist()):
            self.fed[r] = n
        self.drafted = 0                      # a step without propose (K = 0) has nothing to roll back
