"""A lean decoder-only transformer (Llama family and Gemma 3), gpt-fast style.

Explicit positions into a static KV cache, one mask built per forward, no
framework. Models know nothing of speculation beyond "score these tokens at
these positions under this mask".
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import KVCache
from .config import ModelConfig
from .kernels import DenseLinear, Kernel, linear, pack, packed_linear_available


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm computed in float32, returned in x's dtype. (GGUF stores Gemma's 1+w already.)"""
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


def rope_tables(head_dim: int, base: float, max_len: int) -> tuple[Tensor, Tensor]:
    """cos, sin [max_len, head_dim] in float32 on the CPU (NeoX layout: the two halves share angles).
    Always computed on the CPU: under a meta-device context, building them took seconds."""
    cpu = torch.device("cpu")
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu) / head_dim))
    ang = torch.arange(max_len, dtype=torch.float64, device=cpu)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, hd] float32; cos, sin [B, 1, T, hd]. Rotates the halves (NeoX / HF layout)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def wide_prefill_pays(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prefills should run a narrow (bf16/fp16) model's linears on float32 copies.

    Measured on an AVX-512-bf16 Xeon without AMX (2 threads, [M, 576] x [576, 1536]): oneDNN's
    bf16 GEMM reaches 150-175 GFLOP/s for M >= 16, float32 190-290 from M >= 24, so a prompt's
    prefill is ~1.5x faster in float32. CPUs with AMX multiply bf16 far faster: not there.
    """
    amx = "AMX" in torch.backends.cpu.get_cpu_capability()
    return dtype != torch.float32 and packed_linear_available(device) and not amx


LINEARS = ("wqkv", "wo", "w13", "w2")


def cfg_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


KV_BLOCK = 128             # keys per attention tile; caches are read in whole blocks
ROW_TILE = 8               # query rows per attention tile
INVARIANT_MAX_T = 72       # forwards of up to this many tokens (decode, verify, trees) use `attention`;
                           # longer ones (prefills) use SDPA, whose speed there matters more


class AttentionMask:
    """Who sees whom in one forward: mask [B, 1, T, S] (True = attend), S a multiple of KV_BLOCK.

    Built once per forward, shared by every layer; `bias` gives it as 0 / -inf tiles laid
    out like the grouped queries in `attention`.
    """

    def __init__(self, mask: Tensor, n_kv: int, n_heads: int,
                 tree_slots: Tensor = torch.empty(0, dtype=torch.long), tree_visible: Tensor = torch.empty(0)) -> None:
        self.mask, self.n_kv, self.n_heads = mask, n_kv, n_heads
        self.tree_slots, self.tree_visible = tree_slots, tree_visible
        self._bias: dict[int, Tensor] = {}
        self._live: list[Tensor] = []

    def tail_bias(self, R: int) -> Tensor:
        """[B*nkv*T, nq, 1, R, KB] additive bias of the tree tails (built once per forward)."""
        if -1 not in self._bias:
            B, T, W = self.tree_visible.shape
            nq = W // KV_BLOCK
            bias = torch.zeros(self.tree_visible.shape, device=self.tree_visible.device)
            bias.masked_fill_(~self.tree_visible, float("-inf"))
            bias = bias.view(B, 1, T, 1, nq, 1, KV_BLOCK).expand(B, self.n_kv, T, 1, nq, R, KV_BLOCK)
            self._bias[-1] = bias.reshape(B * self.n_kv * T, 1, nq, R, KV_BLOCK).transpose(1, 2)
        return self._bias[-1]

    def live(self) -> list[Tensor]:
        """Per key block, the indices into B*nkv of the (sequence, kv head) rows with a visible key in it.

        In a ragged batch the short sequences see only the first of the kv_len // KV_BLOCK blocks that the
        longest one needs; their scores and values there would be exact zeros, so they are skipped."""
        if not self._live:
            m = self.mask                                                       # [B, 1, T, S]
            B, _, T, S = m.shape
            seen = m.view(B, T, S // KV_BLOCK, KV_BLOCK).any(-1).any(1)         # [B, nb]
            seen = seen.repeat_interleave(self.n_kv, 0)                         # [B*nkv, nb]
            self._live = [seen[:, j].nonzero()[:, 0] for j in range(seen.shape[1])]
        return self._live

    @property
    def tree(self) -> bool:
        """A token tree: each query also gets its own position-aligned tail blocks (see `tree_attention`)."""
        return self.tree_slots.numel() > 0

    @property
    def length(self) -> int:
        return self.mask.shape[2]

    @property
    def invariant(self) -> bool:
        """Score with the row-invariant `attention` (else SDPA: a prefill, never compared bit for bit)."""
        return self.length <= INVARIANT_MAX_T

    def bias(self) -> Tensor:
        """[nb, B*nkv, nt, ROW_TILE, KV_BLOCK] additive bias of all queries (built once per forward)."""
        if 0 in self._bias:
            return self._bias[0]
        m = self.mask                                                           # [B, 1, t, S]
        B, _, t, S = m.shape
        nb, g = S // KV_BLOCK, self.n_heads // self.n_kv
        rows = g * t
        nt = -(-rows // ROW_TILE)
        out = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill_(~m, float("-inf"))
        out = out.view(B, 1, 1, t, nb, KV_BLOCK).expand(B, self.n_kv, g, t, nb, KV_BLOCK)
        out = out.permute(4, 0, 1, 2, 3, 5).reshape(nb, B * self.n_kv, rows, KV_BLOCK)
        out = F.pad(out, (0, 0, 0, nt * ROW_TILE - rows)).view(nb, B * self.n_kv, nt, ROW_TILE, KV_BLOCK)
        self._bias[0] = out
        return out


def _to_rows(x: Tensor, X: int, rows: int) -> Tensor:
    """[nb, X, nt, R, d] per-tile block results -> [nb, X * rows, d], contiguous (tile padding dropped)."""
    nb, _, nt, R, d = x.shape
    return x.reshape(nb, X, nt * R, d)[:, :, :rows].reshape(nb, X * rows, d).contiguous()


def _block_bmm(a: Tensor, b: Tensor, live: Tensor, fill: float) -> Tensor:
    """bmm(a [X, M, n], b [X, n, m]) on the `live` rows of X; the others are `fill` (exact, not computed)."""
    if live.numel() == a.shape[0]:
        return torch.bmm(a, b)
    out = a.new_full((a.shape[0], a.shape[1], b.shape[2]), fill)
    return out.index_copy_(0, live, torch.bmm(a.index_select(0, live), b.index_select(0, live)))


def _block_scores(qg: Tensor, k: Tensor, live: list[Tensor]) -> Tensor:
    """qg [X, M, hd] (M a multiple of ROW_TILE) against key blocks of k [X, >= nb*KB, hd] -> [nb, X, M, KB].

    One batched GEMM per key block over the rows that see it (the others score -inf: see
    AttentionMask.live), reading the block in place (a strided view of the cache) when every row
    does; measured, the fp32 GEMM's per-row bits are the same for every M >= 3, so stacking
    the tiles as rows keeps each query's bits independent of how many share the forward.
    """
    return torch.stack([_block_bmm(qg, k[:, j * KV_BLOCK:(j + 1) * KV_BLOCK].transpose(1, 2), rows, float("-inf"))
                        for j, rows in enumerate(live)])


def _block_values(p: Tensor, v: Tensor, X: int, rows: int, live: list[Tensor]) -> Tensor:
    """p [nb, X, nt, R, KB] (probabilities per key block) @ value blocks of v [X, >= nb*KB, hd] -> [nb, X * rows, hd]."""
    nb, _, nt, R, _ = p.shape
    pb = p.view(nb, X, nt * R, KV_BLOCK)
    o = torch.stack([_block_bmm(pb[j], v[:, j * KV_BLOCK:(j + 1) * KV_BLOCK], live[j], 0.0) for j in range(nb)])
    return o[:, :, :rows].reshape(nb, X * rows, v.shape[-1])


def _sum_blocks(x: Tensor) -> Tensor:
    """x [n, ...] -> x[0] + x[1] + ... in that order. torch's sum over a short dim may associate
    differently for different n, and a token tree sums more blocks (its tails) than a chain does."""
    acc = x[0]
    for i in range(1, x.shape[0]):
        acc = acc + x[i]
    return acc


def attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float) -> Tensor:
    """Attention whose result for a query does not depend on what else is in the forward.

    q [B, nh, T, hd]; k, v [B, nkv, S, hd] with S a multiple of KV_BLOCK -> [B, nh, T, hd].
    CPU GEMM libraries pick kernels (and so rounding) by matrix shape, SDPA's CPU kernel splits
    work by sequence length, and vectorised exp differs from the scalar exp used on loop tails.
    Here every GEMM reads whole key blocks of KV_BLOCK positions: the g = nh/nkv heads sharing
    a kv head are stacked as rows (padded to whole tiles of ROW_TILE rows) against each key block.
    Scores of all blocks share the query's global max, so exp runs only on whole KV_BLOCK rows;
    per block p.sum and p @ v, then sums over blocks in position order (blocks a query cannot see
    add exact zeros) and one division. So a token scored alone, with its drafts, in a token tree
    or in a ragged batch gets the same bits (tests/test_model.py). Prefills (more than
    INVARIANT_MAX_T tokens) use SDPA.
    """
    B, nh, T, hd = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g, nb = nh // nkv, S // KV_BLOCK
    X, rows = B * nkv, g * T
    nt = -(-rows // ROW_TILE)
    kx, vx = k.reshape(X, S, hd), v.reshape(X, S, hd)                           # views of the cache rows
    qg = F.pad(q.reshape(X, rows, hd), (0, 0, 0, nt * ROW_TILE - rows))         # [X, M, hd]
    live = mask.live()
    s = _block_scores(qg, kx, live).view(nb, X, nt, ROW_TILE, KV_BLOCK)
    s.mul_(scale).add_(mask.bias())                                             # [nb, X, nt, R, KB]
    top = s.amax(-1, keepdim=True).amax(0, keepdim=True)                        # [1, X, nt, R, 1]
    if not mask.tree:
        p = torch.exp(s - top)
        l, o = _to_rows(p.sum(-1, keepdim=True), X, rows), _block_values(p, vx, X, rows, live)
        return (_sum_blocks(o) / _sum_blocks(l)).view(B, nh, T, hd)
    # a token tree: each node also attends over its own position-aligned tail blocks
    st, vt, R = tree_tail_scores(q, k, v, mask, scale)                          # st [B*nkv*T, nq, 1, R, KB]
    tail_top = st.amax(-1, keepdim=True).amax(1, keepdim=True)                  # [B*nkv*T, 1, 1, R, 1]
    node_rows = tail_top[:, 0, 0, :g, 0].reshape(B, nkv, T, g).transpose(2, 3).reshape(X, rows)
    shared = _to_rows(top, X, rows)[0, :, 0].view(X, rows)
    best = torch.maximum(shared, node_rows)                                     # [X, rows] the query's max
    top = F.pad(best, (0, nt * ROW_TILE - rows)).view(1, X, nt, ROW_TILE, 1)
    per_node = F.pad(best.view(B, nkv, g, T).transpose(2, 3).reshape(B * nkv * T, 1, 1, g, 1),
                     (0, 0, 0, R - g))
    p, pt = torch.exp(s - top), torch.exp(st - per_node)
    l, o = _to_rows(p.sum(-1, keepdim=True), X, rows), _block_values(p, vx, X, rows, live)
    nq = st.shape[1]
    lt, ot = (x[:, :, 0, :g].reshape(B, nkv, T, nq, g, x.shape[-1]).permute(3, 0, 1, 4, 2, 5)
              .reshape(nq, X * rows, x.shape[-1]) for x in (pt.sum(-1, keepdim=True), torch.matmul(pt, vt)))
    o = _sum_blocks(torch.cat([o, ot])) / _sum_blocks(torch.cat([l, lt]))
    return o.view(B, nh, T, hd)


def _gather_slots(x: Tensor, slots: Tensor) -> Tensor:
    """x [B, nkv, S, hd] (a view of cache rows), slots [B, T, W] -> [B*nkv*T*W, hd]: the vectors at those slots.

    One index_select of whole hd-vectors from the cache's storage (as rows of hd): a plain
    row copy, where indexing a permuted view takes a slow elementwise path.
    """
    B, nkv, S, hd = x.shape
    if x.stride(3) != 1 or x.stride(2) != hd or x.stride(1) % hd or x.stride(0) % hd:
        x = x.contiguous()
    base = (torch.arange(B, device=x.device)[:, None] * x.stride(0)
            + torch.arange(nkv, device=x.device)[None, :] * x.stride(1)) // hd           # [B, nkv]
    idx = base[:, :, None, None] + slots[:, None]                                          # [B, nkv, T, W]
    rows = x.as_strided(((B - 1) * x.stride(0) // hd + (nkv - 1) * x.stride(1) // hd + S, hd), (hd, 1))
    return rows.index_select(0, idx.reshape(-1))


def tree_tail_scores(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask,
                     scale: float) -> tuple[Tensor, Tensor, int]:
    """Scores of each tree node over its own nq position-aligned tail blocks, and those blocks' values.

    A tree node's ancestors sit at scratch slots that are not their positions, so the tail
    blocks (from the committed length's block on) are gathered per node by position: the
    committed keys, then the node's ancestor at each depth, exactly the keys (and key offsets)
    a chain along the node's path has; the shared part of the mask hides those blocks.
    Returns scores [B*nkv*T, nq, 1, R, KB], values [B*nkv*T, nq, 1, KB, hd] and R (rows per tile).
    """
    B, nh, T, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    nq = mask.tree_slots.shape[-1] // KV_BLOCK
    kq = _gather_slots(k, mask.tree_slots).view(B * nkv * T, nq, 1, KV_BLOCK, hd).transpose(-1, -2)
    vq = _gather_slots(v, mask.tree_slots).view(B * nkv * T, nq, 1, KV_BLOCK, hd)
    R = -(-g // ROW_TILE) * ROW_TILE
    qt = q.view(B, nkv, g, T, hd).permute(0, 1, 3, 2, 4).reshape(B * nkv * T, 1, 1, g, hd)
    qt = F.pad(qt, (0, 0, 0, R - g))                                            # [B*nkv*T, 1, 1, R, hd]
    return torch.matmul(qt, kq).mul_(scale).add_(mask.tail_bias(R)), vq, R


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
        self.packed_wide: dict[str, Kernel] = {}  # prefill kernels where they differ (float32 copies, 4-bit mode)
        self.int4: set[str] = set()               # linears whose decoding kernel is 4-bit

    def _linear(self, x: Tensor, name: str, wide: bool) -> Tensor:
        """x [B, T, in] @ weight.T; wide (a prefill): through the prefill kernel if there is one."""
        kernels = self.packed_wide if wide and name in self.packed_wide else self.packed
        return linear(x, getattr(self, name), kernels, name)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: AttentionMask, cache: KVCache,
                rows: Tensor, kv_len: int, contiguous: bool, wide: bool) -> Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        h = rms_norm(x, self.attn_norm, cfg.norm_eps)
        qkv = self._linear(h, "wqkv", wide).float()                                    # [B, T, (nh+2nkv)*hd]
        qk = qkv[..., :(nh + nkv) * hd].view(B, T, nh + nkv, hd).transpose(1, 2)  # [B, nh+nkv, T, hd]
        v = qkv[..., (nh + nkv) * hd:].view(B, T, nkv, hd).transpose(1, 2)     # [B, nkv, T, hd]
        if cfg.qk_norm:
            qk = torch.cat([F.rms_norm(qk[:, :nh], (hd,), self.q_norm.float(), cfg.norm_eps),
                            F.rms_norm(qk[:, nh:], (hd,), self.k_norm.float(), cfg.norm_eps)], dim=1)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :nh], qk[:, nh:]
        cache.write(self.layer, rows, k, v, contiguous)
        kc, vc = cache.read(self.layer, rows, kv_len, contiguous)              # [B, nkv, S, hd] float32
        if mask.invariant:
            o = attention(q, kc, vc, mask, cfg.scale)                          # [B, nh, T, hd]
        else:
            o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask.mask, scale=cfg.scale,
                                               enable_gqa=nkv != nh)

        o = self._linear(o.transpose(1, 2).reshape(B, T, nh * hd).to(x.dtype), "wo", wide)
        if cfg.sandwich_norm:
            o = rms_norm(o, self.post_attn_norm, cfg.norm_eps)
        x = x + o
        h = rms_norm(x, self.ffn_norm, cfg.norm_eps)
        gate, up = self._linear(h, "w13", wide).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if cfg.gelu else F.silu(gate)
        o = self._linear(act * up, "w2", wide)
        if cfg.sandwich_norm:
            o = rms_norm(o, self.post_ffn_norm, cfg.norm_eps)
        return x + o


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
        self.feature_layers: tuple[int, ...] = ()           # see `features`
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_base, cfg.max_seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        if cfg.sliding_window > 0:
            lcos, lsin = rope_tables(cfg.head_dim, cfg.rope_local_base, cfg.max_seq_len)
            self.register_buffer("lcos", lcos, persistent=False)
            self.register_buffer("lsin", lsin, persistent=False)

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
        with the row count (fp32 MKL from 64 rows), so unpacked models, and the 4-bit mode's prefills,
        prefill one prompt piece per forward."""
        return INVARIANT_MAX_T if self.packed and not self.int4 else 0

    def new_cache(self, rows: int, slots: int) -> KVCache:
        c = self.config
        # float32 cache even for bfloat16 weights: CPU attention is faster and exact-er in fp32
        n = -(-min(slots, c.max_seq_len) // KV_BLOCK) * KV_BLOCK                # whole key blocks
        return KVCache(c.n_layers, rows, c.n_kv_heads, n, c.head_dim, torch.float32, self.device)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        x = F.embedding(tokens, self.embed)
        if self.config.embed_scale != 1.0:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def lm_head(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] (or the wider output of `features`) -> float32 logits [..., V]."""
        w = self.output if self.output.numel() else self.embed
        return linear(hidden[..., :self.config.dim], w, self.packed, "lm_head").float()

    def features(self, layers: tuple[int, ...]) -> "Transformer":
        """From now on, forwards return [B, T, H * (1 + len(layers))]: the final-normed hidden state,
        then the outputs of these layers (0-based, in this order), for drafters that read several
        depths of the target (EAGLE-3). Consumers of the final state take [..., :H]."""
        if any(not 0 <= i < self.config.n_layers for i in layers):
            raise ValueError(f"feature layers {layers} outside 0..{self.config.n_layers - 1}")
        self.feature_layers = tuple(layers)
        return self

    def pack(self, wide: bool = True) -> "Transformer":
        """Prepack every linear weight for fast CPU inference (a no-op elsewhere). Re-pack after training.

        wide=False: no float32 prefill copies of a narrow model's linears, even where they pay.
        Linears that decode through 4-bit kernels (`use_int4`) keep them."""
        if not packed_linear_available(self.device):
            return self
        wide = wide and wide_prefill_pays(self.dtype, self.device) and not self.int4
        for layer in self.layers:
            layer.packed = {n: layer.packed[n] if n in layer.int4 else pack(getattr(layer, n)) for n in LINEARS}
            layer.packed_wide = ({n: pack(getattr(layer, n).float(), 128) for n in LINEARS} if wide
                                 else {n: DenseLinear(getattr(layer, n)) for n in layer.int4})
        self.packed = {"lm_head": pack(self.output if self.output.numel() else self.embed)}
        return self

    def use_int4(self, kernels: dict[tuple[int, str], Kernel]) -> "Transformer":
        """Decode and verify through 4-bit kernels ((layer, linear name) -> kernel, e.g. `int4.Int4Linear`);
        prefills of those layers run F.linear on the dequantized weights (faster for many rows, no packed
        copy). Call before `pack`."""
        for (i, name), k in kernels.items():
            self.layers[i].int4.add(name)
            self.layers[i].packed[name] = k
        self.int4 = self.int4 or bool(kernels)
        return self

    def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache, rows: Tensor,
                tree_mask: Tensor | None = None) -> Tensor:
        """tokens, positions [B, T]; rows [B] cache rows; tree_mask [B, T, T] (None: causal chain).

        Writes T scratch rows per sequence; the caller commits what it keeps.
        """
        return self.forward_embeds(self.embed_tokens(tokens), positions, cache, rows, tree_mask)

    def prefill(self, tokens: Tensor, positions: Tensor, cache: KVCache, rows: Tensor) -> Tensor:
        """Like forward over prompt pieces [G, P] (causal, after what the rows hold). Each position's bits
        depend only on the tokens up to it: not on G, nor on how a prompt is cut into pieces of up to
        INVARIANT_MAX_T tokens; they may differ in the last place from forward's, as a narrow model's
        linears run on float32 copies here where that is faster (see wide_prefill_pays)."""
        B, T = positions.shape
        causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril().expand(B, T, T)
        return self._forward(self.embed_tokens(tokens), positions, cache, rows, causal, False, True)

    def forward_embeds(self, x: Tensor, positions: Tensor, cache: KVCache, rows: Tensor,
                       tree_mask: Tensor | None = None, exact_tree: bool = True) -> Tensor:
        """Like forward, from input vectors x [B, T, H] (EAGLE feeds fused token + feature vectors).

        exact_tree=False skips the per-node tails of a token tree (faster; for drafters, whose
        bits never reach the output: the same q drafts and is verified against)."""
        B, T = positions.shape
        if tree_mask is None:
            return self._forward(x, positions, cache, rows, torch.ones(T, T, dtype=torch.bool, device=x.device)
                                 .tril().expand(B, T, T), False, False)
        return self._forward(x, positions, cache, rows, tree_mask, exact_tree and T <= INVARIANT_MAX_T, False)

    def _forward(self, x: Tensor, positions: Tensor, cache: KVCache, rows: Tensor, tree_mask: Tensor,
                 tree: bool, wide: bool) -> Tensor:
        """tree: scratch slots are not positions (a token tree), so tails are gathered by position;
        wide: the float32 copies of the linears (prefill)."""
        B, T = positions.shape
        cache.check_room(rows, T)
        lengths = cache.lengths[rows]                                          # [B]
        kv_len = -(-(int(lengths.max()) + T) // KV_BLOCK) * KV_BLOCK          # whole key blocks
        contiguous = bool(rows.numel() == 1 or torch.equal(rows, torch.arange(int(rows[0]), int(rows[0]) + B, device=rows.device)))
        visible, kpos = self._mask(lengths, positions, T, kv_len, tree_mask)
        nkv, nh = self.config.n_kv_heads, self.config.n_heads
        slots, tvis = torch.empty(0, dtype=torch.long), torch.empty(0)
        if tree:
            slots, tvis, tail = self._tree_tails(lengths, positions, tree_mask, cache.slots)
            visible = visible & (torch.arange(kv_len, device=x.device) < tail[:, None])[:, None, None]
        mask = AttentionMask(visible, nkv, nh, slots, tvis)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, T, hd]
        if self.config.sliding_window > 0:
            lcos, lsin = self.lcos[positions][:, None], self.lsin[positions][:, None]
            window = positions[:, None, :, None] - kpos[:, :, None, :] < self.config.sliding_window
            if tree:
                vpos = tail[:, None, None] + torch.arange(tvis.shape[-1], device=x.device)
                tvis = tvis & (positions[:, :, None] - vpos < self.config.sliding_window)
            local = AttentionMask(visible & window, nkv, nh, slots, tvis)
        taken: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            if self.config.is_local(i):
                x = layer(x, lcos, lsin, local, cache, rows, kv_len, contiguous, wide)
            else:
                x = layer(x, cos, sin, mask, cache, rows, kv_len, contiguous, wide)
            if i in self.feature_layers:
                taken[i] = x
        out = rms_norm(x, self.norm, self.config.norm_eps)
        return torch.cat([out, *(taken[i] for i in self.feature_layers)], -1) if self.feature_layers else out

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
    def _mask(lengths: Tensor, positions: Tensor, T: int, kv_len: int,
              tree_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Visibility [B, 1, T, kv_len] (True = attend) and key positions [B, 1, kv_len]."""
        B = lengths.shape[0]
        dev = lengths.device
        j = torch.arange(kv_len, device=dev)
        mask = (j[None, None, :] < lengths[:, None, None]).expand(B, T, kv_len).clone()
        scratch = lengths[:, None] + torch.arange(T, device=dev)               # [B, T]
        mask.scatter_(2, scratch[:, None, :].expand(B, T, T), tree_mask)
        kpos = j.expand(B, kv_len).clone()
        kpos.scatter_(1, scratch, positions)
        return mask[:, None], kpos[:, None]


def truncated(model: Transformer, n_layers: int) -> Transformer:
    """The first n_layers of `model` plus its final norm and head, sharing weights (an early-exit draft)."""
    from dataclasses import replace

    cfg = replace(model.config, n_layers=n_layers, name=f"{model.config.name}[:{n_layers}]")
    with torch.device("meta"):
        out = Transformer(cfg)
    out.embed, out.norm, out.output = model.embed, model.norm, model.output
    out.layers = nn.ModuleList(list(model.layers)[:n_layers])
    out.cos, out.sin = model.cos, model.sin
    if cfg.sliding_window > 0:
        out.lcos, out.lsin = model.lcos, model.lsin
    out.packed, out.int4 = model.packed, model.int4
    return out.eval()


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
