"""Medusa heads: one residual block per future position on the target's last hidden state.

Head k turns the feature f_t of the last committed token into logits for
x_{t+1+k} (x_{t+1} is the target's own next token), through the target's LM-head
rows of a reduced draft vocabulary (frozen, shared).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import SpecdecError
from .decoder import Transformer
from .eagle import fitting, read_weights, target_fingerprint, write_weights


class MedusaHeads(nn.Module):
    def __init__(self, target: Transformer, vocab_ids: Tensor, n_heads: int = 4) -> None:
        super().__init__()
        H = target.config.dim
        self.w = nn.Parameter(torch.zeros(n_heads, H, H))          # zero init: head k starts as the identity
        self.b = nn.Parameter(torch.zeros(n_heads, H))
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        self.target = [target]

    @property
    def n_heads(self) -> int:
        return self.w.shape[0]

    def lm_weight(self) -> Tensor:
        t = self.target[0]
        w = t.output if t.output.numel() else t.embed
        return w[self.vocab_ids.to(w.device)]

    def features(self, f: Tensor) -> Tensor:
        """f [..., H] -> per-head features [..., K, H]."""
        x = f.unsqueeze(-2)
        return x + F.silu(torch.einsum("...h,kgh->...kg", f, self.w) + self.b)

    def logits(self, f: Tensor, w_sub: Tensor) -> Tensor:
        return (self.features(f) @ w_sub.T).float()                   # [..., K, V']

    def prepare(self, dtype: torch.dtype) -> "MedusaHeads":
        self.to(dtype).eval().requires_grad_(False)
        self.w_sub = self.lm_weight().to(dtype).contiguous()
        return self

    def save(self, path: Path, meta: dict) -> None:
        sd = {"w": self.w.detach().to(torch.bfloat16).contiguous(), "b": self.b.detach().to(torch.bfloat16),
              "vocab_ids": self.vocab_ids.to(torch.int32)}
        write_weights(path, sd, {"kind": "medusa", "target": target_fingerprint(self.target[0]),
                                           **{k: str(v) for k, v in meta.items()}})

    @staticmethod
    def load(path: Path, target: Transformer) -> "MedusaHeads":
        sd, _ = read_weights(path, "medusa", target)
        if set(sd) != {"w", "b", "vocab_ids"}:
            raise SpecdecError(f"{path} does not hold Medusa heads (tensors {sorted(sd)})")
        with fitting(path, "Medusa heads"), torch.no_grad():
            heads = MedusaHeads(target, sd["vocab_ids"].long(), sd["w"].shape[0])
            heads.w.copy_(sd["w"].float())
            heads.b.copy_(sd["b"].float())
        return heads.prepare(target.dtype)
