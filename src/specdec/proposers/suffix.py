"""Suffix decoding (Oliaro et al., NeurIPS 2025): frequent continuations of the output's suffix, no model.

Two indexes of continuation counts: one per sequence over its prompt and output, and one shared over
the outputs of every request this proposer has served for the same tenant (`Request.tenant`: a server
keeps one per API key, so that no client's acceptance depends on another's requests; bounded: the
least recently used contexts are dropped past `max_contexts` per tenant, the least recently used tenants past
MAX_TENANTS or past `max_total_contexts` over all of them). Each maps a context (the last m tokens, m = 1..max_match) to how
often each token followed it. A step matches the longest suffix of the sequence seen before, then
grows a token tree best-first by estimated probability (counts of the longest matching context;
the sequence's own counts weigh `local_weight` times the shared ones), keeping nodes whose
probability stays above `min_prob`, up to min(`budget`, K) nodes (a step scores no more rows than a
chain of K would: on a CPU every scored row costs) and depth K; a match of m tokens drafts at most
`match_factor` * m of them (as SuffixDecoding's `max_spec_factor`: one token of context is weak evidence
whatever its counts, and a rejected draft still costs its row). A pattern seen often and matched long
yields a deep chain, an ambiguous one a bushy tree, a weak match a small one. A step drafts the tree only
where its expected accepted tokens (the sum of its nodes' estimated probabilities) beat the most probable
chain's by TREE_COST (a tree forward cost that much more than a chain's with torch's tree attention; with the
native attention about the same, so the factor is conservative). Drafts
are point masses: lossless.
"""
from __future__ import annotations

import heapq
from collections import Counter, OrderedDict

import torch
from torch import Tensor

from ..errors import SpecdecError
from ..tree import PAD
from ..verify import ROOT, Draft, Verdict
from .base import ActiveBatch


TREE_COST = 1.3      # a tree forward over n nodes / a chain forward over n tokens (benchmarks/forward_cost.py,
                     # smollm2-135m q4: 1.29-1.35x for 3-9 rows: the exact tree's per-node tail key blocks)
MAX_TENANTS = 64     # shared indexes kept (one per tenant; the least recently used is dropped beyond)
MAX_TOTAL_CONTEXTS = 1_200_000   # contexts over all tenants' shared indexes (about 440 bytes each: ~500 MiB)
MATCH_FACTOR = 2.0   # drafts per matched token (benchmarks/replay_drafts.py over the mini suite's greedy outputs:
                     # 1.0 drafts too little on translation, 8.0 (no cap) wastes rows on weak one-token matches)


class ContinuationIndex:
    """context tuple (1..max_match tokens) -> Counter of the next token; optionally LRU-bounded."""

    def __init__(self, max_match: int, max_contexts: int = 0) -> None:
        self.max_match, self.max_contexts = max_match, max_contexts
        self.counts: OrderedDict[tuple[int, ...], Counter] = OrderedDict()

    def add(self, tokens: list[int], start: int) -> None:
        """Count every next token at positions start..len-1 after each of its contexts."""
        for i in range(max(start, 1), len(tokens)):
            for m in range(1, min(self.max_match, i) + 1):
                ctx = tuple(tokens[i - m:i])
                c = self.counts.get(ctx)
                if c is None:
                    c = self.counts[ctx] = Counter()
                elif self.max_contexts:
                    self.counts.move_to_end(ctx)
                c[tokens[i]] += 1
        while self.max_contexts and len(self.counts) > self.max_contexts:
            self.counts.popitem(last=False)

    def get(self, ctx: tuple[int, ...]) -> Counter | None:
        return self.counts.get(ctx)


