"""The LM head's kernels: an 8-bit head as two 4-bit halves, and the per-machine choice of the fastest head."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import Tensor

from specdec.machine import probe
from specdec.models import kernels
from specdec.models.kernels import RowCheck

from helpers import same_bits_on_one_and_two_threads

W = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
needs_int4 = pytest.mark.skipif(not probe().int4_kernel, reason="no int4 kernel in this torch build")


def q8_0(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(Q8_0 bytes of a random [n, k] weight, what gguf dequantizes them to)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w[0, :32] = np.linspace(-1, 1, 32)                       # a block whose codes reach -127 and 127
    data = quantize(w, T.Q8_0)
    return data, dequantize(data, T.Q8_0).reshape(n, k)


def test_q8_0_halves_sum_to_what_gguf_dequantizes():
    """hi and lo halves in the int4 kernel's convention add up to the 8-bit weight exactly."""
    from specdec.models.int4 import blocks_q8_0_halves

    data, ref = q8_0(8, 256)
    b = blocks_q8_0_halves(data, (8, 256))
    assert b.q.shape == (8, 512) and b.q.min() >= 0 and b.q.max() <= 15 and b.q[:, :256].min() == 0
    halves = b.dequantize()                                                    # [8, 512]
    assert np.array_equal(halves[:, :256] + halves[:, 256:], ref)


@needs_int4
def test_the_halves_kernel_computes_the_head_with_rows_independent_of_their_count():
    from specdec.models.int4 import Int4Linear, blocks_q8_0_halves

    data, ref = q8_0(192, 256, seed=1)
    head = Int4Linear.of(blocks_q8_0_halves(data, (192, 256)), copies=2)
    assert head.check == RowCheck(many_rows=True, lone_row=True)
    x = torch.randn(5, 256).bfloat16()
    want = x.float() @ torch.from_numpy(ref).T
    torch.testing.assert_close(head(x).float(), want, atol=0.01 * float(want.abs().max()), rtol=0)
    assert all(torch.equal(head(x[i:i + 1]), head(x)[i:i + 1]) for i in range(5))


@dataclass(frozen=True)
class Slow:
    """An exact kernel that takes `delay` seconds per call (and may claim a failed row check)."""
    delay: float
    check: RowCheck = RowCheck(True, True)

    dtype = torch.float32
    pair = False

    def __call__(self, x: Tensor) -> Tensor:
        time.sleep(self.delay)
        return x @ W.T


