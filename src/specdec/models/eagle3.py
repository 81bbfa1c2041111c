"""An EAGLE-3 draft head (Li et al. 2025): fused low/middle/high target features, trained as it is used.

At a committed position i the head reads g_i = fc([a_i^low; a_i^mid; a_i^high]) (the target's
residual stream entering three layers) and the next token x_{i+1}; one decoder layer whose q/k/v
take [norm(embed(x_{i+1})); norm(g_i)] (2H wide) gives h_i, and the head's own norm and
reduced-vocabulary LM head turn h_i into draft logits for x_{i+2}. Drafting deeper, h_i stands in
for the target's feature at the next position (no feature regression: the head learns what its own
h should be by training-time test, see train/eagle3.py). A deeper head (`extra_layers`, from
`train eagle3 --head-layers`) runs plain decoder layers over h after the midlayer; each has its own
keys and values in the head's cache.

Parameter names follow the layout vLLM's `LlamaForCausalLMEagle3` and SGLang load (`fc`,
`midlayer.*`, `norm`, `lm_head`), so export is a rename-free copy (`specdec export`). The head
drafts over `vocab_ids` (draft id -> target id; exported as d2t offsets). Token embeddings are the
target's, frozen.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import KVCache
from ..errors import SpecdecError
from .decoder import Transformer, apply_rope, rope_tables
from .eagle import fitting, read_weights, target_fingerprint, write_weights
from . import native
from .kernels import Kernel, fastest, linear, pack, packed_linear_available


@dataclass(frozen=True)
class Eagle3Config:
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float
    rope_base: float
    max_seq_len: int
    target_vocab: int
    draft_vocab: int
    aux_layers: tuple[int, ...]          # the residual stream entering these target layers (vLLM's ids)
    extra_layers: int = 0                # plain decoder layers after the midlayer (0: EAGLE-3's one layer)

    @staticmethod
    def for_target(target: Transformer, draft_vocab: int) -> "Eagle3Config":
        c = target.config
        L = c.n_layers
        return Eagle3Config(c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden_dim, c.norm_eps, c.rope_base,
                            c.max_seq_len, c.vocab_size, draft_vocab, (2, L // 2, L - 3))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * c.dim, c.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)


class MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.dim, c.hidden_dim, bias=False)
        self.up_proj = nn.Linear(c.dim, c.hidden_dim, bias=False)
        self.down_proj = nn.Linear(c.hidden_dim, c.dim, bias=False)


class MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.hidden_norm = RMSNorm(c.dim, c.norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.mlp = MLP(c)


class DecoderLayer(nn.Module):
    """A plain pre-norm decoder layer over the midlayer's output h [.., H] (a deeper head's extra layers)."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.post_attention_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.mlp = MLP(c)