class SuffixProposer:
    name = "suffix"
    feature_layers: tuple[int, ...] = ()                 # the target layers it reads: none

    def __init__(self, max_match: int = 8, budget: int = 8, min_prob: float = 0.1, local_weight: float = 4.0,
                 max_contexts: int = 400_000, tree_cost: float = TREE_COST, match_factor: float = MATCH_FACTOR,
                 max_total_contexts: int = MAX_TOTAL_CONTEXTS) -> None:
        if (max_match < 1 or budget < 1 or not 0 < min_prob < 1 or local_weight < 0 or max_contexts < 1
                or tree_cost < 1 or match_factor <= 0 or max_total_contexts < max_contexts):
            raise SpecdecError("suffix decoding needs max_match >= 1, budget >= 1, 0 < min_prob < 1, "
                               "local_weight >= 0, max_contexts >= 1, tree_cost >= 1, match_factor > 0, "
                               "max_total_contexts >= max_contexts")
        self.max_total_contexts = max_total_contexts
        self.max_match, self.budget, self.min_prob, self.local_weight = max_match, budget, min_prob, local_weight
        self.tree_cost, self.match_factor = tree_cost, match_factor
        self.max_contexts = max_contexts
        self.shared: OrderedDict[str, ContinuationIndex] = OrderedDict()   # tenant -> its outputs' index
        self.row_shared: dict[int, ContinuationIndex] = {}                  # row -> its request's tenant's index
        self.local: dict[int, ContinuationIndex] = {}
        self.seen: dict[int, int] = {}                                        # row -> tokens indexed
        self.prompt_len: dict[int, int] = {}

    def allocate(self, rows: int, slots: int) -> None:
        self.local, self.seen, self.row_shared = {}, {}, {}

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        for r, p in zip(rows.tolist(), prompts):
            self.local[r] = ContinuationIndex(self.max_match)
            self.local[r].add(p, 1)
            self.seen[r] = len(p)
            self.prompt_len[r] = len(p) - 1                                   # the first token is output

    def _tenant_index(self, tenant: str) -> ContinuationIndex:
        """The shared index of `tenant`'s outputs (made on first use; the least recently used tenant's dropped
        past MAX_TENANTS)."""
        index = self.shared.get(tenant)
        if index is None:
            index = self.shared[tenant] = ContinuationIndex(self.max_match, self.max_contexts)
            while len(self.shared) > MAX_TENANTS:
                self.shared.popitem(last=False)
        else:
            self.shared.move_to_end(tenant)
        return index

    def _bind(self, batch: ActiveBatch) -> list[int]:
        """The batch's rows, each bound to its request's tenant's shared index."""
        rows = batch.rows.tolist()
        for r, tenant in zip(rows, batch.tenants or [""] * len(rows)):
            self.row_shared[r] = self._tenant_index(tenant)
        return rows

    def _catch_up(self, r: int, tokens: list[int]) -> None:
        if len(tokens) > self.seen[r]:
            self.local[r].add(tokens, self.seen[r])
            self.row_shared[r].add(tokens, max(self.seen[r], self.prompt_len[r]))   # outputs only
            self.seen[r] = len(tokens)

    def _reach(self, matched: int, k: int) -> int:
        """Drafts a match of `matched` tokens may have: at most match_factor per matched token, and k."""
        return min(k, int(self.match_factor * matched))

    def _longest(self, r: int, context: list[int]) -> int:
        """The length of the longest suffix of `context` seen before (0: none)."""
        for m in range(min(self.max_match, len(context)), 0, -1):
            ctx = tuple(context[-m:])
            if self.local[r].get(ctx) or self.row_shared[r].get(ctx):
                return m
        return 0

    def match(self, batch: ActiveBatch, k: int) -> tuple[Tensor, Tensor]:
        """Like NgramProposer.match, so `hybrid` can use suffix decoding in place of prompt lookup: per
        sequence the matched suffix length [B] and the most probable continuation chain [B, k] (PAD = none)."""
        n = torch.zeros(len(batch.tokens), dtype=torch.long)
        out = torch.full((len(batch.tokens), k), PAD, dtype=torch.long)
        for i, (r, hist) in enumerate(zip(self._bind(batch), batch.tokens)):
            self._catch_up(r, hist)
            n[i] = self._longest(r, hist)
            path, prob = list(hist), 1.0
            for j in range(self._reach(int(n[i]), k)):
                nxt = self._next(r, path)
                if not nxt or prob * nxt[0][0] < self.min_prob:
                    break
                prob *= nxt[0][0]
                out[i, j] = nxt[0][1]
                path.append(nxt[0][1])
        return n, out

    def _next(self, r: int, context: list[int]) -> list[tuple[float, int]]:
        """(probability, token) of what follows the longest matching suffix of `context`."""
        for m in range(min(self.max_match, len(context)), 0, -1):
            ctx = tuple(context[-m:])
            local, glob = self.local[r].get(ctx), self.row_shared[r].get(ctx)
            if not local and not glob:
                continue
            mixed: Counter = Counter()
            for t, c in (local or {}).items():
                mixed[t] += self.local_weight * c
            for t, c in (glob or {}).items():
                mixed[t] += c
            total = sum(mixed.values())
            return [(c / total, t) for t, c in mixed.most_common(4)]
        return []

    def _draft(self, r: int, history: list[int], k: int) -> tuple[list[int], list[int]]:
        """The best-first tree, or its most probable chain where the tree's expected accepted tokens do not
        pay for a tree forward's extra cost (`tree_cost` times a chain's). A match of m tokens drafts at
        most match_factor * m tokens (a short match is weak evidence, whatever its counts say)."""
        k = self._reach(self._longest(r, history), k)
        toks, pars, probs = self._tree(r, history, k)
        if all(p == i - 1 for i, p in enumerate(pars)):
            return toks, pars                                                   # already a chain
        chain, chain_probs = self._chain(r, history, k)
        if 1 + sum(probs) >= self.tree_cost * (1 + sum(chain_probs)):
            return toks, pars
        return chain, list(range(-1, len(chain) - 1))

    def _chain(self, r: int, history: list[int], k: int) -> tuple[list[int], list[float]]:
        """The most probable continuation, token by token, while its probability stays above min_prob (at
        most min(budget, k) tokens, as the tree)."""
        toks: list[int] = []
        probs: list[float] = []
        prob = 1.0
        for _ in range(min(self.budget, k)):
            nxt = self._next(r, history + toks)
            if not nxt or prob * nxt[0][0] < self.min_prob:
                break
            prob *= nxt[0][0]
            toks.append(nxt[0][1])
            probs.append(prob)
        return toks, probs

    def _tree(self, r: int, history: list[int], k: int) -> tuple[list[int], list[int], list[float]]:
        """Best-first: the most probable continuation paths, up to min(budget, k) nodes and depth k
        (tokens, parents, each node's estimated probability of being reached and accepted)."""
        toks: list[int] = []
        pars: list[int] = []
        probs: list[float] = []
        heap: list[tuple[float, int, int, tuple[int, ...]]] = []      # (-prob, tiebreak, parent, path so far)
        for p, t in self._next(r, history):
            heapq.heappush(heap, (-p, len(heap), ROOT, (t,)))
        n = 0
        while heap and len(toks) < min(self.budget, k):
            neg, _, parent, path = heapq.heappop(heap)
            if -neg < self.min_prob:
                break
            toks.append(path[-1])
            pars.append(parent)
            probs.append(-neg)
            me = len(toks) - 1
            if len(path) < k:
                for p, t in self._next(r, history + list(path)):
                    n += 1
                    heapq.heappush(heap, (neg * p, 10_000 + n, me, path + (t,)))
        return toks, pars, probs

    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        trees = []
        for r, hist in zip(self._bind(batch), batch.tokens):
            self._catch_up(r, hist)
            trees.append(self._draft(r, hist, k))
        n = max(1, max(len(t) for t, _ in trees))
        tokens = torch.full((len(trees), n), PAD, dtype=torch.long)
        parents = torch.full((len(trees), n), ROOT, dtype=torch.long)
        for b, (t, p) in enumerate(trees):
            tokens[b, :len(t)] = torch.tensor(t, dtype=torch.long)
            parents[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        dev = batch.rows.device
        return Draft(tokens.to(dev), parents=parents.to(dev))

    def forget(self) -> None:
        """Drop every tenant's shared index (what earlier requests' outputs taught)."""
        self.shared, self.row_shared = OrderedDict(), {}

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: Tensor) -> None:
        """Index the step's tokens, drafted or not: steps without drafts (the `auto` policy's K = 0) call no
        propose, and a request ending on them would leave its last outputs out of the shared index."""
        for r, hist in zip(self._bind(batch), batch.tokens):
            self._catch_up(r, hist)
        total = sum(len(index.counts) for index in self.shared.values())       # once per step, not per row
        while total > self.max_total_contexts and len(self.shared) > 1:           # the least recently used go
            _, dropped = self.shared.popitem(last=False)                         # (a row bound to it keeps it
            total -= len(dropped.counts)                                         # until its request ends)