def test_fastest_times_once_per_machine_and_keeps_its_choice(monkeypatch, tmp_path):
    """The faster kernel is kept; a new process (an emptied memo) builds only the kept one, so every start
    of the machine runs the same head."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_BOOKS", {})
    built = []

    def maker(name: str, delay: float):
        return lambda: built.append(name) or Slow(delay)

    makers = {"slow": maker("slow", 0.004), "fast": maker("fast", 0.0)}
    assert kernels.fastest(("test", 96, 64), makers, W) == Slow(0.0) and sorted(built) == ["fast", "slow"]
    monkeypatch.setattr(kernels, "_BOOKS", {})
    built.clear()
    swapped = {"slow": maker("slow", 0.0), "fast": maker("fast", 0.004)}    # timing again would pick "slow"
    assert kernels.fastest(("test", 96, 64), swapped, W) == Slow(0.004) and built == ["fast"]


def test_fastest_never_picks_a_kernel_that_failed_its_row_check(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_BOOKS", {})
    broken = Slow(0.0, RowCheck(False, False, 1))
    makers = {"checked": lambda: Slow(0.002), "broken": lambda: broken}
    assert kernels.fastest(("test", 96, 64), makers, W) == Slow(0.002)


@pytest.fixture(scope="module", params=["int4", "native-q8", "native-q8x8", "native-q8r"])
def q4_int4_head(request):
    """smollm2-135m in q4, its LM head forced to one 8-bit kernel (the 4-bit halves, or the native Q8_0 kernel)
    whatever this machine chose, and the logits of a few hidden states through the dense head."""
    from specdec.api import load_model
    from specdec.models import native

    if not probe().int4_kernel:
        pytest.skip("no int4 kernel in this torch build")
    if request.param.startswith("native") and not native.available(torch.device("cpu")):
        pytest.skip("no native kernels here")
    model, tok, _ = load_model("smollm2-135m", "q4")
    assert request.param in model.head_kernels                 # its head is Q8_0
    hidden = torch.randn(6, model.config.dim, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    dense = kernels.linear(hidden, model.embed, {"d": kernels.pack(model.embed)}, "d").float()
    model.packed["lm_head"] = model.head_kernels[request.param]  # shared with the early-exit draft below
    return model, tok, hidden, dense


@pytest.mark.integration
def test_the_int4_head_is_the_dense_head_up_to_its_scales_rounding(q4_int4_head):
    model, _, hidden, dense = q4_int4_head
    logits = model.lm_head(hidden)
    assert float((logits - dense).abs().max() / dense.abs().max()) < 0.01
    assert model.packed["lm_head"].check.many_rows


@pytest.mark.integration
@pytest.mark.exactness
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_with_the_int4_head_is_token_identical_to_plain_greedy(q4_int4_head, method):
    from specdec.api import Generator, early_exit_draft
    from specdec.bench.suites import load_suite
    from specdec.models.selfcheck import self_check
    from specdec.proposers.base import NoProposer
    from specdec.proposers.draft_model import DraftModelProposer
    from specdec.proposers.ngram import NgramProposer

    model, tok, _, _ = q4_int4_head
    assert self_check(model).passed
    ps = [p.turns[0] for p in load_suite("mini")][:6]
    plain = Generator(model, tok, NoProposer()).generate(ps, max_new_tokens=40)
    proposer = NgramProposer() if method == "ngram" else DraftModelProposer(early_exit_draft(model, "self:10"))
    spec = Generator(model, tok, proposer, "fixed", 4).generate(ps, max_new_tokens=40)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert sum(r.metrics["acceptance_rate"] for r in spec) > 0


class _WideOut:
    """A kernel taking bfloat16 rows and giving float32 outputs (as the native Q8 head does), checked to 4 rows."""
    dtype = torch.bfloat16
    pair = False
    check = RowCheck(True, True, 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float()[:, None, :] * W.float()[None]).sum(-1) / 3             # [M, 96], each row on its own


def q8x8_reference(x: Tensor, q: Tensor, d: Tensor) -> Tensor:
    """What the native Q8_0 x Q8_0 head computes, step by step in torch: x [M, K] quantized per block of 32
    (round half away from zero), each block's 32 integer products in 8 lanes of 4, lane l's float32 sum adding
    lane * (d * dx) block by block, then the fixed pairwise tree of the 8 sums."""
    M, K = x.shape
    N, nb = q.shape[0], K // 32
    xb = x.float().view(M, nb, 32)
    dx = xb.abs().amax(-1) / 127                                               # [M, nb] float32
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    y = (xb * inv[..., None]).double()                                         # float32 product, then exact
    xq = (torch.sign(y) * torch.floor(y.abs() + 0.5)).long()                   # roundf: half away from zero
    lanes = (q.long().view(1, N, nb, 8, 4) * xq.view(M, 1, nb, 8, 4)).sum(-1)  # [M, N, nb, 8] exact integers
    acc = torch.zeros(M, N, 8)
    for b in range(nb):
        acc = acc + lanes[:, :, b].float() * (d[:, b][None, :, None] * dx[:, b][:, None, None])
    a = acc.unbind(-1)
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))


def test_the_native_q8x8_head_is_its_integer_reference_bit_for_bit_for_any_rows_and_threads():
    """Exact integer block sums make the native 8-bit x 8-bit head a plain function of each row: equal to the
    torch reference bit for bit (AVX2 groups of 4 outputs and the plain-C tail alike), whatever rows or
    threads share the call; within Q8_0 rounding of the float-input head."""
    from specdec.models import native
    from specdec.models.native import Q8Head, q8_0_codes

    if not native.available(torch.device("cpu")):
        pytest.skip("no native kernels here")
    data, ref = q8_0(47, 256, seed=4)                                          # 47 = 11 groups of 4 + a tail of 3
    codes = q8_0_codes(data, (47, 256))
    head = Q8Head.of(codes["q"], codes["d"], quantized=True)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(5)).bfloat16()   # 11: a chunk of 8 and 3
    x[2] = 0                                                                   # an all-zero row: dx = 0
    out = head(x)
    assert torch.equal(out, q8x8_reference(x, codes["q"], codes["d"]))
    for isa in range(native.q8x8_isa() + 1):                                   # plain C, AVX2, AVX-512 VNNI
        assert torch.equal(dataclasses.replace(head, isa=isa)(x), out), isa
    for r in (0, 2, 6):
        assert torch.equal(head(x[r:r + 1]), out[r:r + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(head(x), out)
    finally:
        torch.set_num_threads(threads)
    dense = x.float() @ torch.from_numpy(ref).t()
    assert float((out - dense).abs().max() / dense.abs().max()) < 0.02
    assert head.check.many_rows and head.check.lone_row


def q8r_reference(x: Tensor, q: Tensor, d: Tensor) -> Tensor:
    """What the 16-row native head computes, in torch: x quantized as for q8x8, each block's 32 integer products
    summed exactly, one float32 sum per output adding sum * (d * dx) block by block."""
    M, K = x.shape
    N, nb = q.shape[0], K // 32
    xb = x.float().view(M, nb, 32)
    dx = xb.abs().amax(-1) / 127
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    y = (xb * inv[..., None]).double()
    xq = (torch.sign(y) * torch.floor(y.abs() + 0.5)).long()
    sums = torch.einsum("nbk,mbk->mnb", q.long().view(N, nb, 32), xq)          # [M, N, nb] exact integers
    acc = torch.zeros(M, N)
    for b in range(nb):
        acc = acc + sums[:, :, b].float() * (d[:, b][None, :] * dx[:, b][:, None])
    return acc


def test_the_16_row_native_head_is_its_integer_reference_bit_for_bit_for_any_rows_threads_and_isa():
    from specdec.models import native
    from specdec.models.native import Q8Rows, q8_0_codes

    if not native.available(torch.device("cpu")):
        pytest.skip("no native kernels here")
    data, ref = q8_0(48, 256, seed=6)                                          # 3 groups of 16 rows
    codes = q8_0_codes(data, (48, 256))
    head = Q8Rows.of(codes["q"], codes["d"])
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(7)).bfloat16()   # 11: a chunk of 8 and 3
    x[3] = 0
    out = head(x)
    assert torch.equal(out, q8r_reference(x, codes["q"], codes["d"]))
    for isa in range(native.q8x8_isa() + 1):
        assert torch.equal(dataclasses.replace(head, isa=isa)(x), out), isa
    for r in (0, 3, 9):
        assert torch.equal(head(x[r:r + 1]), out[r:r + 1])
    dense = x.float() @ torch.from_numpy(ref).t()
    assert float((out - dense).abs().max() / dense.abs().max()) < 0.02
    assert head.check.many_rows and head.check.lone_row
    with pytest.raises(ValueError, match="groups of 16"):
        Q8Rows.of(codes["q"][:40], codes["d"][:40])
    big = Q8Rows.of(torch.randint(-127, 128, (6144, 256), dtype=torch.int8), torch.rand(6144, 8) / 100)
    assert same_bits_on_one_and_two_threads(big, x)                            # large enough to be split


def test_rows_past_a_kernels_checked_limit_keep_the_kernels_output_dtype():
    """Calls of more rows than the check proved go in chunks; each chunk's output is the kernel's own
    (float32 here), not rounded to the chunk's bfloat16 input."""
    x = torch.randn(11, W.shape[1], generator=torch.Generator().manual_seed(0))
    many = kernels.linear(x, W, {"k": _WideOut()}, "k")
    one_by_one = torch.cat([kernels.linear(x[i:i + 1], W, {"k": _WideOut()}, "k") for i in range(11)])
    assert many.dtype == torch.float32 and torch.equal(many, one_by_one)


