"""A small draft model distilled from its target: a few of the target's layers, retrained.

Same tokenizer and the target's token embeddings (shared, frozen, never saved); its
own layers (initialised from chosen target layers), final norm and an LM head over a
reduced vocabulary of frequent tokens (where the head would dominate a small model's
cost). `lm_head` returns full-vocabulary logits with -inf outside that vocabulary, so
the draft is an ordinary CausalLM for the `draft` proposer, and q(x) = 0 for tokens it
never proposes (verification stays exact: the residual max(0, p - q) covers them).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from ..cache import KVCache
from ..errors import SpecdecError
from .base import UnfusedArgmax
from .decoder import Transformer, materialize, linear
from .eagle import fitting, read_weights, target_fingerprint, write_weights


class DistilledDraft(nn.Module, UnfusedArgmax):
    def __init__(self, target: Transformer, vocab_ids: Tensor, layers: list[int]) -> None:
        super().__init__()
        cfg = replace(target.config, n_layers=len(layers), name=f"{target.config.name}-draft{len(layers)}")
        with torch.device("meta"):
            core = Transformer(cfg)
        core = materialize(core).float()
        core.cos, core.sin_signed = target.cos.cpu(), target.sin_signed.cpu()
        if cfg.sliding_window > 0:
            core.lcos, core.lsin_signed = target.lcos.cpu(), target.lsin_signed.cpu()
        with torch.no_grad():
            for mine, theirs in zip(core.layers, [target.layers[i] for i in layers]):
                for (_, p), (_, q) in zip(mine.named_parameters(), theirs.named_parameters()):
                    p.copy_(q.float())
            core.norm.copy_(target.norm.float())
            w = target.output if target.output.numel() else target.embed
            core.output = nn.Parameter(w[vocab_ids.long()].float().clone())             # [V', H]
        self.core = core
        self.source_layers = list(layers)
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        self.target = [target]                                    # not a submodule: frozen, never saved
        self.core.embed = nn.Parameter(torch.empty(0), requires_grad=False)  # the target's, see forward

    # ---- the CausalLM contract ------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.target[0].vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.target[0].max_seq_len

    @property
    def batch_prefill_limit(self) -> int:
        return self.core.batch_prefill_limit

    @property
    def dtype(self) -> torch.dtype:
        return self.core.norm.dtype

    @property
    def device(self) -> torch.device:
        return self.core.norm.device

    def new_cache(self, rows: int, slots: int) -> KVCache:
        return self.core.new_cache(rows, slots)

    def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache, rows: Tensor,
                tree_mask: Tensor | None = None) -> Tensor:
        """tokens, positions [B, T] -> hidden [B, T, H] (the target's embeddings, the draft's layers)."""
        x = self.target[0].embed_tokens(tokens).to(self.dtype)
        return self.core.forward_embeds(x, positions, cache, rows, tree_mask)

    def prefill(self, tokens: Tensor, positions: Tensor, cache: KVCache, rows: Tensor) -> Tensor:
        """Prompts [G, P] -> hidden [G, P, H]: the causal forward."""
        return self.forward(tokens, positions, cache, rows)

    def sub_logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> float32 logits over the reduced vocabulary [..., V']."""
        return linear(hidden, self.core.output, self.core.packed, "lm_head").float()

    def lm_head(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> float32 logits [..., V], -inf outside the draft's vocabulary."""
        sub = self.sub_logits(hidden)
        out = torch.full((*sub.shape[:-1], self.vocab_size), float("-inf"), device=sub.device)
        return out.index_copy_(-1, self.vocab_ids, sub)

    def prepare(self, dtype: torch.dtype) -> "DistilledDraft":
        """Inference set-up: the target's dtype, prepacked linears on CPU."""
        self.to(dtype).eval().requires_grad_(False)
        t = self.target[0]
        self.core.cos, self.core.sin_signed = t.cos, t.sin_signed              # float32 rope, never cast
        if t.config.sliding_window > 0:
            self.core.lcos, self.core.lsin_signed = t.lcos, t.lsin_signed
        self.core.pack()                                  # also packs the reduced head as "lm_head"
        return self

    # ---- persistence --------------------------------------------------------------------------
    def save(self, path: Path, meta: dict) -> None:
        sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()
              if k != "vocab_ids" and v.numel()}
        sd["vocab_ids"] = self.vocab_ids.to(torch.int32)
        info = {"kind": "draft", "layers": ",".join(map(str, self.source_layers)),
                "target": target_fingerprint(self.target[0]), **{k: str(v) for k, v in meta.items()}}
        write_weights(path, sd, info)

    @staticmethod
    def load(path: Path, target: Transformer) -> "DistilledDraft":
        sd, meta = read_weights(path, "draft", target)
        with fitting(path, "a distilled draft"):
            layers = [int(i) for i in meta["layers"].split(",")]
            draft = DistilledDraft(target, sd.pop("vocab_ids").long(), layers)
            missing, unexpected = draft.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
        if unexpected or [m for m in missing if m not in ("vocab_ids", "core.embed")]:
            raise SpecdecError(f"{path} does not fit a distilled draft: missing {missing}, unexpected {unexpected}")
        return draft.prepare(target.dtype)
