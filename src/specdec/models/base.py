"""The model contract the engine relies on (the lean decoder and the transformers adapter both meet it)."""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ..verify import Reuse


class Cache(Protocol):
    lengths: Tensor                                    # [R] committed slots per row

    def commit(self, rows: Tensor, keep: Tensor, num_keep: Tensor) -> None: ...
    def truncate(self, rows: Tensor, lengths: Tensor) -> None: ...
    def span(self, row: int, start: int, end: int) -> tuple[Tensor, Tensor]: ...
    def append(self, row: int, k: Tensor, v: Tensor) -> None: ...


class CausalLM(Protocol):
    """Scores tokens at explicit positions; knows nothing of speculation.

    forward writes T scratch rows per sequence after its committed length; the
    caller keeps what it wants with `cache.commit` (a chain prefix or a tree path).
    """

    @property
    def vocab_size(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def batch_prefill_limit(self) -> int:
        """Prompts of equal length up to this many tokens may share a prefill forward: each one's
        cache and logits are then bit-identical to a forward of its own (0: never)."""
        ...

    def new_cache(self, rows: int, slots: int) -> Cache: ...

    def forward(self, tokens: Tensor, positions: Tensor, cache: Cache, rows: Tensor,
                tree_mask: Tensor | None = None, features: tuple[int, ...] = ()) -> Tensor:
        """tokens, positions [B, T]; rows [B]; tree_mask [B, T, T] or None (causal) -> hidden [B, T, H]
        (with `features`: [B, T, H * (1 + len(features))], those layers' outputs after the final state)."""
        ...

    def prefill(self, tokens: Tensor, positions: Tensor, cache: Cache, rows: Tensor,
                features: tuple[int, ...] = ()) -> Tensor:
        """Like a causal forward over whole prompts [G, P] -> hidden [G, P, H]. A prompt's bits must
        depend only on the prompt; they may differ from forward's in the last place (faster kernels)."""
        ...

    def forward_reusing(self, reuse: Reuse, positions: Tensor, cache: Cache, rows: Tensor,
                        features: tuple[int, ...] = ()) -> Tensor:
        """Like a causal forward over a chain whose first `reuse.layers` layers a self-speculative proposer
        computed already (their keys, values and residual stream): bit for bit what forward gives."""
        ...

    def lm_head(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> float32 logits [..., V]."""
        ...

    def lm_head_top(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """hidden [..., H] -> (lm_head(hidden), its argmax [...] int64: the first index of the largest, a NaN
        counting as the largest, as `sampling.argmax`)."""
        ...


class UnfusedArgmax:
    """`lm_head_top` as `lm_head` and then `sampling.argmax`: for models whose head finds no argmax in its own call
    (the transformers adapter, the early-exit and distilled drafts)."""

    def lm_head_top(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """hidden [..., H] -> (lm_head(hidden), its argmax [...] int64)."""
        from ..sampling import argmax

        logits = self.lm_head(hidden)
        return logits, argmax(logits)
