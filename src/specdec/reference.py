"""The slow, obviously correct reference: no KV cache reuse, re-run the whole context each step.

Used by the tests as the oracle that every fast path must equal (fp32, greedy).
"""
from __future__ import annotations

import torch

from .models.base import CausalLM


@torch.inference_mode()
def reference_greedy(model: CausalLM, prompt: list[int], max_new_tokens: int,
                     eos_ids: frozenset[int] = frozenset()) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        cache = model.new_cache(1, len(tokens))                               # fresh every step
        inp = torch.tensor([tokens], device=model.device)
        pos = torch.arange(len(tokens), device=model.device)[None]
        hidden = model(inp, pos, cache, torch.tensor([0], device=model.device))
        nxt = int(model.lm_head(hidden[0, -1]).argmax())
        out.append(nxt)
        tokens.append(nxt)
        if nxt in eos_ids:
            break
    return out


@torch.inference_mode()
def exact_distribution(model: CausalLM, prompt: list[int]) -> torch.Tensor:
    """Next-token logits [V] of the whole context (fresh cache)."""
    cache = model.new_cache(1, len(prompt))
    inp = torch.tensor([prompt], device=model.device)
    pos = torch.arange(len(prompt), device=model.device)[None]
    return model.lm_head(model(inp, pos, cache, torch.tensor([0], device=model.device))[0, -1])
