"""The native attention kernel: right against a float64 reference, and each query's bits its own."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from specdec.models import native
from specdec.tree import TokenTree

from helpers import same_bits_on_one_and_two_threads, target_shaped

pytestmark = pytest.mark.exactness

needs_native = pytest.mark.skipif(not native.available(torch.device("cpu")),
                                  reason=f"native attention unavailable: {native.describe(torch.device('cpu'))}")


class _Forward:
    """A KVCache, rows and their lengths, as one forward's `ForwardSlots` sees them."""

    def __init__(self, rows: list[int], lengths: list[int], t: int, kv_len: int, nkv: int, hd: int, seed: int = 0):
        from specdec.cache import KVCache

        g = torch.Generator().manual_seed(seed)
        self.cache = KVCache(2, 4, nkv, 512, hd, torch.float32, "cpu")
        self.cache.k.copy_(torch.randn(self.cache.k.shape, generator=g))
        self.cache.v.copy_(torch.randn(self.cache.v.shape, generator=g))
        self.cache.lengths[torch.tensor(rows)] = torch.tensor(lengths)
        self.rows = torch.tensor(rows)
        self.slots = self.cache.slots_of(self.rows, t, kv_len)


def _rope_rows(B: int, T: int, hd: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from specdec.models.decoder import rope_tables, signed_sin

    cos, sin = rope_tables(hd, 10000.0, 512)
    pos = torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(seed))
    return cos[pos][:, None], signed_sin(sin)[pos][:, None]                    # [B, 1, T, hd]


