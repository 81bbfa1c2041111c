"""The start-up self-check of exactness: on this machine, with the kernels a loaded model will use,
is a token's score independent of how many rows share its forward?

Runs in tens of milliseconds on the model's own first layer and LM head: a context that crosses
a key block, then the same continuation scored one token per forward, in chunks (as drafts are
verified) and next to another sequence (a batch): the layer's hidden states compared bit for bit, then
the head's logits of those rows alone, in chunks and in a batch. Together with the
per-shape checks of every packed linear (`kernels.check_rows`), it tells whether greedy
speculation will reproduce plain decoding here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache import KVCache
from .decoder import Transformer, truncated
from .kernels import RowCheck

CONTEXT = 150          # tokens before the scored ones: crosses the first 128-key block
SCORED = 9             # tokens scored one by one, in chunks, and in a batch


@dataclass(frozen=True)
class SelfCheck:
    dtype: str
    linears: dict[str, str]    # per packed linear layer name: RowCheck verdict
    scores_invariant: bool     # first layer + head: same logits alone, in chunks, in a batch
    seconds: float

    @property
    def passed(self) -> bool:
        return self.scores_invariant and not any(v.startswith("NOT") for v in self.linears.values())

    def summary(self) -> str:
        state = "passed" if self.passed else "FAILED"
        return (f"self-check {state} in {self.seconds * 1000:.0f} ms ({self.dtype}: scores "
                f"{'invariant' if self.scores_invariant else 'DEPEND on the row count'}; {len(self.linears)} "
                f"linear kernels checked)")

    def as_dict(self) -> dict:
        return {"passed": self.passed, "dtype": self.dtype, "scores_invariant": self.scores_invariant,
                "linears": self.linears, "milliseconds": round(self.seconds * 1000, 1)}


def _linear_verdicts(model: Transformer) -> dict[str, str]:
    out: dict[str, RowCheck] = {}
    first = model.layers[0]
    for name, p in first.packed.items():
        out[name] = p.check
    for name, p in model.packed.items():
        out[name] = p.check
    return {name: c.verdict for name, c in out.items()}


def _prefilled(one: Transformer, prompts: Tensor) -> KVCache:
    """A cache holding prompt i in row i, each prefilled in its own forwards, like the engine's."""
    dev = one.device
    cache = one.new_cache(len(prompts), CONTEXT + SCORED + 8)
    for i in range(len(prompts)):
        r, pos = torch.tensor([i], device=dev), torch.arange(CONTEXT, device=dev)[None]
        one.prefill(prompts[i:i + 1], pos, cache, r)
        cache.commit(r, pos, torch.tensor([CONTEXT], device=dev))
    return cache


def _hidden(one: Transformer, cache: KVCache, cont: Tensor, rows: list[int], chunks: list[int]) -> Tensor:
    """Hidden states [len(rows), SCORED, H] of `cont` after the prompts in `cache` (rolled back to them first),
    scored in `chunks` per forward."""
    dev = one.device
    r = torch.tensor(rows, device=dev)
    cache.truncate(r, torch.full((len(rows),), CONTEXT, device=dev))
    out, at = [], 0
    for c in chunks:
        pos = torch.full((len(rows), 1), CONTEXT, device=dev) + torch.arange(at, at + c, device=dev)
        out.append(one(cont[rows, at:at + c], pos, cache, r).clone())     # kept past the next forward
        cache.commit(r, torch.arange(c, device=dev).expand(len(rows), c), torch.full((len(rows),), c, device=dev))
        at += c
    return torch.cat(out, 1)


def _head_invariant(model: Transformer, h: Tensor) -> bool:
    """Whether the LM head gives each of the SCORED rows of h [1, SCORED, H] the same logits alone, in chunks of
    3 and 5 and as a batch of two sequences as all of them in one call."""
    whole = model.lm_head(h)                                                       # [1, SCORED, V]
    parts = [model.lm_head(h[:, a:b]) for a, b in ((0, 1), (1, 4), (4, SCORED))]   # 1, 3 and 5 rows
    pair = model.lm_head(h[0, :2, None])                                           # [2, 1, V]: two sequences
    return torch.equal(torch.cat(parts, 1), whole) and torch.equal(pair[:, 0], whole[0, :2])


@torch.inference_mode()
def self_check(model: Transformer) -> SelfCheck:
    """Check, bit for bit on this machine, that scores do not depend on the rows per forward: the first layer's
    hidden states scored one token at a time, in chunks and beside another sequence, then the LM head's rows."""
    t0 = time.perf_counter()
    one = truncated(model, 1)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.vocab_size, (2, CONTEXT), generator=g).to(model.device)
    cont = torch.randint(0, model.vocab_size, (2, SCORED), generator=g).to(model.device)
    cache = _prefilled(one, prompts)
    alone = _hidden(one, cache, cont, [0], [1] * SCORED)
    ok = (torch.equal(_hidden(one, cache, cont, [0], [4, 5]), alone)
          and torch.equal(_hidden(one, cache, cont, [0], [SCORED]), alone)
          and torch.equal(_hidden(one, cache, cont, [1, 0], [1, 3, 5])[1:], alone)
          and _head_invariant(model, alone))
    name = getattr(model, "compute", str(model.dtype).removeprefix("torch."))     # q4, bfloat16, float32
    return SelfCheck(name, _linear_verdicts(model), ok, time.perf_counter() - t0)
