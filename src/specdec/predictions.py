"""Predicted outputs (OpenAI's `prediction`): the text the client expects back is a draft source.

A prediction belongs to a request, not to a method: the engine drafts from it for any method (`none`
included) and runs the method's proposer for the rows without one. A sequence with a prediction drafts
the prediction's continuation at its alignment point (after the tokens committed so far); after a
mismatch it re-aligns on the prediction the way prompt lookup re-finds an n-gram (the longest suffix of
its output, up to 8 tokens, seen in the prediction), so one changed line does not end the speculation.
Where the prediction has nothing to offer, the row keeps the method's draft (the proposer is not run at
all in a step where every row follows its prediction). How far a row drafts ahead adapts like the
well-known heuristic: up to PREDICTION_DRAFT_TOKENS while the prediction keeps being accepted, two past
the accepted ones after a rejection (a changed passage costs few rows). Prediction drafts are point
masses (one-hot q where the method samples its drafts), so verification keeps the output exactly the
target's.
"""
from __future__ import annotations

import bisect

import torch

from .tree import PAD
from .verify import ROOT, Draft

ALIGN_NGRAM = 8              # longest output suffix matched against the prediction when re-aligning
MAX_AHEAD = 64               # cap of the adaptive prediction draft length (PREDICTION_DRAFT_TOKENS bounds it too)
PREDICTION_DRAFT_TOKENS = 8  # drafts per step while a sequence follows its prediction (point masses, mostly accepted)


class PredictionIndex:
    """One prediction's tokens, where each n-gram (n <= ALIGN_NGRAM) occurs, and the alignment point."""

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens
        self.ends: dict[tuple[int, ...], list[int]] = {}      # n-gram -> positions after its occurrences, ascending
        for end in range(1, len(tokens) + 1):
            for n in range(1, min(ALIGN_NGRAM, end) + 1):
                self.ends.setdefault(tokens[end - n:end], []).append(end)
        self.at = 0                                           # where the next output token should be
        self.last = 0                                         # the last point the output was aligned at
        self.ahead = MAX_AHEAD                                # how many tokens to draft next step

    def align(self, output: list[int]) -> None:
        """Re-find the point after the longest suffix of `output` seen in the prediction, at its first
        occurrence after the last alignment point if there is one (an edit moves forward through the
        text: a short suffix such as `(` occurs all over it), else its first (-1: none)."""
        for n in range(min(ALIGN_NGRAM, len(output)), 0, -1):
            ends = self.ends.get(tuple(output[-n:]))
            if ends is not None:
                i = bisect.bisect_right(ends, self.last)
                self.at = self.last = ends[i] if i < len(ends) else ends[0]
                return
        self.at = -1

    def advance(self, new: list[int], output: list[int], drafted: int) -> None:
        """The step committed `new` (output ends with them) after `drafted` prediction drafts (0: the
        row did not draft from the prediction): follow the prediction, or re-align."""
        if drafted:
            accepted = len(new) - 1
            self.ahead = MAX_AHEAD if accepted >= drafted else min(MAX_AHEAD, accepted + 2)
        if self.at >= 0 and list(self.tokens[self.at:self.at + len(new)]) == new:
            self.at += len(new)
            self.last = self.at
        else:
            self.align(output)

    def continuation(self, k: int) -> list[int]:
        return list(self.tokens[self.at:self.at + min(k, self.ahead)]) if self.at >= 0 else []


class Predictions:
    """The predictions of the sequences that have one, by cache row, and where each one is aligned."""

    def __init__(self) -> None:
        self.index: dict[int, PredictionIndex] = {}

    def reset(self) -> None:
        self.index = {}

    def __bool__(self) -> bool:
        """Whether any sequence has a prediction."""
        return bool(self.index)

    def start(self, rows: list[int], predictions: list[tuple[int, ...]], outputs: list[list[int]]) -> None:
        """New sequences in `rows`, with their predictions (empty: none) and outputs so far (the first token)."""
        for r, p, out in zip(rows, predictions, outputs):
            self.index.pop(r, None)
            if p:
                self.index[r] = PredictionIndex(p)
                self.index[r].advance(out, out, 0)

    def continuations(self, rows: list[int], k: int) -> list[list[int]]:
        """Per row, up to k tokens of its prediction's continuation ([] without one, or where it has none)."""
        return [self.index[r].continuation(k) if r in self.index and k > 0 else [] for r in rows]

    def commit(self, rows: list[int], outputs: list[list[int]], num_new: list[int], drafted: list[int]) -> None:
        """Each row committed its last num_new tokens of `outputs` after `drafted` prediction drafts."""
        for r, out, n, d in zip(rows, outputs, num_new, drafted):
            if r in self.index:
                self.index[r].advance(out[len(out) - n:], out, d)


def with_predictions(draft: Draft, conts: list[list[int]]) -> Draft:
    """`draft` (the method's; chain or tree) with each row that has a continuation drafting it as a chain instead
    (point masses, verified as such, with a one-hot q where the method samples its drafts); `predicted` marks
    those rows."""
    if not any(conts):
        return draft
    B, dev = len(conts), draft.tokens.device
    width = max(draft.tokens.shape[1], max(len(c) for c in conts))
    tokens = torch.full((B, width), PAD, dtype=torch.long, device=dev)
    tokens[:, :draft.tokens.shape[1]] = draft.tokens
    parents = torch.full((B, width), ROOT, dtype=torch.long, device=dev)
    parents[:, :draft.parents.shape[1]] = draft.parents
    chain = torch.arange(-1, width - 1, device=dev)                        # ROOT, 0, 1, ...
    for i, c in enumerate(conts):
        if c:
            tokens[i] = PAD
            tokens[i, :len(c)] = torch.tensor(c, dtype=torch.long)
            parents[i] = chain
    if draft.is_chain:
        parents = chain.expand(B, width)
    probs = draft.probs
    if probs is not None:
        q = torch.zeros(B, width, probs.shape[-1], dtype=probs.dtype, device=dev)
        q[:, :probs.shape[1]] = probs
        for i, c in enumerate(conts):
            if c:
                q[i] = 0
                q[i, torch.arange(len(c)), torch.tensor(c)] = 1
        probs = q
    predicted = torch.tensor([bool(c) for c in conts], dtype=torch.bool, device=dev)
    return Draft(tokens, probs, parents, predicted=predicted, sampled=draft.sampled & ~predicted)
