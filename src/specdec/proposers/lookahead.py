"""Lookahead decoding (Fu et al., ICML 2024): Jacobi iterations feed an n-gram pool; no draft model.

Each step scores, in the target's one forward, a token tree rooted at the pending token:

* the *lookahead branch*, a window of W columns x (N-1) levels of past Jacobi guesses. Level 0 is a
  chain of W guesses at offsets 1..W; column i's level j sits at offset i + j and sees level 0 up to
  column i, then its own column's lower levels: exactly LADE's attention pattern, and a tree (one
  ancestor per depth), so the engine scores it like any draft tree;
* the *verification branch*: up to G n-grams from the pool that start with the pending token.

The target's own tokens after the last level's nodes (`Verdict.target_tokens`) become the next
level; each column then yields an N-gram (its levels plus that token) for the pool, keyed by its first
token (at most G per key, least recently used out). The pool is seeded with the prompt's n-grams and
grows with the output's. Every branch is verified by the tree walk, so greedy output is the target's
and sampling stays exact (the drafts are point masses). The depth budget K bounds the window: W
shrinks to K - N + 2 columns (none below that), so the draft-length policy can shrink or skip it. A tree
holds at most MAX_TREE_BUDGET nodes (what one forward scores exactly): the window comes first, the
verification branch takes what room is left.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import SpecdecError
from ..tree import MAX_TREE_BUDGET, PAD
from ..verify import ROOT, Draft, Verdict
from .base import ActiveBatch


@dataclass(frozen=True)
class LookaheadShape:
    """W window columns, N-gram size, G verification candidates per step."""
    window: int = 2
    ngram: int = 3
    candidates: int = 2

    def __post_init__(self) -> None:
        if self.window < 1 or self.ngram < 2 or self.candidates < 1:
            raise SpecdecError(f"lookahead needs W >= 1, N >= 2, G >= 1; got W={self.window}, N={self.ngram}, "
                               f"G={self.candidates}")
        if self.window > 16 or self.ngram > 8 or self.candidates > 16:
            raise SpecdecError(f"lookahead W, N, G are capped at 16, 8, 16; got {self.window}, {self.ngram}, "
                               f"{self.candidates}")

    @staticmethod
    def parse(spec: str) -> "LookaheadShape":
        """'W,N,G' (e.g. '2,3,2')."""
        try:
            w, n, g = (int(x) for x in spec.split(","))
        except ValueError:
            raise SpecdecError(f"lookahead shape is W,N,G (e.g. 2,3,2), got {spec!r}") from None
        return LookaheadShape(w, n, g)


@dataclass
class RowState:
    levels: list[list[int]]                                  # N-1 levels x W guesses (level 0 first)
    pool: dict[int, OrderedDict] = field(default_factory=dict)   # first token -> {rest of the n-gram: None}
    window_nodes: list[list[int]] = field(default_factory=list)  # [level][column] -> draft index, this step
    indexed: int = 0                                         # history n-grams added to the pool so far


class LookaheadProposer:
    name = "lookahead"
    feature_layers: tuple[int, ...] = ()                 # the target layers it reads: none

    def __init__(self, shape: LookaheadShape = LookaheadShape()) -> None:
        self.shape = shape
        self.rows: dict[int, RowState] = {}

    def allocate(self, rows: int, slots: int) -> None:
        self.rows = {}

    def _remember(self, st: RowState, gram: tuple[int, ...]) -> None:
        entries = st.pool.setdefault(gram[0], OrderedDict())
        entries[gram[1:]] = None
        entries.move_to_end(gram[1:])
        while len(entries) > self.shape.candidates:
            entries.popitem(last=False)

    def _index_history(self, st: RowState, tokens: list[int]) -> None:
        """Add the history's N-grams (the prompt's at the start, then the output's) to the pool."""
        N = self.shape.ngram
        for end in range(max(st.indexed, N), len(tokens) + 1):
            self._remember(st, tuple(tokens[end - N:end]))
        st.indexed = max(st.indexed, len(tokens) + 1)

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        W, N = self.shape.window, self.shape.ngram
        for r, p in zip(rows.tolist(), prompts):
            rng = random.Random(len(p) * 7919 + p[-1])          # guesses only shape speed, never output
            st = RowState([[rng.choice(p) for _ in range(W)] for _ in range(N - 1)])
            self._index_history(st, p)
            self.rows[r] = st

    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        W, N = self.shape.window, self.shape.ngram
        w = max(0, min(W, k - (N - 2), MAX_TREE_BUDGET // (N - 1)))   # columns whose top level fits depth k and the tree
        trees = []
        for r, hist in zip(batch.rows.tolist(), batch.tokens):
            st = self.rows[r]
            self._index_history(st, hist)
            trie: dict[tuple[int, int], int] = {}                # (parent index, token) -> draft index
            toks: list[int] = []
            pars: list[int] = []

            def add(path: list[int]) -> int:
                """The path's last node (added where missing, while the tree has room: PAD-free prefixes)."""
                parent = ROOT
                for t in path:
                    key = (parent, t)
                    if key not in trie:
                        if len(toks) == MAX_TREE_BUDGET:
                            break
                        trie[key] = len(toks)
                        toks.append(t)
                        pars.append(parent)
                    parent = trie[key]
                return parent

            base = st.levels[0][:w]                              # the lookahead branch first: it always fits
            st.window_nodes = [[add(base[:i + 1] + [st.levels[j][i] for j in range(1, lvl + 1)]) for i in range(w)]
                               for lvl in range(N - 1)]
            for rest in reversed(st.pool.get(hist[-1], OrderedDict())):  # the verification branch, newest first
                add(list(rest)[:k])
            trees.append((toks, pars))
        n = max(1, max(len(t) for t, _ in trees))
        dev = batch.rows.device
        tokens = torch.full((len(trees), n), PAD, dtype=torch.long)
        parents = torch.full((len(trees), n), ROOT, dtype=torch.long)
        for b, (t, p) in enumerate(trees):
            tokens[b, :len(t)] = torch.tensor(t, dtype=torch.long)
            parents[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        return Draft(tokens.to(dev), parents=parents.to(dev))

    def forget(self) -> None:
        pass                          # nothing outlives a request

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: Tensor) -> None:
        """The target's tokens after the top level become the next level; each column's levels plus that
        token are an N-gram for the pool."""
        N = self.shape.ngram
        scored = verdict.target_tokens.tolist()                  # [B][1 + drafts]
        for b, r in enumerate(batch.rows.tolist()):
            st = self.rows[r]
            top = st.window_nodes[-1] if st.window_nodes else []
            if not top or max(top) + 1 >= len(scored[b]):
                continue                                         # no window this step (or it was cut)
            new = list(st.levels[-1])
            for i, node in enumerate(top):
                new[i] = scored[b][node + 1]
                self._remember(st, tuple([st.levels[j][i] for j in range(N - 1)] + [new[i]]))
            st.levels = st.levels[1:] + [new]
            st.window_nodes = []
