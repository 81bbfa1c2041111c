"""Staged speculation (Spector & Re 2023): the draft model is itself sped up by speculation.

Stage 2, prompt lookup over the sequence's prompt, output and drafts so far, proposes a continuation
for the draft model; the draft model scores it in one forward and keeps the longest prefix that equals
its own greedy choices, plus its own next token (exactly the tokens it would have drafted one by one).
Stage 1's drafts then go to the target as usual. The draft drafts greedily (point masses), so the
target's verification keeps the output exact under sampling too.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..tree import PAD
from ..verify import Draft, Verdict
from .base import ActiveBatch
from .draft_model import DraftModelProposer, same_prefix
from .ngram import NgramIndex


class StagedProposer:
    name = "staged"
    feature_layers: tuple[int, ...] = ()                 # the target layers it reads: none

    def __init__(self, draft: DraftModelProposer, n_min: int = 1, n_max: int = 4) -> None:
        self.draft, self.n_min, self.n_max = draft, n_min, n_max
        self.index: dict[int, NgramIndex] = {}
        self.fed_drafts = torch.zeros(0, dtype=torch.long)      # [B] provisional drafts in the draft's cache
        self.draft_forwards = 0                                 # draft-model forwards of the last propose
        self.last = torch.zeros(0, 0, dtype=torch.long)         # [B, k] the drafts of the last propose

    def allocate(self, rows: int, slots: int) -> None:
        self.draft.allocate(rows, slots)
        self.index = {}

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        self.draft.start(rows, prompts, hidden)
        for r, p in zip(rows.tolist(), prompts):
            self.index[r] = NgramIndex(self.n_min, self.n_max)
            self.index[r].update(p)

    def _guesses(self, rows: list[int], histories: list[list[int]], drafts: list[list[int]], room: list[int]) -> list[list[int]]:
        """Stage 2: per row, prompt lookup's continuation of history + drafts (up to room[i] tokens)."""
        out = []
        for r, h, d, m in zip(rows, histories, drafts, room):
            idx = self.index[r]
            idx.update(h)
            seq = h + d
            if m <= 0:
                out.append([])
                continue
            n, cont = idx.lookup(seq, m)
            if not cont and d:                                 # the drafts' own n-grams are not indexed
                tail = NgramIndex(self.n_min, self.n_max)
                tail.update(seq[-64:])
                n, cont = tail.lookup(seq[-64:], m)
            out.append(cont)
        return out

    @torch.inference_mode()
    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        d = self.draft
        dev = d.model.device
        rows = batch.rows.to(dev)
        B = rows.numel()
        nxt = d.catch_up(rows, batch.tokens).argmax(-1)                        # [B] each row's next draft
        drafts: list[list[int]] = [[] for _ in range(B)]
        self.fed_drafts = torch.zeros(B, dtype=torch.long, device=dev)
        self.draft_forwards = 1
        rl = rows.tolist()
        while True:
            for i in range(B):
                if len(drafts[i]) < k:
                    drafts[i].append(int(nxt[i]))
            room = [k - len(x) for x in drafts]
            if max(room) <= 0:
                break
            # a forward writes T scratch slots in every row's draft cache, so T is bounded by the fullest row's room
            # (near the end of the context a batch-mate's long guesses must not run it past its cache)
            free = int((d.cache.slots - d.cache.lengths[rows]).min())
            if free <= 0:
                break
            guesses = [g[:free - 1] for g in self._guesses(rl, batch.tokens, drafts, room)]
            T = 1 + max(len(g) for g in guesses)
            inp = torch.zeros(B, T, dtype=torch.long, device=dev)
            for i in range(B):
                inp[i, 0] = drafts[i][-1]
                inp[i, 1:1 + len(guesses[i])] = torch.tensor(guesses[i], dtype=torch.long)
            start = d.cache.lengths[rows]
            pos = (start[:, None] + torch.arange(T, device=dev)).clamp(max=d.model.max_seq_len - 1)
            greedy = d.model.lm_head(d.model(inp, pos, d.cache, rows)).argmax(-1)  # [B, T]
            self.draft_forwards += 1
            take = torch.zeros(B, dtype=torch.long, device=dev)
            for i in range(B):
                if room[i] <= 0:
                    continue                                    # this row is done: feeds nothing
                a = 0
                while a < len(guesses[i]) and a < room[i] - 1 and guesses[i][a] == int(greedy[i, a]):
                    a += 1
                drafts[i] += guesses[i][:a]                     # stage 2's guesses the draft agrees with
                take[i] = 1 + a                                 # the fed draft and those guesses stay
                nxt[i] = greedy[i, a]
            d.cache.commit(rows, torch.arange(T, device=dev).expand(B, T), take)
            self.fed_drafts += take
        tokens = torch.full((B, k), PAD, dtype=torch.long, device=dev)
        for i, x in enumerate(drafts):
            tokens[i, :len(x)] = torch.tensor(x[:k], dtype=torch.long)
        self.last = tokens
        return Draft(tokens)

    def forget(self) -> None:
        self.draft.forget()

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: Tensor) -> None:
        d = self.draft
        rows = batch.rows.to(d.model.device)
        if self.fed_drafts.numel() != rows.numel():             # a step without propose (K = 0)
            self.fed_drafts = torch.zeros(rows.numel(), dtype=torch.long, device=rows.device)
        keep = torch.minimum(verdict.num_accepted.to(rows.device), self.fed_drafts)
        keep = torch.minimum(keep, same_prefix(self.last, verdict.tokens, int(self.fed_drafts.max())))
        base = d.cache.lengths[rows] - self.fed_drafts
        d.cache.truncate(rows, base + keep)
        for r, n in zip(rows.tolist(), (base + keep).tolist()):
            d.fed[r] = n
        self.fed_drafts = torch.zeros(0, dtype=torch.long)
