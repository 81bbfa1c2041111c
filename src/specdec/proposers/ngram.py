"""Prompt lookup (n-gram) proposer: no model.

Match the longest recent n-gram (n in [n_min, n_max]) ending at the last token
of prompt + generated text to an earlier occurrence and propose what followed
it. Each sequence keeps an index {n-gram: end position of its latest earlier
occurrence}, updated incrementally: O(n_max) work per new token, no rescans.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import SpecdecError
from ..tree import PAD
from ..verify import Draft, Verdict
from .base import ActiveBatch


class NgramIndex:
    """Latest occurrence of every n-gram of one token sequence (n_min..n_max)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0              # n-grams ending before this position are indexed

    def update(self, tokens: list[int]) -> None:
        """Index n-grams ending at positions < len(tokens) - 1 (so each has a continuation)."""
        for end in range(self.indexed, len(tokens) - 1):            # n-gram tokens[end-n+1 : end+1]
            for n, m in self.maps.items():
                if end + 1 >= n:
                    m[tuple(tokens[end - n + 1:end + 1])] = end + 1
        self.indexed = max(self.indexed, len(tokens) - 1)

    def lookup(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """(n, continuation of up to k tokens) of the longest n-gram suffix seen before; (0, []) if none."""
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(tokens) < n:
                continue
            start = self.maps[n].get(tuple(tokens[-n:]))
            if start is not None:
                return n, tokens[start:start + k]
        return 0, []


class NgramProposer:
    name = "ngram"
    feature_layers: tuple[int, ...] = ()                 # the target layers it reads: none

    def __init__(self, n_min: int = 1, n_max: int = 4) -> None:
        if not (1 <= n_min <= n_max <= 64):
            raise SpecdecError(f"n-gram range must satisfy 1 <= n_min <= n_max <= 64, got [{n_min}, {n_max}]")
        self.n_min, self.n_max = n_min, n_max
        self.index: dict[int, NgramIndex] = {}

    def allocate(self, rows: int, slots: int) -> None:
        self.index = {}

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        for r, p in zip(rows.tolist(), prompts):
            self.index[r] = NgramIndex(self.n_min, self.n_max)
            self.index[r].update(p)

    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        return Draft(self.match(batch, k)[1].to(batch.rows.device))

    def match(self, batch: ActiveBatch, k: int) -> tuple[Tensor, Tensor]:
        """Per sequence the matched n-gram length [B] (0 = no match) and its continuation [B, k] (PAD = none)."""
        n = torch.zeros(len(batch.tokens), dtype=torch.long)
        out = torch.full((len(batch.tokens), k), PAD, dtype=torch.long)
        for i, (r, toks) in enumerate(zip(batch.rows.tolist(), batch.tokens)):
            idx = self.index[r]
            idx.update(toks)
            n[i], cont = idx.lookup(toks, k)
            if cont:
                out[i, :len(cont)] = torch.tensor(cont)
        return n, out

    def forget(self) -> None:
        pass                          # nothing outlives a request

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: Tensor) -> None:
        pass                          # the index catches up lazily in propose
