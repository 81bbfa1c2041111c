"""Attention whose result for a query does not depend on what else shares its forward.

Verifying K drafts must reproduce, bit for bit, what K + 1 one-token steps compute, so a query's
scores may not depend on how many tokens are scored with it (1 when decoding, K + 1 when verifying,
a token tree, a ragged batch). CPU GEMM libraries choose kernels by shape and SDPA splits work by
sequence length, so `attention` reads the cache in fixed blocks of KV_BLOCK keys, stacks the query
heads of a kv head as rows padded to whole tiles of ROW_TILE, and sums the blocks in position
order. Token trees get per-node tails laid out by position (`tree_tail_scores`). Forwards of more
than INVARIANT_MAX_T tokens (prefills) use SDPA: their bits are shared by every method.

The key blocks enter the score GEMM as a transposed view of the cache where that GEMM's rows are
invariant on this machine, else as a contiguous transposed copy (`keys_in_place`: MKL on an Intel
Xeon switches kernels by row count for a transposed [256 x 128] operand, head_dim 256 as Gemma's,
and not for a contiguous one).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

KV_BLOCK = 128             # keys per attention tile; caches are read in whole blocks
ROW_TILE = 8               # query rows per attention tile
INVARIANT_MAX_T = 72       # forwards of up to this many tokens (decode, verify, trees) use `attention`;
                           # longer ones (prefills) use SDPA, whose speed there matters more


def _no_attend(*args: object) -> Tensor:
    raise RuntimeError("this mask is scored by the torch form: no native attention was set up for it")


class AttentionMask:
    """Who sees whom in one forward: mask [B, 1, T, S] (True = attend), S a multiple of KV_BLOCK.

    Built once per forward, shared by every layer; `bias` gives it as 0 / -inf tiles laid
    out like the grouped queries in `attention`.
    """

    def __init__(self, mask: Tensor, n_kv: int, n_heads: int,
                 tree_slots: Tensor = torch.empty(0, dtype=torch.long), tree_visible: Tensor = torch.empty(0),
                 native: bool = False) -> None:
        self.mask, self.n_kv, self.n_heads = mask, n_kv, n_heads
        self.native = native          # scored by the native kernel (`native.Attend`: no blocks, no tails)
        self.attend: Callable[..., Tensor] = _no_attend  # with native: the forward's `native.Attend`
        self.tree_slots, self.tree_visible = tree_slots, tree_visible
        self._bias: dict[int, Tensor] = {}
        self._live: list[Tensor] = []
        self._parts: dict[tuple[int, int], AttentionMask] = {}

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

    def tokens(self, lo: int, hi: int) -> "AttentionMask":
        """The mask of query tokens lo..hi-1 alone (built once per forward, shared by every layer)."""
        key = (lo, hi)
        if key not in self._parts:
            tree = (self.tree_slots[:, lo:hi], self.tree_visible[:, lo:hi]) if self.tree else ()
            self._parts[key] = AttentionMask(self.mask[:, :, lo:hi], self.n_kv, self.n_heads, *tree)
        return self._parts[key]

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


_IN_PLACE: dict[tuple[int, torch.dtype, torch.device], bool] = {}


def keys_in_place(hd: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the score GEMM of q [M, hd] against a key block read in place (a transposed view of the
    cache) keeps each row's bits for every M (in whole tiles of ROW_TILE) on this machine; checked once
    per head size (`kernels.checked`). Where it does not, key blocks are copied contiguous first."""
    from .kernels import CHECK_ROWS, checked

    key = (hd, dtype, device)
    if key not in _IN_PLACE:
        if device.type != "cpu":
            _IN_PLACE[key] = True                       # no check proves GPU kernels invariant anyway
        else:
            cache = torch.randn(2 * KV_BLOCK, hd, generator=torch.Generator().manual_seed(0)).to(dtype)
            block = cache[:KV_BLOCK].t()[None]           # [1, hd, KB] a transposed view, as read from the cache

            def scores(x: Tensor) -> Tensor:             # x [M, hd] -> [M, KB], rows padded to whole tiles
                m = len(x)
                return torch.bmm(F.pad(x, (0, 0, 0, -m % ROW_TILE))[None], block)[0, :m]

            c = checked(("keys-in-place", hd, dtype, ROW_TILE), scores, hd, dtype)
            _IN_PLACE[key] = c.many_rows and c.lone_row and c.max_rows == CHECK_ROWS
    return _IN_PLACE[key]


_TOKENS: dict[tuple[int, int, int, torch.dtype, torch.device], int] = {}


