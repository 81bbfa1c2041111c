"""What a proposer sees and promises (the contract between proposer and engine)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from ..sampling import BatchSampling
from ..verify import Draft, Verdict


@dataclass
class ActiveBatch:
    """The sequences being decoded this step."""
    rows: Tensor                      # [B] cache rows / slots of the active sequences
    tokens: list[list[int]]           # full history per sequence: prompt + generated (last one not yet scored)
    sampling: BatchSampling           # per-sequence transform parameters
    seeds: Tensor                     # [B] int64 per-sequence seeds (random numbers: sampling.position_uniforms)
    tenants: list[str] = field(default_factory=list)   # per sequence, Request.tenant (empty: all one shared tenant)


class Proposer(Protocol):
    """Everything the engine calls on a proposer; a proposer reads nothing else of the engine."""
    name: str
    feature_layers: tuple[int, ...]   # target layers whose outputs it reads (the target's forwards then return
                                      # [..., H * (1 + len)]: final state, then those layers; EAGLE-3); () for most

    def allocate(self, rows: int, slots: int) -> None:
        """Room for `rows` sequences of up to `slots` tokens."""
        ...

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        """New sequences occupy `rows`; `prompts` are their histories (prompt + first token);
        hidden [B, P, H] holds the target's features of the prompt tokens (right-padded)."""
        ...

    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        """Up to k >= 1 drafts per sequence along any path: a chain (tokens [B, k], PAD = none; q [B, k, V] or
        None for point masses) or a tree of depth at most k (tokens and parents) of at most
        tree.MAX_TREE_BUDGET nodes (the engine cuts what its cache has no room for). A chain may carry
        `reuse`: the target's first layers computed for its rows (Transformer.forward_reusing)."""
        ...

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: Tensor) -> None:
        """Roll own state (cache, features) forward to the accepted path. `batch.tokens` already holds
        the new tokens; hidden [B, N, H] are the target's features of the scored rows (`verdict.path` indexes them)."""
        ...

    def forget(self) -> None:
        """Drop whatever outlives a request (suffix decoding's global index), as if no request had been served:
        a benchmark calls it before each repeat so that no run drafts from an earlier run of the same prompt."""
        ...


class NoProposer:
    """Plain decoding: no drafts (K = 0), one token per target forward."""
    name = "none"
    feature_layers: tuple[int, ...] = ()                 # the target layers it reads: none

    def allocate(self, rows: int, slots: int) -> None:
        pass

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        pass

    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        return Draft.empty(len(batch.tokens), batch.rows.device)

    def forget(self) -> None:
        pass                          # nothing outlives a request

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: Tensor) -> None:
        pass
