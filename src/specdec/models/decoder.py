"""A lean decoder-only transformer (Llama family and Gemma 3), gpt-fast style.

Explicit positions into a static KV cache, one mask built per forward, no
framework. Models know nothing of speculation beyond "score these tokens at
these positions under this mask".
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import ForwardSlots, KVCache
from .attention import INVARIANT_MAX_T, KV_BLOCK, AttentionMask, attention
from .config import ModelConfig
from . import native
from .int4 import HEAD
from .kernels import DenseLinear, Kernel, fastest, linear, linear_top, pack, packed_linear_available

if TYPE_CHECKING:
    from ..verify import Reuse


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm computed in float32, returned in x's dtype. (GGUF stores Gemma's 1+w already.)"""
    y = F.rms_norm(_float(x), (x.shape[-1],), _float(w), eps)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _float(x: Tensor) -> Tensor:
    """x in float32, without an ATen call where it is already (a few microseconds each, 120 per token)."""
    return x if x.dtype == torch.float32 else x.float()


def _dense(x: Tensor) -> Tensor:
    """x contiguous, without an ATen call where it is already."""
    return x if x.is_contiguous() else x.contiguous()


def rope_tables(head_dim: int, base: float, max_len: int, scale: float = 1.0,
                freq_factors: tuple[float, ...] = ()) -> tuple[Tensor, Tensor]:
    """cos, sin [max_len, head_dim] in float32 on the CPU (NeoX layout: the two halves share angles); angle
    pos * scale * base^(-2i/head_dim) / freq_factors[i] (linear scaling, Llama 3.x frequency factors).
    Always computed on the CPU: under a meta-device context, building them took seconds."""
    cpu = torch.device("cpu")
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu) / head_dim))   # [hd/2]
    if freq_factors:
        inv = inv / torch.tensor(freq_factors, dtype=torch.float64, device=cpu)
    ang = (torch.arange(max_len, dtype=torch.float64, device=cpu) * scale)[:, None] * inv[None, :]   # [max_len, hd/2]
    cos, sin = ang.cos().float(), ang.sin().float()                      # each angle once, then both halves
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


@functools.lru_cache(maxsize=8)
def decoder_tables(head_dim: int, base: float, max_len: int, scale: float = 1.0,
                   freq_factors: tuple[float, ...] = ()) -> tuple[Tensor, Tensor]:
    """A decoder's rope buffers, cos and `signed_sin(sin)` [max_len, head_dim] (see `rope_tables`), made once per
    set of arguments and shared (read-only): a model's truncated copy (the self-check, early-exit drafts) and its
    drafts' cores ask for the same tables again (gemma3-270m's four [32768, 256] took 0.5 s). The cache holds
    only what the models keep."""
    cos, sin = rope_tables(head_dim, base, max_len, scale, freq_factors)
    return cos, signed_sin(sin)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, hd] float32; cos, sin [B, 1, T, hd]. Rotates the halves (NeoX / HF layout)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def signed_sin(sin: Tensor) -> Tensor:
    """sin [..., hd] -> [-first half | second half], the table `rope` multiplies the rolled x by."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope(x: Tensor, cos: Tensor, ssin: Tensor) -> Tensor:
    """apply_rope(x, cos, sin) bit for bit, ssin = signed_sin(sin), in 4 ATen calls instead of 7: x rolled
    by half is [x2 | x1], and x2 * -s equals -x2 * s exactly (negation does not round)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * ssin