@needs_native
@pytest.mark.parametrize("nh, nkv, hd, qk_norm", [(9, 3, 64, False), (4, 1, 256, True)])
def test_native_attention_is_rope_cache_writes_and_attention(nh, nkv, hd, qk_norm):
    """Against torch: the keys and values land in the cache where `KVCache.write` puts them, and each
    token's output is masked softmax attention (float64 reference) over its visible slots."""
    from specdec.models.decoder import rope

    B, T, S = 2, 5, 256
    f = _Forward([2, 0], [100, 180], T, S, nkv, hd)
    want = _Forward([2, 0], [100, 180], T, S, nkv, hd)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(B * T, (nh + 2 * nkv) * hd, generator=g)
    cos, ssin = _rope_rows(B, T, hd, 2)
    wq, wk = (1 + 0.1 * torch.randn(hd, generator=g) for _ in range(2)) if qk_norm else (torch.empty(0),) * 2
    visible = torch.rand(B, T, S, generator=g) < 0.6
    visible[:, :, 0] = True
    out = native.qkv_attend(qkv, cos, ssin, wq, wk, 1e-6, f.cache.k, f.cache.v, 1, f.slots, visible, nh, 0.1,
                            torch.float32)

    heads = qkv.view(B, T, nh + 2 * nkv, hd).transpose(1, 2)
    qk, v = heads[:, :nh + nkv], heads[:, nh + nkv:]
    if qk_norm:
        qk = torch.cat([torch.nn.functional.rms_norm(qk[:, :nh], (hd,), wq, 1e-6),
                        torch.nn.functional.rms_norm(qk[:, nh:], (hd,), wk, 1e-6)], 1)
    qk = rope(qk, cos, ssin)
    want.cache.write(1, want.rows, qk[:, nh:], v)
    torch.testing.assert_close(f.cache.k, want.cache.k, rtol=1e-5, atol=1e-5)
    assert torch.equal(f.cache.v, want.cache.v)
    k, vv = (x[1, want.rows, :, :S].double().repeat_interleave(nh // nkv, 1) for x in (want.cache.k, want.cache.v))
    s = (qk[:, :nh].double() @ k.transpose(-1, -2)) * 0.1
    ref = (s.masked_fill(~visible[:, None], float("-inf")).softmax(-1) @ vv).transpose(1, 2).reshape(B * T, nh * hd)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@needs_native
def test_a_token_gets_the_bits_of_its_own_keys_whatever_shares_the_call():
    """Alone, next to other tokens and sequences, or with more masked keys in the window: the same bits;
    bfloat16 output is the float32 output rounded."""
    nh, nkv, hd = 9, 3, 64
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2 * 6, (nh + 2 * nkv) * hd, generator=g).bfloat16()
    cos, ssin = _rope_rows(2, 6, hd, 4)
    none = torch.empty(0)
    visible = torch.zeros(2, 6, 384, dtype=torch.bool)
    for t in range(6):
        visible[0, t, :200 + t + 1] = True                                    # causal chains after 200 / 150 keys
        visible[1, t, :150] = True
        visible[1, t, 300:300 + t + 1] = True
    f = _Forward([0, 1], [200, 300], 6, 384, nkv, hd)
    f.cache.lengths[1] = 300
    full = native.qkv_attend(qkv, cos, ssin, none, none, 1e-6, f.cache.k, f.cache.v, 0, f.slots, visible, nh, 0.125,
                             torch.float32)
    half = native.qkv_attend(qkv, cos, ssin, none, none, 1e-6, f.cache.k, f.cache.v, 0, f.slots, visible, nh, 0.125,
                             torch.bfloat16)
    assert torch.equal(half, full.bfloat16())
    for b, base in ((0, 200), (1, 300)):
        for t in range(6):                                                    # token t alone, its predecessors cached
            one = _Forward([b], [base + t], 1, 512, nkv, hd)
            one.cache.k.copy_(f.cache.k)
            one.cache.v.copy_(f.cache.v)
            vis = torch.zeros(1, 1, 512, dtype=torch.bool)
            vis[0, 0, :384] = visible[b, t]
            r = b * 6 + t
            alone = native.qkv_attend(qkv[r:r + 1], cos[b:b + 1, :, t:t + 1].contiguous(),
                                      ssin[b:b + 1, :, t:t + 1].contiguous(), none, none, 1e-6, one.cache.k,
                                      one.cache.v, 0, one.slots, vis, nh, 0.125, torch.float32)
            assert torch.equal(alone[0], full[r]), (b, t)


@needs_native
@pytest.mark.parametrize("nh, nkv, hd, qk_norm", [(9, 3, 64, False), (4, 1, 256, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_causal_chain_without_a_mask_is_the_chain_with_its_mask(nh, nkv, hd, qk_norm, dtype):
    """`Attend.causal` (the whole rope tables, the positions, no mask) gives the bits of `Attend` with the rope
    rows and the causal mask built in Python: outputs and the keys and values written, ragged rows, any positions
    (they need not follow the slots); a position outside the tables is refused."""
    from specdec.models.decoder import CAUSAL, Transformer, rope_tables, signed_sin

    B, T, S = 2, 4, 384
    lengths = [300, 170]
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(B * T, (nh + 2 * nkv) * hd, generator=g).to(dtype)
    wq, wk = (1 + 0.1 * torch.randn(hd, generator=g) for _ in range(2)) if qk_norm else (torch.empty(0),) * 2
    cos, sin = rope_tables(hd, 10000.0, 512)
    ssin = signed_sin(sin)
    positions = torch.tensor([[300, 301, 302, 303], [40, 41, 42, 43]])        # row 1: positions below its slots
    outs = []
    for causal in (False, True):
        f = _Forward([1, 3], lengths, T, S, nkv, hd, seed=9)
        if causal:
            attend = native.Attend.causal(cos, ssin, positions, f.cache.k, f.cache.v, f.slots, nh, 0.125)
        else:
            visible = Transformer._mask(torch.tensor(lengths), T, S, CAUSAL)[:, 0].contiguous()
            attend = native.Attend(cos[positions][:, None], ssin[positions][:, None], f.cache.k, f.cache.v, f.slots,
                                   visible, nh, 0.125)
        outs.append((attend(qkv, wq, wk, 1e-6, 1, dtype), f.cache.k.clone(), f.cache.v.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    f = _Forward([1, 3], lengths, T, S, nkv, hd, seed=9)
    with pytest.raises(ValueError, match="outside the rope tables"):
        native.Attend.causal(cos, ssin, positions + 500, f.cache.k, f.cache.v, f.slots, nh, 0.125)(
            qkv, wq, wk, 1e-6, 1, dtype)


@pytest.mark.parametrize("shape, n", [("smollm2", 140), ("gemma3", 300)])
def test_torch_attention_keeps_rows_invariant_without_the_native_kernel(monkeypatch, shape, n):
    """Where no compiler builds the kernel, forwards attend through torch ops: still row-invariant,
    chains and trees (a smaller version of test_model's checks); Gemma's local layers past their window too."""
    monkeypatch.setattr(native, "_TRIED", ["disabled in this test"])
    assert not native.available(torch.device("cpu"))
    model = target_shaped(5, torch.float32, shape)
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 512, (1, n), generator=g)
    cont = torch.randint(0, 512, (1, 6), generator=g)

    def prefilled():
        cache = model.new_cache(1, n + 16)
        pos = torch.arange(n)[None]
        model(prompt, pos, cache, torch.tensor([0]))
        cache.commit(torch.tensor([0]), pos, torch.tensor([n]))
        return cache

    cache, steps = prefilled(), []
    for t in range(6):
        steps.append(model(cont[:, t:t + 1], torch.tensor([[n + t]]), cache, torch.tensor([0])))
        cache.commit(torch.tensor([0]), torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
    chunk = model(cont, n + torch.arange(6)[None], prefilled(), torch.tensor([0]))
    assert torch.equal(chunk, torch.cat(steps, 1))
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]])
    tokens = torch.cat([cont[:, :2], cont[:, 2:3], cont[:, 2:]], 1)[:, :6]
    tree = TokenTree(tokens, parents)
    hidden = model(tokens, n + tree.depth(), prefilled(), torch.tensor([0]), tree.mask())
    path = [0, 1, 3, 5]                                                       # node 5's path
    chain = model(tokens[:, path], n + torch.arange(4)[None], prefilled(), torch.tensor([0]))
    assert torch.equal(hidden[0, 5], chain[0, -1])


def test_native_attention_refuses_layouts_it_does_not_read():
    if not native.available(torch.device("cpu")):
        pytest.skip("native attention unavailable")
    f = _Forward([0], [10], 1, 128, 3, 64)
    qkv = torch.randn(1, 15 * 64)
    cos, ssin = _rope_rows(1, 1, 64, 0)
    with pytest.raises(ValueError, match="unsupported layout"):                # float16 projections
        native.qkv_attend(qkv.half(), cos, ssin, torch.empty(0), torch.empty(0), 1e-6, f.cache.k, f.cache.v, 0,
                          f.slots, torch.ones(1, 1, 128, dtype=torch.bool), 9, 0.125, torch.float32)
    with pytest.raises(ValueError, match="unsupported layout"):                # 10 heads do not fit 15 * 64
        native.qkv_attend(qkv, cos, ssin, torch.empty(0), torch.empty(0), 1e-6, f.cache.k, f.cache.v, 0,
                          f.slots, torch.ones(1, 1, 128, dtype=torch.bool), 10, 0.125, torch.float32)
    with pytest.raises(ValueError, match="unsupported layout"):                # rope rows must be float32
        native.qkv_attend(qkv, cos.bfloat16(), ssin, torch.empty(0), torch.empty(0), 1e-6, f.cache.k, f.cache.v, 0,
                          f.slots, torch.ones(1, 1, 128, dtype=torch.bool), 9, 0.125, torch.float32)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_add_and_norm_is_torchs_add_then_rms_norm(dtype):
    """The sum is torch's (bit for bit, rounded to the stream's dtype), the norm RMSNorm up to rounding, and a
    row's bits are its own whatever rows share the call."""
    g = torch.Generator().manual_seed(7)
    x, o = (torch.randn(9, 576, generator=g).to(dtype) for _ in range(2))
    w = 1 + 0.1 * torch.randn(576, generator=g)
    xo, h = native.add_rms_norm(x, o, w, 1e-5)
    assert torch.equal(xo, x + o)
    ref = torch.nn.functional.rms_norm((x + o).float(), (576,), w, 1e-5)
    torch.testing.assert_close(h.float(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    for r in (0, 4, 8):
        assert torch.equal(native.add_rms_norm(x[r:r + 1], o[r:r + 1], w, 1e-5)[1][0], h[r])
    same, h2 = native.add_rms_norm(xo, torch.empty(0), w, 1e-5)                # nothing added: the norm alone
    assert same is xo and torch.equal(h2, h)


def _q4_blocks(n: int, k: int, seed: int):
    import numpy as np

    from specdec.models.int4 import Blocks4

    rng = np.random.default_rng(seed)
    return Blocks4(rng.integers(0, 16, (n, k), dtype=np.uint8), rng.uniform(0.002, 0.02, (n, k // 32)).astype(np.float32),
                   rng.normal(0, 0.02, (n, k // 32)).astype(np.float32))


def _q8_reference(x: torch.Tensor, b) -> torch.Tensor:
    """x [M, K] quantized per block of 32 as the kernel does (float32 dx = max|x| / 127, codes roundf(x * (1 / dx)):
    halves away from zero), times the dequantized 4-bit weights, in float64."""
    M, K = x.shape
    xb = x.float().reshape(M, K // 32, 32)
    dx = xb.abs().amax(-1) / 127
    q = xb * torch.where(dx > 0, 1 / dx, 0)[..., None]
    q = torch.sign(q) * torch.floor(q.abs() + 0.5)
    return (q.double() * dx.double()[..., None]).reshape(M, K) @ torch.from_numpy(b.dequantize()).double().T


@needs_native
def test_native_q4_layout_holds_the_blocks_codes_scales_and_zeros():
    b = _q4_blocks(32, 64, 0)
    lay = native.q4_layout(b.q, b.scale, b.zero)
    c = lay["codes"]                                                         # [2, 2, 256]
    for g, r, k in ((0, 0, 0), (1, 5, 13), (1, 15, 63), (0, 9, 36)):
        blk, i = divmod(k, 32)
        part, j = divmod(i, 8)
        byte = int(c[g, blk, 64 * part + 4 * r + j % 4])
        assert (byte & 15 if j < 4 else byte >> 4) == b.q[16 * g + r, k]
    assert lay["scale"][1, 1, 7] == float(b.scale[23, 1]) and lay["zero"][0, 1, 3] == float(b.zero[3, 1])
    with pytest.raises(ValueError, match="groups of 16"):
        native.q4_layout(b.q[:24], b.scale[:24], b.zero[:24])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_q4_linear_is_the_8_bit_quantized_product_with_the_same_bits_everywhere(dtype):
    """Right against a float64 reference of the same quantization; the same bits at every instruction level
    (plain C, AVX2, AVX-512 VNNI where the CPU has them), for a lone row and any row count."""
    b = _q4_blocks(96, 576, 1)
    lay = native.q4_layout(b.q, b.scale, b.zero)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(2)).to(dtype)
    levels = sorted({native.q8x8_isa(i) for i in (0, 1, 2)})
    outs = [native.Q4Linear(lay["codes"], lay["scale"], lay["zero"], None, isa)(x) for isa in levels]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    torch.testing.assert_close(outs[0].double(), _q8_reference(x.float(), b), rtol=1e-5, atol=1e-5)
    k = native.Q4Linear.of(lay)
    assert k.check.many_rows and k.check.lone_row
    for m in (1, 2, 3, 5, 8):
        assert torch.equal(k(x[:m]), outs[0][:m])
    assert torch.equal(k(x[4:5])[0], outs[0][4])
    with pytest.raises(ValueError, match="expected"):
        k(x[:, :64])


@needs_native
def test_native_q4_linear_is_exact_at_the_largest_integer_sums():
    """Codes 15 against inputs that all quantize to +127 or -127: a block's products sum to +-30480, the most
    the kernels' 16-bit partial sums hold; every instruction level stays right and gives the same bits."""
    import numpy as np

    b = _q4_blocks(32, 576, 5)
    b.q[:] = 15
    b.q[16:, ::3] = 0                                              # and a group whose sums are not all the largest
    lay = native.q4_layout(b.q, b.scale, b.zero)
    x = torch.ones(4, 576)
    x[1] = -1
    x[2] = torch.from_numpy(np.resize([1.0, -1.0, 0.5, -0.25], 576))
    x[3, ::2] = -3
    levels = sorted({native.q8x8_isa(i) for i in (0, 1, 2)})
    outs = [native.Q4Linear(lay["codes"], lay["scale"], lay["zero"], None, isa)(x) for isa in levels]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    torch.testing.assert_close(outs[0].double(), _q8_reference(x, b), rtol=1e-5, atol=1e-5)


@needs_native
def test_native_q4_linear_keeps_its_bits_over_torchs_threads():
    """A layer large enough to be split between threads (groups of 16 outputs) gives the one-thread bits."""
    b = _q4_blocks(3072, 576, 3)
    k = native.Q4Linear.of(native.q4_layout(b.q, b.scale, b.zero))
    assert k.threads                                          # 885 KB of codes: split by default
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(4))
    assert same_bits_on_one_and_two_threads(k, x)
    assert same_bits_on_one_and_two_threads(dataclasses.replace(k, threads=False), x)
    assert torch.equal(dataclasses.replace(k, threads=False)(x), k(x))
    threads = torch.get_num_threads()
    for seed, kernel in enumerate((k, dataclasses.replace(k, threads=False))):
        many = torch.randn(40, 576, generator=torch.Generator().manual_seed(5 + seed))   # a prefill's rows: their
        try:                                                                   # quantization and groups split over
            torch.set_num_threads(2)                                           # the threads whatever the choice
            split = kernel(many)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(split, torch.cat([kernel(row) for row in many.split(1)]))   # each row's own bits


def test_a_layers_native_kernel_is_timed_on_one_thread_and_split_where_torch_has_several(monkeypatch):
    """`fastest` gets both forms of a native kernel where torch has several threads (which pays depends on the CPU
    and the shape), one where it has one."""
    from specdec.models.gguf_loader import split_or_not

    made = native.Q4Linear(torch.zeros(1, 1, 256, dtype=torch.uint8), torch.zeros(1, 1, 16), torch.zeros(1, 1, 16),
                           None, 1, True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert list(split_or_not("native-q4", lambda: made)) == ["native-q4"]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    forms = {n: make() for n, make in split_or_not("native-q4", lambda: made).items()}
    assert {n: k.threads for n, k in forms.items()} == {"native-q4": False, "native-q4-threads": True}


@pytest.mark.skipif(not native._compiler() or os.environ.get("SPECDEC_NATIVE", "1") == "0",
                    reason="no C compiler here, or the native kernels are switched off")
def test_the_native_kernels_build_wherever_a_c_compiler_is_found():
    """Where a C compiler is found, attend.c builds and loads: a compile error in it fails here instead of
    silently sending every native test above to `skip` (and every forward to the torch ops)."""
    assert native.available(torch.device("cpu")), native.describe(torch.device("cpu"))


@needs_native
def test_8_bit_codes_with_a_scale_per_16_inputs_have_the_same_bits_everywhere():
    """Q6_K's form (codes in [-32, 32), a scale per 16 inputs): the two half-block integer sums times their scales,
    the same bits at every instruction level, for any row count and on one or two threads; right against a float64
    reference of the same input quantization."""
    import dataclasses

    g = torch.Generator().manual_seed(5)
    N, K = 3072, 256                                                         # large enough to be split over threads
    q = torch.randint(-32, 32, (N, K), dtype=torch.int8, generator=g)
    d = torch.rand(N, K // 16, generator=g) / 50
    k = native.Q8Rows.of_layout(native.q8_rows_layout(q, d))
    assert k.kind == native.ROWS_Q8H and k.check.many_rows and k.check.lone_row
    x = torch.randn(11, K, generator=g)
    out = k(x)
    for isa in range(native.q8x8_isa() + 1):
        assert torch.equal(dataclasses.replace(k, isa=isa)(x), out), isa
    for m in (1, 2, 5, 8):
        assert torch.equal(k(x[:m]), out[:m])
    assert same_bits_on_one_and_two_threads(k, x[:5])
    xb = x.reshape(11, K // 32, 32)
    dx = xb.abs().amax(-1) / 127
    xq = torch.sign(xb / dx[..., None]) * torch.floor((xb / dx[..., None]).abs() + 0.5)
    w = (q.double().reshape(N, K // 16, 16) * d.double()[..., None]).reshape(N, K)
    ref = (xq.double() * dx.double()[..., None]).reshape(11, K) @ w.T
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one per 32 or 16"):
        native.q8_rows_layout(q, d[:, :5])


@pytest.mark.parametrize("start", [0, 1, 4])
def test_the_8_bit_row_layout_moves_each_code_where_the_kernel_reads_it(start):
    """`q8_rows_layout` moves codes 4 at a time (32-bit words): the same bytes as the layout spelt code by code,
    for codes at any offset of their storage (a view of the weights' file need not start on a word) or strided."""
    g = torch.Generator().manual_seed(3)
    N, K = 64, 96
    buf = torch.randint(-128, 128, (N * K + 8,), dtype=torch.int8, generator=g)
    q = buf[start:start + N * K].view(N, K)
    d = torch.rand(N, K // 32, generator=g)
    want = q.reshape(N // 16, 16, K // 32, 8, 4).permute(0, 2, 3, 1, 4).reshape(N // 16, K // 32, 512)
    for codes in (q, q.t().contiguous().t()):                                 # contiguous, then strided
        got = native.q8_rows_layout(codes, d)
        assert torch.equal(got["codes"], want) and got["codes"].is_contiguous()
        assert got["codes"].shape == (N // 16, K // 32, 512) and got["codes"].dtype == torch.int8


@pytest.mark.skipif(not native.loop_available(), reason="the native layer loop is not built here")
@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_a_kernels_argmax_from_its_own_call_is_the_argmax_of_its_outputs(kind):
    """`with_top` (an LM head's greedy tokens, found in the kernel's call): the plain call's outputs and each row's
    first largest index, a NaN counting as the largest, as `sampling.argmax` gives it, on one and two threads: random
    rows, a best output repeated at lower and higher indices (ties), NaN scales, and rows of equal outputs."""
    from specdec.sampling import argmax

    g = torch.Generator().manual_seed(11)
    N, K = 3072, 64                                                            # split over threads where there are two
    x = torch.randn(5, K, generator=g)
    if kind == "q8":
        def make(q, d):
            return native.Q8Rows.of_layout(native.q8_rows_layout(q, d))
        q, d = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g), torch.rand(N, K // 32, generator=g) / 50
    else:
        def make(q, d):
            return native.Q4Linear.of(native.q4_layout(q, d, torch.zeros_like(d)))
        q, d = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g), torch.rand(N, K // 32, generator=g) / 50
    best = int(argmax(make(q, d)(x[:1]))[0])
    tied_q, tied_d = q.clone(), d.clone()
    for at in (5, best + 1, N - 1):                                            # the best row again, before and after
        tied_q[at], tied_d[at] = q[best], d[best]
    nan_d = d.clone()
    nan_d[[2000, 700], 1] = float("nan")
    zero = torch.zeros_like(q) if kind == "q8" else torch.full_like(q, 8)     # every weight 0
    cases = {"random": (q, d), "ties": (tied_q, tied_d), "nan": (q, nan_d), "equal": (zero, d)}
    threads = torch.get_num_threads()
    for name, (cq, cd) in cases.items():
        k = make(cq, cd)
        assert k.fuses_top
        for m in (1, 2, 5):
            for n in sorted({1, min(2, threads)}):
                try:
                    torch.set_num_threads(n)
                    out, top = k.with_top(x[:m])
                finally:
                    torch.set_num_threads(threads)
                torch.testing.assert_close(out, k(x[:m]), rtol=0, atol=0, equal_nan=True, msg=f"{name} {m} {n}")
                assert top.dtype == torch.int64 and torch.equal(top, argmax(out)), (name, m, n, top, argmax(out))
        if name == "ties":
            assert int(top[0]) == 5
        elif name == "nan":
            assert top.tolist() == [700] * 5
        elif name == "equal":
            assert top.tolist() == [0] * 5


def test_linear_top_without_a_fused_kernel_is_the_linear_and_its_argmax():
    """`kernels.linear_top` where the kernel does not find the argmax itself (or there is no kernel): the linear's
    float32 outputs and `sampling.argmax` of them, in the input's leading shape."""
    from specdec.models.kernels import DenseLinear, linear, linear_top
    from specdec.sampling import argmax

    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(40, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    for packed in ({}, {"head": DenseLinear(w)}):
        out, top = linear_top(x, w, packed, "head")
        assert torch.equal(out, linear(x, w, packed, "head")) and out.shape == (2, 3, 40)
        assert torch.equal(top, argmax(out)) and top.shape == (2, 3)