def tokens_per_call(n_heads: int, n_kv: int, hd: int, dtype: torch.dtype, device: torch.device) -> int:
    """The most query tokens `attention` may score in one call on this machine with each token's bits
    those it gets alone; checked once per head layout (`kernels.checked`) on a random cache.

    Stacking a forward's tokens as rows of one GEMM is row-invariant where the GEMM's per-row bits do
    not depend on a row's place in the call; where they do (MKL's AVX2 kernels for head_dim 256: a
    query row at place 2 differs from the same row at place 1), tokens are scored in calls of fewer
    (down to one each: then the bits are those of plain decoding by construction)."""
    from .kernels import CHECK_ROWS, checked

    key = (n_heads, n_kv, hd, dtype, device)
    if key not in _TOKENS:
        if device.type != "cpu":
            _TOKENS[key] = CHECK_ROWS
        else:
            g = torch.Generator().manual_seed(1)
            S = 2 * KV_BLOCK
            k, v = (torch.randn(1, n_kv, S, hd, generator=g).to(dtype) for _ in range(2))
            visible = torch.zeros(1, 1, CHECK_ROWS, S, dtype=torch.bool)
            visible[..., :S - 40] = True                                      # two key blocks, the last in part

            def scores(x: Tensor) -> Tensor:                                  # x [T, nh*hd] queries -> [T, nh*hd]
                t = len(x)
                q = x.view(1, t, n_heads, hd).transpose(1, 2)
                mask = AttentionMask(visible[:, :, :t], n_kv, n_heads)
                return _attention(q, k, v, mask, hd ** -0.5).transpose(1, 2).reshape(t, -1)

            c = checked(("attention-tokens", n_heads, n_kv, hd, dtype, ROW_TILE, KV_BLOCK), scores, n_heads * hd, dtype)
            _TOKENS[key] = c.max_rows if c.many_rows and c.lone_row else 1
    return _TOKENS[key]


def _keys_t(k: Tensor, in_place: bool) -> Tensor:
    """k [..., KB, hd] -> [..., hd, KB]: a view, or a contiguous copy where the view's GEMM is not invariant."""
    kt = k.transpose(-1, -2)
    return kt if in_place else kt.contiguous()


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


def _block_scores(qg: Tensor, k: Tensor, live: list[Tensor], in_place: bool) -> Tensor:
    """qg [X, M, hd] (M a multiple of ROW_TILE) against key blocks of k [X, >= nb*KB, hd] -> [nb, X, M, KB].

    One batched GEMM per key block over the rows that see it (the others score -inf: see
    AttentionMask.live), reading the block in place (a strided view of the cache) when every row
    does and `keys_in_place` found that GEMM invariant, else from a contiguous copy; so the GEMM's
    per-row bits are the same for every M, and stacking the tiles as rows keeps each query's bits
    independent of how many share the forward.
    """
    return torch.stack([_block_bmm(qg, _keys_t(k[:, j * KV_BLOCK:(j + 1) * KV_BLOCK], in_place), rows, float("-inf"))
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
    """`_attention` over at most `tokens_per_call` query tokens per call (q [B, nh, T, hd] -> [B, nh, T, hd])."""
    T = q.shape[2]
    per_call = tokens_per_call(q.shape[1], k.shape[1], q.shape[3], k.dtype, k.device) if T > 1 else 1
    if T <= per_call:
        return _attention(q, k, v, mask, scale)
    return torch.cat([_attention(q[:, :, lo:lo + per_call], k, v, mask.tokens(lo, min(lo + per_call, T)), scale)
                      for lo in range(0, T, per_call)], dim=2)


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float) -> Tensor:
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
    in_place = keys_in_place(hd, k.dtype, k.device)
    s = _block_scores(qg, kx, live, in_place).view(nb, X, nt, ROW_TILE, KV_BLOCK)
    s.mul_(scale).add_(mask.bias())                                             # [nb, X, nt, R, KB]
    top = s.amax(-1, keepdim=True).amax(0, keepdim=True)                        # [1, X, nt, R, 1]
    if not mask.tree:
        p = torch.exp(s - top)
        l, o = _to_rows(p.sum(-1, keepdim=True), X, rows), _block_values(p, vx, X, rows, live)
        return (_sum_blocks(o) / _sum_blocks(l)).view(B, nh, T, hd)
    # a token tree: each node also attends over its own position-aligned tail blocks
    st, vt, R = tree_tail_scores(q, k, v, mask, scale, in_place)                          # st [B*nkv*T, nq, 1, R, KB]
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
                     scale: float, in_place: bool) -> tuple[Tensor, Tensor, int]:
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
    kq = _keys_t(_gather_slots(k, mask.tree_slots).view(B * nkv * T, nq, 1, KV_BLOCK, hd), in_place)
    vq = _gather_slots(v, mask.tree_slots).view(B * nkv * T, nq, 1, KV_BLOCK, hd)
    R = -(-g // ROW_TILE) * ROW_TILE
    qt = q.view(B, nkv, g, T, hd).permute(0, 1, 3, 2, 4).reshape(B * nkv * T, 1, 1, g, hd)
    qt = F.pad(qt, (0, 0, 0, R - g))                                            # [B*nkv*T, 1, 1, R, hd]
    return torch.matmul(qt, kq).mul_(scale).add_(mask.tail_bias(R)), vq, R
