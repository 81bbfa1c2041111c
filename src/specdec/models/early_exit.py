"""Self-speculation: the target's own first N layers plus a small trained exit draft for it.

The exit reads the target's final norm of layer N's output (the truncated target's output), scales it
per channel and projects it (H x H, initialised to the identity) onto the target's LM-head rows of a
reduced vocabulary. The target's weights stay frozen and shared: the draft adds only the exit
(H + H*H parameters). `lm_head` gives -inf outside the reduced vocabulary, so q(x) = 0 there and the
`draft` machinery verifies it exactly.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from ..cache import KVCache
from ..errors import SpecdecError
from .base import UnfusedArgmax
from .decoder import Transformer, truncated
from .eagle import fitting, read_weights, target_fingerprint, write_weights
from .kernels import linear, pack, packed_linear_available


class EarlyExitDraft(nn.Module, UnfusedArgmax):
    def __init__(self, target: Transformer, n_layers: int, vocab_ids: Tensor) -> None:
        super().__init__()
        if not 1 <= n_layers < target.config.n_layers:
            raise SpecdecError(f"an early exit needs 1 <= N < {target.config.n_layers} layers, got {n_layers}")
        H = target.config.dim
        self.n_layers = n_layers
        self.scale = nn.Parameter(torch.ones(H))
        self.proj = nn.Parameter(torch.eye(H))
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        self.target = [target]                                   # frozen, never saved
        self.body = [truncated(target, n_layers)]                # shares the target's weights
        self.last_stream = torch.empty(0)                        # [B, T, H] residual stream after layer N, last forward
        self.packed: dict[str, object] = {}

    # ---- the CausalLM contract ------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.target[0].vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.target[0].max_seq_len

    @property
    def batch_prefill_limit(self) -> int:
        return self.body[0].batch_prefill_limit

    @property
    def dtype(self) -> torch.dtype:
        return self.target[0].dtype

    @property
    def device(self) -> torch.device:
        return self.target[0].device

    def new_cache(self, rows: int, slots: int) -> KVCache:
        return self.body[0].new_cache(rows, slots)

    def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache, rows: Tensor,
                tree_mask: Tensor | None = None) -> Tensor:
        """tokens, positions [B, T] -> the target's final norm of layer N's output [B, T, H]; that output
        itself (the residual stream entering layer N) is kept in `last_stream`."""
        return self._split(self.body[0](tokens, positions, cache, rows, tree_mask, features=(self.n_layers - 1,)))

    def prefill(self, tokens: Tensor, positions: Tensor, cache: KVCache, rows: Tensor) -> Tensor:
        return self._split(self.body[0].prefill(tokens, positions, cache, rows, features=(self.n_layers - 1,)))

    def _split(self, out: Tensor) -> Tensor:
        H = self.target[0].config.dim
        self.last_stream = out[..., H:]
        return out[..., :H]

    def exit(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> the exit's feature [..., H] (float32 in training, the model's dtype after prepare)."""
        x = hidden.to(self.scale.dtype) * self.scale
        return linear(x, self.proj, self.packed, "proj")

    def sub_logits(self, hidden: Tensor, w_sub: Tensor) -> Tensor:
        return linear(self.exit(hidden), w_sub, self.packed, "lm_sub").float()

    def lm_head(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> float32 logits [..., V], -inf outside the reduced vocabulary."""
        sub = self.sub_logits(hidden, self.w_sub)
        out = torch.full((*sub.shape[:-1], self.vocab_size), float("-inf"), device=sub.device)
        return out.index_copy_(-1, self.vocab_ids, sub)

    def lm_rows(self) -> Tensor:
        t = self.target[0]
        w = t.output if t.output.numel() else t.embed
        return w[self.vocab_ids.to(w.device)]

    def prepare(self, dtype: torch.dtype) -> "EarlyExitDraft":
        self.to(dtype).eval().requires_grad_(False)
        self.w_sub = self.lm_rows().to(dtype).contiguous()
        if packed_linear_available(self.w_sub.device):
            self.packed = {"proj": pack(self.proj), "lm_sub": pack(self.w_sub)}
        return self

    # ---- persistence --------------------------------------------------------------------------
    def save(self, path: Path, meta: dict) -> None:
        sd = {"scale": self.scale.detach().to(torch.bfloat16).contiguous(),
              "proj": self.proj.detach().to(torch.bfloat16).contiguous(), "vocab_ids": self.vocab_ids.to(torch.int32)}
        info = {"kind": "exit", "n_layers": str(self.n_layers), "target": target_fingerprint(self.target[0]),
                **{k: str(v) for k, v in meta.items()}}
        write_weights(path, sd, info)

    @staticmethod
    def load(path: Path, target: Transformer) -> "EarlyExitDraft":
        sd, meta = read_weights(path, "exit", target)
        if set(sd) != {"scale", "proj", "vocab_ids"}:
            raise SpecdecError(f"{path} does not hold an early exit (tensors {sorted(sd)})")
        with fitting(path, "an early exit"), torch.no_grad():
            d = EarlyExitDraft(target, int(meta["n_layers"]), sd["vocab_ids"].long())
            d.scale.copy_(sd["scale"].float())
            d.proj.copy_(sd["proj"].float())
        return d.prepare(target.dtype)