class Eagle3Head(nn.Module):
    def __init__(self, target: Transformer, cfg: Eagle3Config, vocab_ids: Tensor) -> None:
        super().__init__()
        if len(vocab_ids) != cfg.draft_vocab:
            raise ValueError(f"{len(vocab_ids)} vocab ids for a draft vocabulary of {cfg.draft_vocab}")
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.dim, cfg.dim, bias=False)
        self.midlayer = MidLayer(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.extra_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.draft_vocab, bias=False)
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_base, cfg.max_seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.target = [target]                                 # not a submodule: frozen, never saved
        self.packed: dict[str, object] = {}

    @property
    def tgt(self) -> Transformer:
        return self.target[0]

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers (0-based) whose outputs are the aux features: the stream entering aux_layers."""
        return tuple(i - 1 for i in self.cfg.aux_layers)

    def init_from_target(self) -> "Eagle3Head":
        """Start the LM head from the target's rows of the draft vocabulary, the rest small and random."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0, 0.02)
            t = self.tgt
            w = t.output if t.output.numel() else t.embed
            self.lm_head.weight.copy_(w[self.vocab_ids].float())
        return self

    def _lin(self, x: Tensor, module: nn.Linear, name: str) -> Tensor:
        return linear(x, module.weight, self.packed, name) if self.packed else module(x)

    # ---- the pieces ------------------------------------------------------------------
    def input_features(self, target_hidden: Tensor) -> Tensor:
        """Target output with features [.., H*(1+3)] -> the fused feature g [.., H]."""
        H = self.cfg.dim
        return self._lin(target_hidden[..., H:].to(self.fc.weight.dtype), self.fc, "fc")

    def qkv(self, tokens: Tensor, hidden: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, nh, T, hd], k, v [B, nkv, T, hd] (float32, rope applied) of `layer` (0: the midlayer, whose
        input is tokens [B, T] with features hidden [B, T, H]; i >= 1: extra layer i over the previous
        layer's output hidden [B, T, H], tokens unused) at positions [B, T]."""
        c = self.cfg
        B, T = positions.shape
        if layer == 0:
            m = self.midlayer
            e = self.tgt.embed_tokens(tokens).to(hidden.dtype)
            x = torch.cat([m.input_layernorm(e), m.hidden_norm(hidden)], -1)                # [B, T, 2H]
        else:
            m = self.layers[layer - 1]
            x = m.input_layernorm(hidden)                                                  # [B, T, H]
        a, p = m.self_attn, f"{layer}." if layer else ""
        q = self._lin(x, a.q_proj, p + "q").float().view(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = self._lin(x, a.k_proj, p + "k").float().view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self._lin(x, a.v_proj, p + "v").float().view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]       # [B, 1, T, hd]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, hidden: Tensor, o: Tensor, layer: int = 0) -> Tensor:
        """Attention output o [B, nh, T, hd] of `layer` and the layer's residual input hidden [B, T, H] ->
        the layer's output h [B, T, H] (the last layer's: before the final norm)."""
        m = self.layers[layer - 1] if layer else self.midlayer
        p = f"{layer}." if layer else ""
        B, _, T, _ = o.shape
        x = hidden + self._lin(o.transpose(1, 2).reshape(B, T, -1).to(hidden.dtype), m.self_attn.o_proj, p + "o")
        h = m.post_attention_layernorm(x)
        gate, up = self._lin(h, m.mlp.gate_proj, p + "gate"), self._lin(h, m.mlp.up_proj, p + "up")
        return x + self._lin(F.silu(gate) * up, m.mlp.down_proj, p + "down")

    def logits(self, h: Tensor) -> Tensor:
        """Draft logits over the reduced vocabulary [.., V'] (float32)."""
        return self._lin(self.norm(h), self.lm_head, "lm_head").float()

    # ---- inference with a cache ------------------------------------------------------
    @property
    def max_seq_len(self) -> int:
        """Positions the head takes: its rotary table's (the target's)."""
        return self.cfg.max_seq_len

    def new_cache(self, rows: int, slots: int, past_context: int = 0) -> KVCache:
        """A cache of `slots` per row, at most the context and `past_context` more (tree scratch at its end)."""
        c = self.cfg
        return KVCache(1 + c.extra_layers, rows, c.n_kv_heads, min(slots, c.max_seq_len + past_context), c.head_dim,
                       torch.float32, self.fc.weight.device)

    def forward(self, tokens: Tensor, hidden: Tensor, positions: Tensor, cache: KVCache, rows: Tensor,
                tree_mask: Tensor | None = None) -> Tensor:
        """tokens/positions [B, T], input features hidden [B, T, H] -> h [B, T, H]; writes T scratch slots
        after each row's committed ones in every layer (tree_mask [B, T, T] among them; None: causal)."""
        c = self.cfg
        B, T = tokens.shape
        cache.check_room(rows, T)
        lone = B == 1 and tree_mask is None                # a lone row, causal: slots up to each token's own
        if lone:
            kv_len = int(cache.lengths[rows[0]]) + T
            mask = None if T == 1 else torch.ones(T, kv_len, dtype=torch.bool, device=tokens.device).tril(kv_len - T)
        else:
            lengths = cache.lengths[rows]
            kv_len = int(lengths.max()) + T
            if tree_mask is None:
                tree_mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril().expand(B, T, T)
            j = torch.arange(kv_len, device=tokens.device)
            vis = (j[None, None, :] < lengths[:, None, None]).expand(B, T, kv_len).clone()
            scratch = lengths[:, None] + torch.arange(T, device=tokens.device)      # [B, T]
            vis.scatter_(2, scratch[:, None, :].expand(B, T, T), tree_mask)
            mask = vis[:, None]                                                     # [B, 1, T, kv_len]
        h = hidden
        for layer in range(1 + c.extra_layers):
            q, k, v = self.qkv(tokens, h, positions, layer)
            cache.write(layer, rows, k, v)
            kc, vc = cache.read(layer, rows, kv_len, lone or rows.numel() == 1)     # [B, nkv, S, hd]
            o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=c.head_dim ** -0.5,
                                               enable_gqa=c.n_kv_heads != c.n_heads)
            h = self.finish(h, o, layer)
        return h

    def prepare(self, dtype: torch.dtype, kernel: Callable[[Tensor], Kernel] | None = None) -> "Eagle3Head":
        """Inference set-up: cast to the target's dtype and prepack the linears on CPU; beside a 4-bit target,
        each linear runs where it is fastest on this machine, prepacked or as 8-bit or 4-bit codes
        (`draft_kernel`; `kernel` forces one form, e.g. `eight_bit_kernel`). Where every linear runs as codes
        (which take float32 inputs as they take bfloat16 ones), the head computes in float32: its norms, adds
        and activations skip a bfloat16 round trip per op (the weights keep their rounding to `dtype`)."""
        self.to(dtype).eval().requires_grad_(False)
        self.cos, self.sin = self.cos.float(), self.sin.float()
        if packed_linear_available(self.fc.weight.device):
            a, m = self.midlayer.self_attn, self.midlayer.mlp
            mods = {"fc": self.fc, "q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj,
                    "gate": m.gate_proj, "up": m.up_proj, "down": m.down_proj, "lm_head": self.lm_head}
            for i, layer in enumerate(self.layers, 1):
                la, lm = layer.self_attn, layer.mlp
                mods |= {f"{i}.q": la.q_proj, f"{i}.k": la.k_proj, f"{i}.v": la.v_proj, f"{i}.o": la.o_proj,
                         f"{i}.gate": lm.gate_proj, f"{i}.up": lm.up_proj, f"{i}.down": lm.down_proj}
            coded = self.tgt.int4 and native.available(self.fc.weight.device)
            make = kernel or (draft_kernel if coded else pack)
            self.packed = {n: make(mod.weight) for n, mod in mods.items()}
            if all(isinstance(k, (native.Q8Rows, native.Q4Linear)) for k in self.packed.values()):
                self.to(torch.float32)
                self.packed = {n: replace(k, dtype=torch.float32) if isinstance(k, native.Q8Rows) else k
                               for n, k in self.packed.items()}
        return self

    # ---- persistence -------------------------------------------------------------------
    def save(self, path: Path, meta: dict) -> None:
        sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items() if k != "vocab_ids"}
        sd["vocab_ids"] = self.vocab_ids.to(torch.int32)
        cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.cfg).items()}
        info = {"kind": "eagle3", "config": json.dumps(cfg), "target": target_fingerprint(self.tgt),
                **{k: str(v) for k, v in meta.items()}}
        write_weights(path, sd, info)

    @staticmethod
    def load(path: Path, target: Transformer) -> "Eagle3Head":
        sd, meta = read_weights(path, "eagle3", target)
        with fitting(path, "an EAGLE-3 head"):
            raw = json.loads(meta["config"])
            cfg = Eagle3Config(**{**raw, "aux_layers": tuple(raw["aux_layers"])})
        return Eagle3Head.from_state(target, cfg, sd, str(path))

    @staticmethod
    def from_state(target: Transformer, cfg: Eagle3Config, sd: dict[str, Tensor], source: str) -> "Eagle3Head":
        """A ready head from tensors in our names (vocab_ids among them)."""
        with fitting(source, "an EAGLE-3 head"):
            head = Eagle3Head(target, cfg, sd.pop("vocab_ids").long())
            missing, unexpected = head.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
        if unexpected or [m for m in missing if m != "vocab_ids"]:
            raise SpecdecError(f"{source} does not fit an EAGLE-3 head: missing {missing}, unexpected {unexpected}")
        return head.prepare(target.dtype)


