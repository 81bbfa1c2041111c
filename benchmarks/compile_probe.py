"""What `torch.compile` (inductor, CPU) would buy the decoding forward, on this machine.

One process, five decoders of the same q4 weights (the model's own checked kernels), timed
round-robin one token at a time so that load on the machine hits all of them alike:

- `production`: the model's forward (row-invariant `attention`, kernels through `linear`) and its head;
- `sublayers`: the same forward with the two halves of every layer around the attention (norm, qkv
  linear, rope | output linear, residual, norm, MLP) each compiled (`torch.compile(dynamic=True)`);
- `layers`: every layer of a decoding or verification forward one compiled graph (`layer` below:
  norm, qkv, rope, the cache write, a row-invariant block attention, output projection, MLP), with
  dynamic sizes; the row-invariance of its bits is checked like `sublayers`' (1, 2, 5 rows against 8,
  across a key block, in a batch of two, one token at a time);
- `stack`: every layer of a causal decoding or verification forward (`layer`, in order) and the final
  norm one compiled graph (`stack`), the whole cache one mutated input;
- `simple`: a plain decoding loop over a fixed key window (one bmm + softmax per layer, not
  row-invariant: what a forward costs with the least eager overhead);
- `simple-compiled`: that loop compiled as one graph (`fullgraph=True`); the LM head stays outside
  (inductor lowers oneDNN-packed linears only for frozen constants).

It prints ms per token (median and fastest of the interleaved tokens), the first call's compile
time, and the row checks. Compiled graphs are cached by inductor across runs (its FX graph cache):
the compile time of a second run is the cached one. With `TORCH_LOGS=recompiles` it shows why
`layers` compiles several graphs (sizes of one are specialised: one token, one sequence, one key
block).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compile_probe.py --tokens 60
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.api import load_model
from specdec.machine import cpu_model, probe
from specdec.models.attention import INVARIANT_MAX_T, KV_BLOCK, ROW_TILE, AttentionMask, attention, keys_in_place
from specdec.models.decoder import Block, Transformer, apply_rope, rms_norm
from specdec.models.int4 import GROUP

BF16 = torch.bfloat16


def _pre(x: Tensor, norm: Tensor, eps: float, wqkv: Callable, cos: Tensor, sin: Tensor,
         nh: int, nkv: int, hd: int) -> tuple[Tensor, Tensor, Tensor]:
    """x [B, T, H] -> q [B, nh, T, hd], k, v [B, nkv, T, hd] (float32), as Block.forward computes them."""
    B, T, _ = x.shape
    qkv = wqkv(rms_norm(x, norm, eps).reshape(B * T, -1).to(BF16)).float().view(B, T, -1)
    qk = qkv[..., :(nh + nkv) * hd].view(B, T, nh + nkv, hd).transpose(1, 2)
    v = qkv[..., (nh + nkv) * hd:].view(B, T, nkv, hd).transpose(1, 2)
    qk = apply_rope(qk, cos, sin)
    return qk[:, :nh], qk[:, nh:], v


def _post(x: Tensor, o: Tensor, wo: Callable, norm: Tensor, eps: float, w13: Callable, w2: Callable) -> Tensor:
    """x [B, T, H], attention output o [B, nh, T, hd] -> the layer's output [B, T, H]."""
    B, T, _ = x.shape
    x = x + wo(o.transpose(1, 2).reshape(B * T, -1).to(BF16)).float().view(B, T, -1)
    gate, up = w13(rms_norm(x, norm, eps).reshape(B * T, -1).to(BF16)).float().chunk(2, dim=-1)
    return x + w2((F.silu(gate) * up).to(BF16)).float().view(B, T, -1)


class Sublayers:
    """Block.forward for decoding and verification with `_pre` and `_post` compiled (prefills: the model's own)."""

    def __init__(self) -> None:
        self.pre = torch.compile(_pre, dynamic=True)
        self.post = torch.compile(_post, dynamic=True)
        self.original = Block.forward

    def forward(self, block: Block, x, cos, sin, mask, cache, rows, kv_len, contiguous, prefill) -> Tensor:
        if prefill or not mask.invariant:
            return self.original(block, x, cos, sin, mask, cache, rows, kv_len, contiguous, prefill)
        c, k = block.cfg, block.packed
        q, kk, v = self.pre(x, block.attn_norm, c.norm_eps, k["wqkv"], cos, sin, c.n_heads, c.n_kv_heads, c.head_dim)
        cache.write(block.layer, rows, kk, v, contiguous)
        kc, vc = cache.read(block.layer, rows, kv_len, contiguous)
        return self.post(x, attention(q, kc, vc, mask, c.scale), k["wo"], block.ffn_norm, c.norm_eps, k["w13"], k["w2"])


