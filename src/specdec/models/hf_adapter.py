"""Any `transformers` causal LM behind the lean decoder's interface (`CausalLM`).

The adapter favours being obviously right over being fast: `forward` loops over
the batch rows and, for each, hands the model a fresh `DynamicCache` holding
that row's committed prefix, explicit `position_ids` and a 4-D additive mask
built the same way the lean decoder builds its boolean one (committed prefix
visible, the new block per `tree_mask` or causal, sliding-window layers also
limited by position distance). The model's new keys and values are then copied
into the row's scratch slots of an `HFCache`, which is a `KVCache` and so has
exactly the same `commit` / `truncate` semantics. Nothing the model does to its
own cache object survives the call.

Requires a model whose attention accepts a prepared 4-D mask (Llama family,
Gemma 3 and most decoder-only models in transformers 5 do). Models with
per-layer-type attention (`config.layer_types`, e.g. Gemma 3's sliding layers)
get one mask per type.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import Tensor, nn

from ..cache import KVCache
from ..errors import SpecdecError
from ..verify import Reuse
from .base import UnfusedArgmax

_FULL = "full_attention"
_SLIDING = "sliding_attention"


class HFCache(KVCache):
    """A `KVCache` the adapter fills from the model's own key/value states."""

    def write_block(self, row: int, layer: int, k: Tensor, v: Tensor) -> None:
        """k, v [n_kv, T, hd] into the scratch slots of `row`."""
        lo = int(self.lengths[row])
        T = k.shape[1]
        self.k[layer, row, :, lo:lo + T] = k
        self.v[layer, row, :, lo:lo + T] = v


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


class HFCausalLM(nn.Module, UnfusedArgmax):
    """Wraps a `transformers` causal LM; see the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        cfg = _text_config(model.config)
        self.text_config = cfg
        self.base = getattr(model, model.base_model_prefix, None)
        # the KV cache's argument and output field: `cache` in newer transformers, `past_key_values` before
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        if self.base is None or self.base is model:
            raise SpecdecError(f"{type(model).__name__} has no separate base model to take hidden states from")
        self.n_layers = int(cfg.num_hidden_layers)
        n_heads = int(cfg.num_attention_heads)
        self.n_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
        layer_types = getattr(cfg, "layer_types", None)
        self.layer_types: list[str] | None = list(layer_types) if layer_types else None
        if self.layer_types is not None:
            unknown = set(self.layer_types) - {_FULL, _SLIDING}
            if unknown:
                raise SpecdecError(f"unsupported attention layer types {sorted(unknown)} in {type(model).__name__}")
        window = getattr(cfg, "sliding_window", None)
        if self.layer_types is None and window and getattr(cfg, "use_sliding_window", True):
            self.single_mask_window = int(window)       # e.g. Mistral: every layer slides
        else:
            self.single_mask_window = 0
        self.sliding_window = int(window) if window else 0
        self.softcap = getattr(cfg, "final_logit_softcapping", None)

    @classmethod
    def from_pretrained(cls, path_or_dir: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "HFCausalLM":
        """Load from a local model directory or a local `.gguf` file (never downloads)."""
        from transformers import AutoModelForCausalLM

        p = Path(path_or_dir).expanduser()
        if not p.exists():
            raise SpecdecError(f"model not found: {p}")
        kwargs = dict(dtype=dtype, local_files_only=True)
        if p.is_file():
            if p.suffix != ".gguf":
                raise SpecdecError(f"expected a model directory or a .gguf file, got {p}")
            model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(p, **kwargs)
        return cls(model.to(device))

    # ---- the CausalLM properties -------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    @property
    def max_seq_len(self) -> int:
        return int(getattr(self.text_config, "max_position_embeddings", 0) or 2048)

    @property
    def batch_prefill_limit(self) -> int:
        """0: transformers' kernels promise no batch invariance, so every prompt is prefilled alone."""
        return 0

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self, rows: int, slots: int) -> HFCache:
        return HFCache(self.n_layers, rows, self.n_kv_heads, min(slots, self.max_seq_len), self.head_dim,
                       self.dtype, self.device)

    # ---- scoring ----------------------------------------------------------------
    def lm_head(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> float32 logits [..., V]."""
        logits = self.model.get_output_embeddings()(hidden.to(self.dtype)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def prefill(self, tokens: Tensor, positions: Tensor, cache: HFCache, rows: Tensor,
                features: tuple[int, ...] = ()) -> Tensor:
        """Prompts [G, P] -> hidden [G, P, H]: the causal forward."""
        return self.forward(tokens, positions, cache, rows, features=features)

    def forward_reusing(self, reuse: Reuse, positions: Tensor, cache: HFCache, rows: Tensor,
                        features: tuple[int, ...] = ()) -> Tensor:
        raise SpecdecError("a wrapped transformers model cannot reuse a self-speculative draft's layers "
                           "(method 'self' needs a lean GGUF target)")

    def forward(self, tokens: Tensor, positions: Tensor, cache: HFCache, rows: Tensor,
                tree_mask: Tensor | None = None, features: tuple[int, ...] = ()) -> Tensor:
        """tokens, positions [B, T]; rows [B]; tree_mask [B, T, T] or None (causal) -> hidden [B, T, H].

        Writes T scratch rows per sequence after its committed length; the caller commits.
        """
        from transformers import DynamicCache

        if features:
            raise SpecdecError("a wrapped transformers model returns no feature layers (EAGLE-3 needs a lean GGUF target)")
        B, T = tokens.shape
        cache.check_room(rows, T)
        dev = tokens.device
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        out = []
        for b in range(B):
            row = int(rows[b])
            L = int(cache.lengths[row])
            prefix = [(cache.k[i, row:row + 1, :, :L], cache.v[i, row:row + 1, :, :L]) for i in range(self.n_layers)]
            past = DynamicCache(ddp_cache_data=prefix)
            block = causal if tree_mask is None else tree_mask[b].to(torch.bool)
            pos = positions[b]
            visible = torch.cat([torch.ones(T, L, dtype=torch.bool, device=dev), block], dim=1)   # [T, L+T]
            kpos = torch.cat([torch.arange(L, device=dev), pos])                                   # [L+T]
            near = pos[:, None] - kpos[None, :]
            if self.layer_types is not None and _SLIDING in self.layer_types:
                # models with mixed layers take one prepared mask per layer type
                mask = {_FULL: self._additive(visible),
                        _SLIDING: self._additive(visible & (near < self.sliding_window))}
            elif self.single_mask_window:
                mask = self._additive(visible & (near < self.single_mask_window))
            else:
                mask = self._additive(visible)
            res = self.base(input_ids=tokens[b:b + 1], position_ids=pos[None], attention_mask=mask,
                            use_cache=True, **{self.cache_arg: past})
            pkv = getattr(res, self.cache_arg)
            for i in range(self.n_layers):
                layer = pkv.layers[i]
                if layer.keys.shape[-2] != L + T:
                    raise SpecdecError(f"layer {i} of {type(self.model).__name__} kept {layer.keys.shape[-2]} "
                                       f"key states, expected {L + T}")
                cache.write_block(row, i, layer.keys[0, :, L:], layer.values[0, :, L:])
            out.append(res.last_hidden_state[0])
        return torch.stack(out)

    def _additive(self, visible: Tensor) -> Tensor:
        """bool [T, S] -> additive float mask [1, 1, T, S] (0 where visible)."""
        m = torch.zeros(visible.shape, dtype=self.dtype, device=visible.device)
        m.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return m[None, None]