def float32_prefill_pays(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prefills should run a narrow (bf16/fp16) model's linears on float32 copies.

    Measured on an AVX-512-bf16 Xeon without AMX (2 threads, [M, 576] x [576, 1536]): oneDNN's
    bf16 GEMM reaches 150-175 GFLOP/s for M >= 16, float32 190-290 from M >= 24, so a prompt's
    prefill is ~1.5x faster in float32. CPUs with AMX multiply bf16 far faster: not there.
    """
    amx = "AMX" in torch.backends.cpu.get_cpu_capability()
    return dtype != torch.float32 and packed_linear_available(device) and not amx


LINEARS = ("wqkv", "wo", "w13", "w2")
NO_NORM = torch.empty(0)                  # no q / k norm (Llama)
NO_VISIBLE = torch.empty(0, dtype=torch.bool)  # a causal chain's mask where the native kernel needs none
NO_ROPE = torch.empty(0)                  # its rope rows there (the kernel reads the tables at the positions)
NO_OUTPUT = torch.empty(0)                # a layer's input with nothing left to add (the first layer's)
NO_TREE_SLOTS, NO_TREE_VISIBLE = torch.empty(0, dtype=torch.long), torch.empty(0)   # a forward without tree tails
CAUSAL = torch.empty(0, 0, 0, dtype=torch.bool)  # a forward's tree mask for a causal chain (each row sees those before it)


def cfg_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.wqkv = nn.Parameter(torch.empty(qkv_out, cfg.dim))                 # fused q, k, v
        self.wo = nn.Parameter(torch.empty(cfg.dim, cfg.n_heads * cfg.head_dim))
        self.w13 = nn.Parameter(torch.empty(2 * cfg.hidden_dim, cfg.dim))      # fused gate, up
        self.w2 = nn.Parameter(torch.empty(cfg.dim, cfg.hidden_dim))
        self.attn_norm = nn.Parameter(torch.ones(cfg.dim))
        self.ffn_norm = nn.Parameter(torch.ones(cfg.dim))
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim))
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim))
        if cfg.sandwich_norm:
            self.post_attn_norm = nn.Parameter(torch.ones(cfg.dim))
            self.post_ffn_norm = nn.Parameter(torch.ones(cfg.dim))
        self.packed: dict[str, Kernel] = {}       # inference-only kernels of decoding and verification
        self.prefill_kernels: dict[str, Kernel] = {}  # prefill kernels where they differ (float32 copies, 4-bit mode)
        self.int4: set[str] = set()               # linears whose decoding kernel is 4-bit
        self.norms32: dict[str, Tensor] = {}      # float32 copies of narrow norm weights (made by `pack`)

    def _linear(self, x: Tensor, name: str, prefill: bool) -> Tensor:
        """x [N, in] @ weight.T; in a prefill through the prefill kernel if there is one."""
        kernels = self.prefill_kernels if prefill and name in self.prefill_kernels else self.packed
        return linear(x, self._parameters[name], kernels, name)

    def _w32(self, name: str) -> Tensor:
        """The norm weight `name` in float32: a copy made once by `Transformer.pack`, else converted here."""
        return self.norms32[name] if name in self.norms32 else _float(getattr(self, name))

    def _norm(self, x: Tensor, name: str) -> Tensor:
        return rms_norm(x, self._w32(name), self.cfg.norm_eps)

    def _attention(self, qkv: Tensor, cos: Tensor, ssin: Tensor, mask: AttentionMask, slots: ForwardSlots) -> Tensor:
        """The torch form of attention (no native kernel, or a prefill): qkv [B*T, (nh+2nkv)*hd] float32
        -> [B, T, nh, hd]."""
        cfg = self.cfg
        B, T = slots.rows.numel(), slots.t
        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv = qkv.view(B, T, nh + 2 * nkv, hd).transpose(1, 2)
        qk, v = qkv[:, :nh + nkv], qkv[:, nh + nkv:]                           # [B, nh+nkv, T, hd], [B, nkv, T, hd]
        if cfg.qk_norm:
            qk = torch.cat([F.rms_norm(qk[:, :nh], (hd,), self._w32("q_norm"), cfg.norm_eps),
                            F.rms_norm(qk[:, nh:], (hd,), self._w32("k_norm"), cfg.norm_eps)], dim=1)
        qk = rope(qk, cos, ssin)
        q, k = qk[:, :nh], qk[:, nh:]
        slots.write(self.layer, k, v)
        kc, vc = slots.read(self.layer)                                        # [B, nkv, S, hd] float32
        if mask.invariant:
            return attention(q, kc, vc, mask, cfg.scale).transpose(1, 2)
        return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask.mask, scale=cfg.scale,
                                              enable_gqa=nkv != nh).transpose(1, 2)

    def forward(self, x: Tensor, o: Tensor, cos: Tensor, ssin: Tensor, mask: AttentionMask, slots: ForwardSlots,
                prefill: bool) -> tuple[Tensor, Tensor]:
        """x [B*T, D] the residual stream of B sequences of T tokens, before the previous layer's output
        o [B*T, D] (empty: none) is added; cos, ssin [B, 1, T, hd] (see `rope`). Returns this layer's (x, o)
        alike: the next layer adds o in its first norm's call (one native call for the add and the norm)."""
        cfg = self.cfg
        B, T = slots.rows.numel(), slots.t
        nh, hd = cfg.n_heads, cfg.head_dim
        fused = (mask.native and x.is_contiguous() and x.dtype in native.DTYPES     # norms and adds: native
                 and (not o.numel() or (o.dtype == x.dtype and o.is_contiguous())))
        if fused:
            x, h = native.add_rms_norm(x, o, self._w32("attn_norm"), cfg.norm_eps)
        else:
            x = x + o if o.numel() else x
            h = self._norm(x, "attn_norm")
        qkv = self._linear(h, "wqkv", prefill)                                  # [B*T, (nh+2nkv)*hd]
        if mask.native:                                                        # rope, cache writes, attention: one call
            norms = (self._w32("q_norm"), self._w32("k_norm")) if cfg.qk_norm else (NO_NORM, NO_NORM)
            o = mask.attend(qkv, *norms, cfg.norm_eps, self.layer, x.dtype)
        else:
            o = self._attention(qkv.float(), cos, ssin, mask, slots).reshape(B * T, nh * hd).to(x.dtype)
        o = self._linear(o, "wo", prefill)
        if cfg.sandwich_norm:
            o = self._post_norm(o, "post_attn_norm", fused)
        if fused and o.dtype == x.dtype and o.is_contiguous():
            x, h = native.add_rms_norm(x, o, self._w32("ffn_norm"), cfg.norm_eps)
        else:
            x = x + o
            h = self._norm(x, "ffn_norm")
        gate, up = self._linear(h, "w13", prefill).chunk(2, dim=-1)           # [B*T, F] each
        act = F.gelu(gate, approximate="tanh") if cfg.gelu else F.silu(gate)   # torch's (a native loop was slower)
        o = self._linear(act * up, "w2", prefill)
        if cfg.sandwich_norm:
            o = self._post_norm(o, "post_ffn_norm", fused)
        return x, o

    def _post_norm(self, o: Tensor, name: str, fused: bool) -> Tensor:
        """A sandwich norm of a layer's output o [B*T, D]: the native norm where the layer's other norms are
        native (one call, as the native layer loop computes it), else torch's."""
        if fused and o.is_contiguous():
            return native.add_rms_norm(o, NO_OUTPUT, self._w32(name), self.cfg.norm_eps)[1]
        return self._norm(o, name)


class Transformer(nn.Module):
    """forward(tokens, positions, cache, rows, tree_mask) -> final-normed hidden [B, T, H]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.ones(cfg.dim))
        self.output = nn.Parameter(torch.empty(0))          # empty: tied to `embed`
        self.packed: dict[str, Kernel] = {}
        self.int4 = False                                   # decoding runs 4-bit kernels (see use_int4)
        self.head_kernels: dict[str, Kernel] = {}           # LM head candidates besides the dense one (see pack)
        self.loop: native.LayerLoop | None = None           # the layers as one native call (q4; see pack)
        cos, ssin = decoder_tables(cfg.head_dim, cfg.rope_base, cfg.max_seq_len, cfg.rope_scale,
                                   cfg.rope_freq_factors)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin_signed", ssin, persistent=False)                 # see `rope`
        if cfg.sliding_window > 0:
            lcos, lssin = decoder_tables(cfg.head_dim, cfg.rope_local_base, cfg.max_seq_len)
            self.register_buffer("lcos", lcos, persistent=False)
            self.register_buffer("lsin_signed", lssin, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def compute(self) -> str:
        """The compute mode: "float32", "bfloat16", or "q4" (4-bit kernels, activations in `dtype`)."""
        return "q4" if self.int4 else cfg_dtype_name(self.dtype)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def batch_prefill_limit(self) -> int:
        """Equal-length prompts up to INVARIANT_MAX_T tokens share a prefill once the weights are
        packed: `attention` and oneDNN's packed linears give each row the bits of a forward of its own
        (measured up to 6000 rows; tests/test_model.py). Plain F.linear (MKL, cuBLAS) changes kernels
        with the row count (fp32 MKL from 64 rows), so unpacked models, and the 4-bit mode's prefills (F.linear
        where the layer loop is not built; its forwards of `loop.max_rows` rows leave no room for a second prompt's
        piece), prefill one prompt piece per forward."""
        return INVARIANT_MAX_T if self.packed and not self.int4 else 0

    def new_cache(self, rows: int, slots: int, past_context: int = 0) -> KVCache:
        """A cache of `slots` per row, at most the context and `past_context` more (a draft head's scratch for a
        token tree at the end of the context)."""
        c = self.config
        # float32 cache even for bfloat16 weights: CPU attention is faster and exact-er in fp32
        n = -(-min(slots, c.max_seq_len + past_context) // KV_BLOCK) * KV_BLOCK   # whole key blocks
        return KVCache(c.n_layers, rows, c.n_kv_heads, n, c.head_dim, torch.float32, self.device)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        x = F.embedding(tokens, self.embed)
        if self.config.embed_scale != 1.0:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def lm_head(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] (or a forward's wider output with `features`) -> float32 logits [..., V]."""
        return _float(linear(*self._head_inputs(hidden), self.packed, "lm_head"))

    def lm_head_top(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """hidden [..., H] -> (float32 logits [..., V], their argmax [...] int64): the greedy tokens from the head's
        own call where its kernel finds them (`kernels.linear_top`)."""
        return linear_top(*self._head_inputs(hidden), self.packed, "lm_head")

    def _head_inputs(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(the final state [..., H] of `hidden`, a forward's output maybe wider with `features`; the head's weight)"""
        if hidden.shape[-1] != self.config.dim:
            hidden = hidden[..., :self.config.dim]
        return hidden, self.output if self.output.numel() else self.embed

    def final_norm(self, x: Tensor, o: Tensor = NO_OUTPUT) -> Tensor:
        """The final RMSNorm of the residual stream x [N, D] after the last layer's output o [N, D] (empty: nothing
        to add): in one native call where the layers' norms are native, else torch's add and norm."""
        if native.available(x.device) and x.dtype in native.DTYPES and (not o.numel() or o.dtype == x.dtype):
            return native.add_rms_norm(_dense(x), _dense(o), _float(self.norm), self.config.norm_eps)[1]
        return rms_norm(x + o if o.numel() else x, self.norm, self.config.norm_eps)

    def check_features(self, layers: tuple[int, ...]) -> tuple[int, ...]:
        """`layers` (0-based) if this model has them: a forward's `features` argument."""
        if any(not 0 <= i < self.config.n_layers for i in layers):
            raise ValueError(f"feature layers {layers} outside 0..{self.config.n_layers - 1}")
        return tuple(layers)

    def pack(self, float32_prefill: bool = True) -> "Transformer":
        """Prepack every linear weight for fast CPU inference (a no-op elsewhere). Re-pack after training.

        float32_prefill=False: no float32 prefill copies of a narrow model's linears, even where they pay.
        Linears that decode through 4-bit kernels (`use_int4`) keep them."""
        if not packed_linear_available(self.device):
            return self
        copies = float32_prefill and float32_prefill_pays(self.dtype, self.device) and not self.int4
        for layer in self.layers:
            layer.packed = {n: layer.packed[n] if n in layer.int4 else pack(getattr(layer, n)) for n in LINEARS}
            layer.prefill_kernels = ({n: pack(getattr(layer, n).float(), 128) for n in LINEARS} if copies
                                 else {n: DenseLinear(getattr(layer, n)) for n in layer.int4})
            layer.norms32 = {n: p.detach().float() for n, p in layer.named_parameters()
                             if n.endswith("norm") and p.dtype != torch.float32}
        self.packed = {"lm_head": self._head_kernel()}
        self.loop = native.LayerLoop.of(self) if self.int4 and native.available(self.device) else None
        return self

    def _head_kernel(self) -> Kernel:
        """The LM head's kernel: the prepacked dense head, or where `use_int4` gave others (an 8-bit head as
        4-bit halves) the fastest of them on this machine, measured at its first start (`kernels.fastest`)."""
        w = self.output if self.output.numel() else self.embed
        if not self.head_kernels:
            return pack(w)
        makers = {"dense": lambda: pack(w), **{n: (lambda k=k: k) for n, k in self.head_kernels.items()}}
        key = ("lm_head", *w.shape, cfg_dtype_name(w.dtype), *sorted(makers))
        if any(n.startswith("native") for n in makers):
            key += (native.source_stamp(),)                                   # a changed native kernel is timed again
        return fastest(key, makers, w)

    def use_int4(self, kernels: dict[tuple[int, str], Kernel]) -> "Transformer":
        """Decode and verify through 4-bit kernels ((layer, linear name) -> kernel, e.g. `int4.Int4Linear`);
        prefills run through the native layer loop where it is built (`prefill`), else F.linear on the
        dequantized weights (faster for many rows than torch's int4 kernel, no packed copy). The key `int4.HEAD`
        names an LM head candidate (timed against the dense head by `pack`).
        Call before `pack`."""
        for (i, name), k in kernels.items():
            if i == HEAD[0]:                                                 # an LM head candidate
                self.head_kernels["int4" if (i, name) == HEAD else name] = k
                continue
            self.layers[i].int4.add(name)
            self.layers[i].packed[name] = k
        self.int4 = self.int4 or any(i != HEAD[0] for i, _ in kernels)
        return self

    def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache, rows: Tensor,
                tree_mask: Tensor | None = None, features: tuple[int, ...] = ()) -> Tensor:
        """tokens, positions [B, T]; rows [B] cache rows; tree_mask [B, T, T] (None: causal chain)
        -> [B, T, H * (1 + len(features))]: the final-normed hidden state, then the outputs of the layers
        `features` names (0-based, in that order; drafters that read several depths, EAGLE-3). Consumers of
        the final state take [..., :H]; `lm_head` does.

        Writes T scratch rows per sequence; the caller commits what it keeps.
        """
        return self.forward_embeds(self.embed_tokens(tokens), positions, cache, rows, tree_mask, features=features)

    def prefill(self, tokens: Tensor, positions: Tensor, cache: KVCache, rows: Tensor,
                features: tuple[int, ...] = ()) -> Tensor:
        """Like forward over prompt pieces [G, P] (causal, after what the rows hold). Each position's bits
        depend only on the tokens up to it: not on G, nor on how a prompt is cut into pieces of up to
        INVARIANT_MAX_T tokens; they may differ in the last place from forward's, as a narrow model's
        linears run on float32 copies here where that is faster (see float32_prefill_pays).

        Where the native layer loop runs the 4-bit mode's forwards, a piece goes through it as forwards of up to
        `loop.max_rows` rows rather than through float32 products over the dequantized weights (faster: see
        docs/benchmarks.md); its kernels give each row the bits of a forward of its own, so a prompt is prefilled
        with exactly the bits that decoding it token by token would give."""
        x = self.embed_tokens(tokens)                                           # [G, P, D]
        G, P = tokens.shape
        loop = self.loop
        looped = loop is not None and native.available(x.device) and x.dtype == loop.dtype
        step = min(INVARIANT_MAX_T, loop.max_rows // G) if looped else 0    # rows per forward through the loop
        if step < 1 or P <= step:
            return self._forward(x, positions, cache, rows, CAUSAL, tree=False, prefill=step < 1, features=features)
        before = cache.lengths[rows].clone()                                    # [G] what the rows hold
        outs = []
        try:
            for s in range(0, P, step):                                         # each sub-piece sees those before it
                t = min(step, P - s)
                outs.append(self._forward(x[:, s:s + t], positions[:, s:s + t], cache, rows, CAUSAL, tree=False,
                                          prefill=False, features=features))
                cache.advance(rows, torch.full((G,), t, dtype=torch.long, device=x.device))
        finally:
            cache.lengths[rows] = before                                        # the caller commits
        return torch.cat(outs, 1)                                               # [G, P, H']

    def forward_reusing(self, reuse: "Reuse", positions: Tensor, cache: KVCache, rows: Tensor,
                        features: tuple[int, ...] = ()) -> Tensor:
        """Like forward over a causal chain whose first `reuse.layers` layers were computed already (by a
        self-speculative draft running this model's own layers): their keys and values go into the scratch
        slots, and layers N.. run from the given residual stream. Row-invariant kernels make the result the
        bits forward would give (tests/test_self.py)."""
        cache.check_room(rows, positions.shape[1])
        for i in range(reuse.layers):
            cache.write(i, rows, reuse.k[i], reuse.v[i])
        return self._forward(reuse.hidden, positions, cache, rows, CAUSAL, tree=False, prefill=False,
                             features=features, first_layer=reuse.layers)

    def forward_embeds(self, x: Tensor, positions: Tensor, cache: KVCache, rows: Tensor,
                       tree_mask: Tensor | None = None, exact_tree: bool = True,
                       features: tuple[int, ...] = ()) -> Tensor:
        """Like forward, from input vectors x [B, T, H] (EAGLE feeds fused token + feature vectors).

        exact_tree=False skips the per-node tails of a token tree (faster; for drafters, whose
        bits never reach the output: the same q drafts and is verified against)."""
        if tree_mask is None:
            return self._forward(x, positions, cache, rows, CAUSAL, tree=False, prefill=False, features=features)
        exact = exact_tree and positions.shape[1] <= INVARIANT_MAX_T
        return self._forward(x, positions, cache, rows, tree_mask, tree=exact,
                             prefill=False, features=features)

    def _forward(self, x: Tensor, positions: Tensor, cache: KVCache, rows: Tensor, tree_mask: Tensor,
                 *, tree: bool, prefill: bool, features: tuple[int, ...], first_layer: int = 0) -> Tensor:
        """tree_mask [B, T, T]: who sees whom among the forward's rows (CAUSAL: a chain at the scratch slots);
        tree: scratch slots are not positions (a token tree), so tails are gathered by position;
        prefill: a prompt piece (through the prefill kernels: float32 copies, or dense weights in q4)."""
        B, T = positions.shape
        self.check_features(features)
        lengths = cache.lengths[rows]                                          # [B]
        at = lengths.tolist()                                                  # each row's first scratch slot
        need = max(at) + T
        cache.check_fits(need)
        kv_len = -(-need // KV_BLOCK) * KV_BLOCK                               # whole key blocks
        use_native = T <= INVARIANT_MAX_T and native.available(x.device)
        # a causal chain through the native kernel needs neither a mask nor rope rows: it reads the positions
        chain = (use_native and tree_mask is CAUSAL and self.config.sliding_window == 0
                 and self.cos.dtype == torch.float32)
        visible = NO_VISIBLE if chain else self._mask(lengths, T, kv_len, tree_mask)
        nkv, nh = self.config.n_kv_heads, self.config.n_heads
        slots, tvis = NO_TREE_SLOTS, NO_TREE_VISIBLE
        tree = tree and not use_native                                         # the native kernel needs no tails
        if tree:
            slots, tvis, tail = self._tree_tails(lengths, positions, tree_mask, cache.slots)
            visible = visible & (torch.arange(kv_len, device=x.device) < tail[:, None])[:, None, None]
        mask = AttentionMask(visible, nkv, nh, slots, tvis, native=use_native)
        if chain:
            cos = sin = NO_ROPE
        else:
            cos, sin = _float(self.cos[positions])[:, None], _float(self.sin_signed[positions])[:, None]  # [B, 1, T, hd]
        if self.config.sliding_window > 0:
            lcos, lsin = _float(self.lcos[positions])[:, None], _float(self.lsin_signed[positions])[:, None]
            kpos = self._key_positions(lengths, positions, kv_len)
            window = positions[:, None, :, None] - kpos[:, :, None, :] < self.config.sliding_window
            if tree:
                vpos = tail[:, None, None] + torch.arange(tvis.shape[-1], device=x.device)
                tvis = tvis & (positions[:, :, None] - vpos < self.config.sliding_window)
            local = AttentionMask(visible & window, nkv, nh, slots, tvis, native=use_native)
        where = ForwardSlots(cache, rows, T, kv_len, lengths, at)
        if use_native:                                                         # checked once, used by every layer
            nh, scale = self.config.n_heads, self.config.scale
            mask.attend = (native.Attend.causal(self.cos, self.sin_signed, _dense(positions), cache.k, cache.v, where,
                                                nh, scale) if chain else
                           native.Attend(cos, sin, cache.k, cache.v, where, mask.mask[:, 0], nh, scale))
            if self.config.sliding_window > 0:
                local.attend = native.Attend(lcos, lsin, cache.k, cache.v, where, local.mask[:, 0], nh, scale)
        D = x.shape[-1]
        x = x.reshape(B * T, D)                                                # [B*T, D] rows of the residual stream
        taken: dict[int, Tensor] = {}
        o = NO_OUTPUT                                                          # a layer's output, added by the next
        normed = NO_OUTPUT                                                     # the final norm, where the loop made it
        loop, L = self.loop, len(self.layers)
        if (loop is not None and use_native and not prefill and B * T <= loop.max_rows and x.dtype == loop.dtype
                and x.is_contiguous()):                                        # the same kernels in one native call
            local_attend = local.attend if self.config.sliding_window > 0 else mask.attend
            start = first_layer
            for stop in sorted({i + 1 for i in features if i >= first_layer} | {L}):
                if stop == start:                                              # the caller ran every layer
                    break
                if stop == L:                                                  # the last layers and the final norm
                    x, normed = loop.normed(x, o, start, L, mask.attend, local_attend, _float(self.norm))
                    o = NO_OUTPUT                                              # x is x + o now
                else:
                    x, o = loop(x, o, start, stop, mask.attend, local_attend)
                if stop - 1 in features:
                    taken[stop - 1] = x + o if o.numel() else x
                start = stop
            first_layer = L
        for i in range(first_layer, L):                                        # below first_layer: done by the caller
            layer = self.layers[i]                                             # (forward_reusing)
            if self.config.is_local(i):
                x, o = layer(x, o, lcos, lsin, local, where, prefill)
            else:
                x, o = layer(x, o, cos, sin, mask, where, prefill)
            if i in features:
                taken[i] = x + o
        out = (normed if normed.numel() else self.final_norm(x, o)).view(B, T, D)
        if not features:
            return out
        # layers a caller ran itself (forward_reusing) have no output here: zeros
        return torch.cat([out, *(taken[i].view(B, T, D) if i in taken else torch.zeros_like(out) for i in features)], -1)

    @staticmethod
    def _tree_tails(lengths: Tensor, positions: Tensor, tree_mask: Tensor, n_slots: int) -> tuple[Tensor, Tensor, Tensor]:
        """Per node, the cache slots of its tail blocks laid out by position, and their visibility.

        Tail = the blocks from the one holding the committed length on: committed keys at their
        slots, then the node's ancestor at each depth. Returns slots, visible [B, T, 2*KV_BLOCK]
        and the first tail position [B].
        """
        B, T = positions.shape
        dev = positions.device
        depth = positions - lengths[:, None]                                   # [B, T]
        anc = torch.zeros(B, T, T + 1, dtype=torch.long, device=dev)           # anc[b, j, d]: node index
        at = torch.where(tree_mask, depth[:, None, :], T)                      # [B, T(node), T(key)]
        anc.scatter_(2, at, torch.arange(T, device=dev).expand(B, T, T).contiguous())
        tail = lengths // KV_BLOCK * KV_BLOCK                                  # [B]
        nq = int(((lengths - tail) + depth.amax(1)).amax()) // KV_BLOCK + 1     # tail blocks that hold nodes
        vpos = tail[:, None, None] + torch.arange(nq * KV_BLOCK, device=dev)   # [B, 1, W] positions
        rel = vpos - lengths[:, None, None]                                    # depth below the root
        committed = rel < 0
        on_path = (rel >= 0) & (rel <= depth[:, :, None])                      # [B, T, W]
        node = anc.gather(2, rel.clamp(0, T).expand(B, T, vpos.shape[-1]))
        slots = torch.where(committed, vpos, lengths[:, None, None] + node)
        visible = committed | on_path
        slots = torch.where(visible, slots, torch.zeros_like(slots)).clamp(max=n_slots - 1)
        return slots, visible, tail

    @staticmethod
    def _mask(lengths: Tensor, T: int, kv_len: int, tree_mask: Tensor) -> Tensor:
        """Visibility [B, 1, T, kv_len] (True = attend): every committed key, and of the T scratch slots after them
        what tree_mask [B, T, T] allows (CAUSAL: a chain's row t sees the scratch slots up to its own)."""
        B = lengths.shape[0]
        dev = lengths.device
        j = torch.arange(kv_len, device=dev)
        if tree_mask is CAUSAL:
            return (j < (lengths[:, None] + torch.arange(1, T + 1, device=dev))[:, :, None])[:, None]
        mask = (j[None, None, :] < lengths[:, None, None]).expand(B, T, kv_len).clone()
        scratch = lengths[:, None] + torch.arange(T, device=dev)               # [B, T]
        mask.scatter_(2, scratch[:, None, :].expand(B, T, T), tree_mask)
        return mask[:, None]

    @staticmethod
    def _key_positions(lengths: Tensor, positions: Tensor, kv_len: int) -> Tensor:
        """[B, 1, kv_len] the position of each key slot: a committed slot's index, the forward's positions
        [B, T] at its scratch slots."""
        B, T = positions.shape
        scratch = lengths[:, None] + torch.arange(T, device=lengths.device)   # [B, T]
        kpos = torch.arange(kv_len, device=lengths.device).expand(B, kv_len).clone()
        kpos.scatter_(1, scratch, positions)
        return kpos[:, None]


def truncated(model: Transformer, n_layers: int) -> Transformer:
    """The first n_layers of `model` plus its final norm and head, sharing weights (an early-exit draft)."""
    from dataclasses import replace

    cfg = replace(model.config, n_layers=n_layers, name=f"{model.config.name}[:{n_layers}]")
    with torch.device("meta"):
        out = Transformer(cfg)
    out.embed, out.norm, out.output = model.embed, model.norm, model.output
    out.layers = nn.ModuleList(list(model.layers)[:n_layers])
    out.cos, out.sin_signed = model.cos, model.sin_signed
    if cfg.sliding_window > 0:
        out.lcos, out.lsin_signed = model.lcos, model.lsin_signed
    out.packed, out.int4, out.loop = model.packed, model.int4, model.loop   # the loop runs layers [0, n_layers)
    return out.eval()


def materialize(module: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Give a module built under torch.device("meta") uninitialised storage on `device`, in place.
    (Module.to_empty goes through torch's Python reference ops, whose first use imports sympy: 0.4 s.)"""
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_meta:
                m._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    return module


def init_random(model: Transformer, seed: int = 0, std: float = 0.02) -> Transformer:
    """Random weights for tests (norms at one)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() == 0:
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model