@dataclass(frozen=True)
class Shape:
    """The static facts of a layer its compiled graph is specialised on."""
    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    scale: float
    gelu: bool
    qk_norm: bool
    sandwich: bool
    keys_in_place: bool


def _int4(x: Tensor, packed: Tensor, scale_zero: Tensor) -> Tensor:
    """x [M, K] -> [M, N] bfloat16 through torch's int4 kernel."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, GROUP, scale_zero)


def _norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm in float32, returned in x's dtype (as `decoder.rms_norm`)."""
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def layer(s: Shape, x: Tensor, w: list[Tensor], cos: Tensor, sin: Tensor, kc: Tensor, vc: Tensor,
          rows: Tensor, slots: Tensor, bias: Tensor) -> Tensor:
    """One layer of a decoding or verification forward (a causal chain or batch of chains), as `Block.forward`.

    x [B, T, H] (the residual stream, in the model's dtype); w: attn_norm, ffn_norm, then packed and
    scale_zero of wqkv, wo, w13, w2, then (qk_norm) q_norm, k_norm, (sandwich) post_attn_norm,
    post_ffn_norm; cos, sin [B, 1, T, hd] float32; kc, vc [R, nkv, S, hd] float32, this layer's cache
    (written at `slots` [B, T] of `rows` [B]); bias [nb, B*nkv, nt, ROW_TILE, KV_BLOCK] (0 visible,
    -inf not: `AttentionMask.bias`) -> [B, T, H] in x's dtype.
    """
    B, T, H = x.shape
    nh, nkv, hd = s.n_heads, s.n_kv, s.head_dim
    an, fn, qkv_p, qkv_sz, o_p, o_sz, up_p, up_sz, down_p, down_sz = w[:10]
    qkv = _int4(_norm(x, an, s.eps).reshape(B * T, H), qkv_p, qkv_sz).float().view(B, T, -1)
    qk = qkv[..., :(nh + nkv) * hd].view(B, T, nh + nkv, hd).transpose(1, 2)     # [B, nh+nkv, T, hd]
    v = qkv[..., (nh + nkv) * hd:].view(B, T, nkv, hd).transpose(1, 2)          # [B, nkv, T, hd]
    if s.qk_norm:
        qk = torch.cat([_norm(qk[:, :nh], w[10], s.eps), _norm(qk[:, nh:], w[11], s.eps)], dim=1)
    qk = _rope(qk, cos, sin)
    q, k = qk[:, :nh], qk[:, nh:]
    r = rows[:, None].expand(B, T)
    kc[r, :, slots] = k.transpose(1, 2)                                         # [B, T, nkv, hd]
    vc[r, :, slots] = v.transpose(1, 2)
    o = _attention(s, q, kc, vc, rows, bias)                                    # [B, nh, T, hd] float32
    o = _int4(o.transpose(1, 2).reshape(B * T, nh * hd), o_p, o_sz).to(x.dtype).view(B, T, H)
    if s.sandwich:
        o = _norm(o, w[-2], s.eps)
    x = x + o
    gate, up = _int4(_norm(x, fn, s.eps).reshape(B * T, H), up_p, up_sz).to(x.dtype).chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if s.gelu else F.silu(gate)
    o = _int4(act * up, down_p, down_sz).to(x.dtype).view(B, T, H)
    if s.sandwich:
        o = _norm(o, w[-1], s.eps)
    return x + o