@pytest.mark.parametrize("form, quant", [("eight_bit_kernel", "Q8_0"), ("four_bit_kernel", "Q4_1")])
def test_a_draft_heads_coded_linear_computes_its_gguf_weights(form, quant):
    """The coded forms of an EAGLE-3 head's linear are w quantized by gguf (Q8_0 through the native 8-bit
    kernel, Q4_1 through the target's native 4-bit one), against 8-bit inputs: within the inputs' rounding of
    what gguf dequantizes, the same bits for one row alone or among five."""
    from gguf.quants import GGMLQuantizationType, dequantize, quantize

    from specdec.models import eagle3, native

    if not native.available(torch.device("cpu")):
        pytest.skip("no native kernels on this machine")
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 96, generator=gen) * 0.05).to(torch.bfloat16)             # [out, in]
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)                        # [M, in]
    k = getattr(eagle3, form)(w)
    kind = GGMLQuantizationType[quant]
    wq = torch.from_numpy(dequantize(quantize(w.float().numpy(), kind), kind).copy()).view(64, 96)
    ref = x.float() @ wq.T                                                          # [M, out]
    out = k(x)
    assert out.shape == (5, 64) and (out - ref).abs().max() < 0.02 * ref.abs().max()
    assert (out - x.float() @ w.float().T).abs().max() > 0                          # quantized: not the dense result
    assert torch.equal(k(x[:1]), out[:1]) and torch.equal(k(x[3:4]), out[3:4])
