"""Predicted outputs (OpenAI's `prediction`): the text the client expects back is a draft source.

Wraps the method's own proposer. A sequence with a prediction drafts the prediction's continuation
at its alignment point (after the tokens committed so far); after a mismatch it re-aligns on the
prediction the way prompt lookup re-finds an n-gram (the longest suffix of its output, up to 8
tokens, seen in the prediction), so one changed line does not end the speculation. Where the
prediction has nothing to offer, the row keeps the wrapped proposer's draft (the wrapped proposer is
not run at all in a step where every row follows its prediction). How far a row drafts ahead adapts
like the well-known heuristic: up to `k_prediction` while the prediction keeps being accepted, two past
the accepted ones after a rejection (a changed passage costs few rows). Prediction drafts are point
masses (one-hot q where the wrapped proposer samples its drafts), so verification keeps the output
exactly the target's.
"""
from __future__ import annotations

import bisect

import torch
from torch import Tensor

from ..tree import PAD
from ..verify import ROOT, Draft, Verdict
from .base import ActiveBatch, Proposer

ALIGN_NGRAM = 8              # longest output suffix matched against the prediction when re-aligning
MAX_AHEAD = 64               # cap of the adaptive prediction draft length (the engine's k_prediction bounds it too)


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


class PredictionProposer:
    """The wrapped proposer, with drafts from the predictions of the sequences that have one."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.name = inner.name
        self.index: dict[int, PredictionIndex] = {}
        self.prompt_len: dict[int, int] = {}
        self.from_prediction = torch.zeros(0, dtype=torch.bool)   # [B] rows drafted from a prediction, last step
        self.drafted: list[int] = []                              # [B] prediction drafts per row, last step

    def allocate(self, rows: int, slots: int) -> None:
        self.inner.allocate(rows, slots)
        self.index = {}

    def start_predictions(self, rows: list[int], predictions: list[tuple[int, ...]], prompt_lens: list[int]) -> None:
        for r, p, n in zip(rows, predictions, prompt_lens):
            self.prompt_len[r] = n
            if p:
                self.index[r] = PredictionIndex(p)
            else:
                self.index.pop(r, None)

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        self.inner.start(rows, prompts, hidden)
        for r, toks in zip(rows.tolist(), prompts):
            if r in self.index:                                # the first token came with the prefill
                self.index[r].advance(toks[self.prompt_len[r]:], toks[self.prompt_len[r]:], 0)

    def propose(self, batch: ActiveBatch, k: int, k_prediction: int) -> Draft:
        """Up to k drafts of the wrapped proposer per row, or up to k_prediction from the row's prediction."""
        rows = batch.rows.tolist()
        B, dev = len(rows), batch.rows.device
        conts = [self.index[r].continuation(k_prediction) if r in self.index and k_prediction else [] for r in rows]
        self.drafted = [len(c) for c in conts]
        self.from_prediction = torch.tensor([bool(c) for c in conts], dtype=torch.bool)
        if k and not all(conts):
            draft = self.inner.propose(batch, k)
        else:
            draft = Draft.empty(B, dev)
        if not bool(self.from_prediction.any()):
            return draft
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
        if probs is not None:                                                  # one-hot q on prediction rows
            V = probs.shape[-1]
            q = torch.zeros(B, width, V, dtype=probs.dtype, device=dev)
            q[:, :probs.shape[1]] = probs
            for i, c in enumerate(conts):
                if c:
                    q[i] = 0
                    q[i, torch.arange(len(c)), torch.tensor(c)] = 1
            probs = q
        return Draft(tokens, probs, parents)

    def forget(self) -> None:
        self.inner.forget()

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: Tensor) -> None:
        self.inner.commit(batch, verdict, hidden)
        n = verdict.num_new.tolist()
        for i, r in enumerate(batch.rows.tolist()):
            if r in self.index:
                out = batch.tokens[i][self.prompt_len[r]:]
                self.index[r].advance(out[len(out) - n[i]:], out, self.drafted[i] if self.drafted else 0)
        self.drafted = []