def _attention(s: Shape, q: Tensor, kc: Tensor, vc: Tensor, rows: Tensor, bias: Tensor) -> Tensor:
    """q [B, nh, T, hd] against the first nb key blocks of `rows` -> [B, nh, T, hd] (see the module doc)."""
    B, nh, T, hd = q.shape
    nkv = s.n_kv
    nb, X, nt = bias.shape[0], B * nkv, bias.shape[2]
    g = nh // nkv
    n, M = g * T, nt * ROW_TILE
    kx = kc.narrow(2, 0, nb * KV_BLOCK).index_select(0, rows).reshape(X * nb, KV_BLOCK, hd)
    vx = vc.narrow(2, 0, nb * KV_BLOCK).index_select(0, rows).reshape(X * nb, KV_BLOCK, hd)
    qg = F.pad(q.reshape(X, n, hd), (0, 0, 0, M - n))                          # [X, M, hd]
    qb = qg[:, None].expand(X, nb, M, hd).reshape(X * nb, M, hd)
    kt = kx.transpose(1, 2) if s.keys_in_place else kx.transpose(1, 2).contiguous()
    sc = torch.bmm(qb, kt).view(X, nb, M, KV_BLOCK) * s.scale
    sc = sc + bias.view(nb, X, M, KV_BLOCK).transpose(0, 1)                     # [X, nb, M, KB]
    top = sc.amax(-1, keepdim=True).amax(1, keepdim=True)                       # [X, 1, M, 1]
    p = torch.exp(sc - top)
    l = p.sum(-1, keepdim=True).sum(1)                                          # [X, M, 1]
    o = torch.bmm(p.view(X * nb, M, KV_BLOCK), vx).view(X, nb, M, hd).sum(1)    # [X, M, hd]
    return (o / l)[:, :n].reshape(B, nh, T, hd)


class Layers:
    """Block.forward for decoding and verification through the compiled `layer` (prefills: the model's own)."""

    def __init__(self, model: Transformer) -> None:
        c = model.config
        self.shape = Shape(c.n_heads, c.n_kv_heads, c.head_dim, c.norm_eps, c.scale, c.gelu, c.qk_norm,
                           c.sandwich_norm, keys_in_place(c.head_dim, torch.float32, model.device))
        self.layer = torch.compile(layer, dynamic=True)
        # one graph per combination of sizes of one (tokens, sequences, key blocks) and their relations:
        # past dynamo's default limit of 8 graphs it would run the rest eagerly, mixing bits
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.original = Block.forward

    def forward(self, block: Block, x, cos, sin, mask, cache, rows, kv_len, contiguous, prefill) -> Tensor:
        if prefill or not mask.invariant or mask.tree:
            return self.original(block, x, cos, sin, mask, cache, rows, kv_len, contiguous, prefill)
        p = block.packed
        w = [block.attn_norm, block.ffn_norm, *(t for n in ("wqkv", "wo", "w13", "w2")
                                                for t in (p[n].packed, p[n].scale_zero))]
        slots = cache.lengths[rows][:, None] + torch.arange(x.shape[1])       # [B, T]
        return self.layer(self.shape, x, w, cos, sin, cache.k[block.layer], cache.v[block.layer], rows, slots,
                          mask.bias())


def stack(s: Shape, x: Tensor, ws: list[list[Tensor]], cos: Tensor, sin: Tensor, K: Tensor, V: Tensor,
          rows: Tensor, slots: Tensor, bias: Tensor, norm: Tensor) -> Tensor:
    """Every layer of a decoding or verification forward (`layer`, in order) and the final norm, as one
    function: compiled, one graph for the whole stack. K, V [L, R, nkv, S, hd] the whole cache (one
    tensor, so the graph mutates one input in place rather than 2 L aliased views) -> [B, T, H]."""
    for i, w in enumerate(ws):
        x = layer(s, x, w, cos, sin, K[i], V[i], rows, slots, bias)
    return _norm(x, norm, s.eps)


