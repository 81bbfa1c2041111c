"""Hybrid proposer: prompt lookup where the text repeats itself, an EAGLE chain elsewhere.

The two are complementary (measured on the mini suite): prompt lookup wins where the
answer copies its context (code, summaries, multi-turn chat), the EAGLE head where it
does not (QA, math, RAG). Per sequence and step, if the longest n-gram suffix of the
text seen before is at least `min_match` tokens long, its continuation is the draft;
otherwise the EAGLE head drafts a chain. Prompt lookup drafts point masses; the EAGLE chain
too, or, for rows sampling at its `sample_from` temperature and above, drafts drawn from its q
(`Draft.sampled` marks those rows; each row is verified by its own rule, so the output is the
target's, exactly).
The EAGLE head takes every committed token's features either way (when its sequence next
drafts with it, in one forward), so it always drafts from exact features.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ..errors import SpecdecError
from ..tree import PAD
from ..verify import Draft, Verdict
from .base import ActiveBatch, Proposer
from .eagle import EagleProposer


class Matcher(Proposer, Protocol):
    """A proposer that also tells how long a suffix of each history it matched (prompt lookup, suffix decoding)."""

    def match(self, batch: ActiveBatch, k: int) -> tuple[Tensor, Tensor]:
        """([B] matched suffix lengths, [B, k] the drafts of that match, PAD-padded)."""
        ...


class HybridProposer:
    name = "hybrid"
    feature_layers: tuple[int, ...] = ()                 # its EAGLE head's

    def __init__(self, eagle: EagleProposer, ngram: Matcher, min_match: int = 2) -> None:
        """ngram: prompt lookup, or suffix decoding in its place."""
        if eagle.topk != 1:
            raise SpecdecError("the hybrid proposer drafts chains: its EAGLE proposer needs topk = 1")
        self.eagle, self.ngram, self.min_match = eagle, ngram, min_match
        self.feature_layers = eagle.feature_layers
        self.steps_ngram = 0          # sequence-steps drafted by prompt lookup / by EAGLE (for reports)
        self.steps_eagle = 0

    @property
    def head(self) -> torch.nn.Module:
        """The EAGLE head it drafts with where prompt lookup misses (what `serve --learn` trains)."""
        return self.eagle.head

    def allocate(self, rows: int, slots: int) -> None:
        self.eagle.allocate(rows, slots)
        self.ngram.allocate(rows, slots)

    def start(self, rows: torch.Tensor, prompts: list[list[int]], hidden: torch.Tensor) -> None:
        self.eagle.start(rows, prompts, hidden)
        self.ngram.start(rows, prompts, hidden)

    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        n, tokens = self.ngram.match(batch, k)                       # [B], [B, k]
        tokens = tokens.to(batch.rows.device)
        need = (n < self.min_match).nonzero().flatten().tolist()     # sequences EAGLE drafts for
        self.steps_eagle += len(need)
        self.steps_ngram += len(batch.tokens) - len(need)
        if not need:
            return Draft(tokens)
        idx = torch.tensor(need, device=batch.rows.device)
        sub = batch if len(need) == len(batch.tokens) else ActiveBatch(        # (the whole batch: nothing to select)
            batch.rows[idx], [batch.tokens[i] for i in need], batch.sampling.select(idx), batch.seeds[idx])
        e = self.eagle.propose(sub, k)                               # tokens [b, <=k]
        tokens[idx] = PAD
        tokens[idx, :e.tokens.shape[1]] = e.tokens
        if e.probs is None or not bool(e.sampled.any()):
            return Draft(tokens)
        # some EAGLE rows drew their drafts from q: the others' q is one-hot (point masses, verified as such)
        B, K, V = tokens.shape[0], tokens.shape[1], e.probs.shape[-1]
        q = torch.zeros(B, K, V, dtype=e.probs.dtype, device=tokens.device)
        q.scatter_(-1, tokens.clamp(min=0)[..., None], (tokens != PAD)[..., None].to(q.dtype))
        q[idx] = 0
        q[idx, :e.probs.shape[1]] = e.probs
        sampled = torch.zeros(B, dtype=torch.bool, device=tokens.device)
        sampled[idx] = e.sampled.to(tokens.device)
        return Draft(tokens, q, sampled=sampled)

    def forget(self) -> None:
        self.eagle.forget()
        self.ngram.forget()

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: torch.Tensor) -> None:
        self.eagle.commit(batch, verdict, hidden)
        self.ngram.commit(batch, verdict, hidden)
