"""Automatic prefix caching: the target's keys, values and hidden states of recent prompts' pieces.

Prompts are prefilled in pieces aligned to PREFILL_PIECE tokens (see Engine). A full piece's bits
depend only on the tokens up to its end, so a later prompt that starts with the same tokens (the
next turn of a chat, a shared system prompt or few-shot preamble) can copy the piece instead of
recomputing it, and gets exactly the bits it would have computed. Pieces are keyed by a SHA-256
chain over the token ids (collisions are not a practical concern) and evicted least recently used
once the stored tensors exceed the byte budget.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor

PREFILL_PIECE = 128        # prompt tokens per prefill piece; pieces start at multiples of it


@dataclass(frozen=True)
class Piece:
    """One full prefill piece of one prompt."""
    k: Tensor              # [L, n_kv, PREFILL_PIECE, hd]
    v: Tensor              # [L, n_kv, PREFILL_PIECE, hd]
    hidden: Tensor         # [PREFILL_PIECE, H'] the target's final hidden states (and feature layers' outputs)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.hidden))


def piece_keys(tokens: list[int], features: tuple[int, ...] = ()) -> list[bytes]:
    """The key of every full piece of `tokens`: a digest of all tokens up to the piece's end and of the feature
    layers the forward returned (engines of one target that read other layers keep pieces of their own)."""
    h = hashlib.sha256(array("q", [len(features), *features]).tobytes())
    keys = []
    for end in range(PREFILL_PIECE, len(tokens) + 1, PREFILL_PIECE):
        h.update(array("q", tokens[end - PREFILL_PIECE:end]).tobytes())
        keys.append(h.digest())
    return keys


class PrefixCache:
    """LRU store of full prefill pieces, at most `capacity_bytes` of tensors (0: disabled)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("prefix cache capacity must be >= 0 bytes")
        self.capacity_bytes = capacity_bytes
        self.pieces: OrderedDict[bytes, Piece] = OrderedDict()
        self.nbytes = 0
        self.queried_tokens = 0            # prompt tokens looked up
        self.hit_tokens = 0                # prompt tokens served from the cache

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def lookup(self, tokens: list[int], features: tuple[int, ...] = ()) -> list[Piece]:
        """The cached pieces that start `tokens` (prefilled returning `features`), in order (stops at the first miss)."""
        if not self.enabled:
            return []                                            # nothing looked up, nothing counted
        self.queried_tokens += len(tokens)
        found = []
        for key in piece_keys(tokens, features):
            piece = self.pieces.get(key)
            if piece is None:
                break
            self.pieces.move_to_end(key)
            found.append(piece)
        self.hit_tokens += len(found) * PREFILL_PIECE
        return found

    def store(self, key: bytes, piece: Piece) -> None:
        """Keep a piece (copies of its tensors), evicting the least recently used beyond capacity."""
        if not self.enabled or piece.nbytes > self.capacity_bytes:
            return
        if key in self.pieces:
            self.pieces.move_to_end(key)
            return
        self.pieces[key] = piece
        self.nbytes += piece.nbytes
        while self.nbytes > self.capacity_bytes:
            _, old = self.pieces.popitem(last=False)
            self.nbytes -= old.nbytes