def draft_kernel(w: Tensor) -> Kernel:
    """A draft head's linear w [out, in]: prepacked in w's dtype, its Q8_0 codes through the native 8-bit
    kernel (`eight_bit_kernel`) or its Q4_1 codes through the native 4-bit one (`four_bit_kernel`), whichever
    is fastest here (timed at the first start, kept per machine). The coded forms change the drafts' last
    bits, never the output: drafts are only proposals. (The 4-bit form reads half the 8-bit form's bytes; the
    shipped smollm2-135m head drafted as well with it: docs/benchmarks.md, "A 4-bit EAGLE-3 head".)"""
    makers: dict[str, Callable[[], Kernel]] = {"onednn": lambda: pack(w)}
    if native.q4_fits(tuple(w.shape)):
        makers["native-q8r"] = lambda: eight_bit_kernel(w)
        makers["native-q4"] = lambda: four_bit_kernel(w)
    return fastest(("draft-linear", *w.shape, str(w.dtype).removeprefix("torch."), *sorted(makers),
                    native.source_stamp()), makers, w)


def eight_bit_kernel(w: Tensor) -> native.Q8Rows:
    """w [out, in] quantized to Q8_0 (by `gguf`, as llama.cpp does) in the native kernel's 16-row layout."""
    from gguf.quants import GGMLQuantizationType, quantize

    codes = native.q8_0_codes(quantize(w.detach().float().numpy(), GGMLQuantizationType.Q8_0), tuple(w.shape))
    return native.Q8Rows.of(codes["q"], codes["d"])


def four_bit_kernel(w: Tensor) -> native.Q4Linear:
    """w [out, in] quantized to Q4_1 (by `gguf`: per block of 32 inputs a scale, a minimum and 4-bit codes) in
    the native 4-bit kernel's layout, the target's own 4-bit arithmetic."""
    import numpy as np
    from gguf.quants import GGMLQuantizationType, quantize

    from .int4 import blocks_q4_1

    raw = np.asarray(quantize(w.detach().float().numpy(), GGMLQuantizationType.Q4_1)).view(np.uint8)
    b = blocks_q4_1(raw, tuple(w.shape))
    return native.Q4Linear.of(native.q4_layout(b.q, b.scale, b.zero))