class Stack:
    """Transformer._forward for causal decoding and verification forwards through the compiled `stack`
    (prefills, trees, feature taps and reused layers: the model's own)."""

    def __init__(self, model: Transformer) -> None:
        c = model.config
        self.shape = Shape(c.n_heads, c.n_kv_heads, c.head_dim, c.norm_eps, c.scale, c.gelu, c.qk_norm,
                           c.sandwich_norm, keys_in_place(c.head_dim, torch.float32, model.device))
        self.ws = [[b.attn_norm, b.ffn_norm, *(t for n in ("wqkv", "wo", "w13", "w2")
                                               for t in (b.packed[n].packed, b.packed[n].scale_zero))]
                   for b in model.layers]
        self.fn = torch.compile(stack, dynamic=True)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.original = Transformer._forward

    def forward(self, model: Transformer, x: Tensor, positions: Tensor, cache, rows: Tensor, tree_mask: Tensor,
                *, tree: bool, prefill: bool, features: tuple[int, ...], first_layer: int = 0) -> Tensor:
        B, T = positions.shape
        if prefill or tree or features or first_layer or T > INVARIANT_MAX_T or model.config.sliding_window:
            return self.original(model, x, positions, cache, rows, tree_mask, tree=tree, prefill=prefill,
                                 features=features, first_layer=first_layer)
        cache.check_room(rows, T)
        lengths = cache.lengths[rows]                                          # [B]
        kv_len = -(-(int(lengths.max()) + T) // KV_BLOCK) * KV_BLOCK
        visible, _ = model._mask(lengths, positions, T, kv_len, tree_mask)
        bias = AttentionMask(visible, model.config.n_kv_heads, model.config.n_heads).bias()
        cos, sin = model.cos[positions][:, None], model.sin[positions][:, None]  # [B, 1, T, hd]
        slots = lengths[:, None] + torch.arange(T, device=x.device)             # [B, T]
        return self.fn(self.shape, x, self.ws, cos, sin, cache.k, cache.v, rows, slots, bias, model.norm)


class Production:
    """The model's forward and head, one token at a time after a prompt (as the engine decodes)."""

    def __init__(self, model: Transformer, prompt: Tensor, steps: int) -> None:
        self.model, self.row = model, torch.tensor([0])
        self.cache = model.new_cache(1, prompt.shape[1] + steps + 8)
        n = prompt.shape[1]
        model.prefill(prompt, torch.arange(n)[None], self.cache, self.row)
        self.cache.commit(self.row, torch.arange(n)[None], torch.tensor([n]))
        self.token = prompt[:, -1:]

    def step(self) -> None:
        at = int(self.cache.lengths[0])
        hidden = self.model(self.token, torch.tensor([[at]]), self.cache, self.row)
        self.token = self.model.lm_head(hidden)[:, -1:].argmax(-1)
        self.cache.commit(self.row, torch.tensor([[0]]), torch.tensor([1]))


class Simple:
    """Plain decoding over a fixed window of `slots` keys: one bmm + softmax per layer, the model's kernels."""

    def __init__(self, model: Transformer, slots: int, compiled: bool) -> None:
        c = model.config
        self.model, self.cfg, self.slots, self.at = model, c, slots, 0
        self.k = [torch.zeros(c.n_kv_heads, slots, c.head_dim) for _ in range(c.n_layers)]   # [nkv, S, hd] each
        self.v = [torch.zeros(c.n_kv_heads, slots, c.head_dim) for _ in range(c.n_layers)]
        self.layers = [(b.attn_norm, b.packed["wqkv"], b.packed["wo"], b.ffn_norm, b.packed["w13"], b.packed["w2"])
                       for b in model.layers]
        self.body = torch.compile(self._body, fullgraph=True) if compiled else self._body
        self.token = torch.tensor([[1]])

    def _body(self, token: Tensor, pos: Tensor, bias: Tensor, ks: list[Tensor], vs: list[Tensor]) -> Tensor:
        """token, pos [1, 1]; bias [S] (0 visible, -inf not) -> final-normed hidden [1, H]."""
        c, m = self.cfg, self.model
        nh, nkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
        x = F.embedding(token, m.embed)                                        # [1, 1, H]
        cos, sin = m.cos[pos][:, None], m.sin[pos][:, None]
        for i, (an, wqkv, wo, fn, w13, w2) in enumerate(self.layers):
            q, k, v = _pre(x, an, c.norm_eps, wqkv, cos, sin, nh, nkv, hd)
            ks[i].index_copy_(1, pos[0], k[0])
            vs[i].index_copy_(1, pos[0], v[0])
            s = torch.bmm(q.reshape(nkv, nh // nkv, hd), ks[i].transpose(1, 2)) * c.scale + bias   # [nkv, g, S]
            o = torch.bmm(torch.softmax(s, -1), vs[i]).reshape(1, nh, 1, hd)
            x = _post(x, o, wo, fn, c.norm_eps, w13, w2)
        return rms_norm(x, m.norm, c.norm_eps).reshape(1, -1)

    def step(self) -> None:
        if self.at == self.slots:
            self.at = 0                                                        # wrap around: a fixed-cost window
        bias = torch.full((self.slots,), float("-inf"))
        bias[:self.at + 1] = 0
        hidden = self.body(self.token, torch.tensor([[self.at]]), bias, self.k, self.v)
        self.token = self.model.lm_head(hidden).argmax(-1).view(1, 1)
        self.at += 1


@contextlib.contextmanager
def patched(decoder: "Sublayers | Layers | Stack") -> Iterator[None]:
    """Block.forward (Transformer._forward for `Stack`) is `decoder.forward` inside the block."""
    owner, name = (Transformer, "_forward") if isinstance(decoder, Stack) else (Block, "forward")
    original = getattr(owner, name)
    setattr(owner, name, lambda obj, *args, **kw: decoder.forward(obj, *args, **kw))
    try:
        yield
    finally:
        setattr(owner, name, original)


def rows_keep_bits(model: Transformer) -> bool:
    """Whether tokens after a prompt get the same bits scored 1, 2, 5 or 8 per forward, one at a time, next
    to another sequence (a batch of two), and with a context of 124 (the 8 cross the first key block)."""
    ids = torch.randint(0, model.vocab_size, (2, 140), generator=torch.Generator().manual_seed(1))

    def hidden(ctx: int, chunks: list[int], batch: int = 1) -> Tensor:
        cache, rows = model.new_cache(3, 256), torch.tensor([2, 0][:batch] if batch > 1 else [0])
        for j in range(batch):
            model.prefill(ids[j:j + 1, :ctx], torch.arange(ctx)[None], cache, rows[j:j + 1])
            cache.commit(rows[j:j + 1], torch.arange(ctx)[None], torch.tensor([ctx]))
        out, at = [], ctx
        for c in chunks:
            out.append(model(ids[:batch, at:at + c], torch.arange(at, at + c)[None].expand(batch, c), cache, rows))
            cache.commit(rows, torch.arange(c)[None].expand(batch, c), torch.full((batch,), c))
            at += c
        return torch.cat(out, 1)[:1]

    ok = True
    for ctx in (30, 124):
        full = hidden(ctx, [8])
        ok &= all(torch.equal(hidden(ctx, [T]), full[:, :T]) for T in (1, 2, 5))
        ok &= torch.equal(hidden(ctx, [1] * 8), full) and torch.equal(hidden(ctx, [3, 5], batch=2), full)
    return ok


DECODERS = ("production", "sublayers", "layers", "stack", "simple", "simple-compiled")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=60, help="tokens timed per decoder (interleaved)")
    ap.add_argument("--slots", type=int, default=128, help="key window of the simple decoders")
    ap.add_argument("--only", default=",".join(DECODERS), help="comma-separated decoders to run (production always)")
    a = ap.parse_args()
    only = {"production", *a.only.split(",")}
    if only - set(DECODERS):
        ap.error(f"unknown decoders {sorted(only - set(DECODERS))}; choose from {', '.join(DECODERS)}")
    torch.set_num_threads(a.threads)
    model, _, _ = load_model(a.model, "q4")
    m = probe()
    print(f"{a.model} {model.compute}, {a.threads} thread(s); CPU: {cpu_model()}, torch {torch.__version__} "
          f"kernels {m.torch_capability}{', ISA limit ' + m.isa_limit if m.isa_limit else ''}")
    prompt = torch.randint(0, model.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    makers = {"sublayers": Sublayers, "layers": lambda: Layers(model), "stack": lambda: Stack(model)}
    decs = {n: make() for n, make in makers.items() if n in only}
    with torch.inference_mode():
        runs: dict[str, Callable[[], None]] = {"production": Production(model, prompt, 4 * a.tokens + 16).step}
        for name, dec in decs.items():
            run = Production(model, prompt, 4 * a.tokens + 16)

            def step(run: Production = run, dec=dec) -> None:
                with patched(dec):
                    run.step()
            runs[name] = step
        if "simple" in only:
            runs["simple"] = Simple(model, a.slots, compiled=False).step
        if "simple-compiled" in only:
            runs["simple-compiled"] = Simple(model, a.slots, compiled=True).step
        first: dict[str, float] = {}
        for name, step in runs.items():
            t = time.perf_counter()
            step()
            first[name] = time.perf_counter() - t
            for _ in range(3):
                step()
        times: dict[str, list[float]] = {n: [] for n in runs}
        for _ in range(a.tokens):
            for name, step in runs.items():
                t = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t)
        base = statistics.median(times["production"])
        print(f"{'decoder':<16} {'ms/token':>9} {'fastest':>8} {'vs production':>14} {'first call':>11}")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:<16} {med * 1e3:9.2f} {min(ts) * 1e3:8.2f} {base / med:13.2f}x {first[name]:10.1f}s", flush=True)
        bits = {}
        for name, dec in (("production", None), *decs.items()):
            t = time.perf_counter()
            with patched(dec) if dec else contextlib.nullcontext():
                bits[name] = rows_keep_bits(model)
            print(f"{name}: row check took {time.perf_counter() - t:.1f} s", flush=True)
    for name, ok in bits.items():
        print(f"{name}: each token's bits the same scored 1, 2, 5, 8 per forward, one at a time, in a batch, "
              f"across a key block: {ok}")


if __name__ == "__main__":
    main()
