"""The native attention kernel: right against a float64 reference, and each query's bits its own."""
from __future__ import annotations

import pytest
import torch

from specdec.models import native
from specdec.tree import TokenTree

from test_model import target_shaped

pytestmark = pytest.mark.exactness

needs_native = pytest.mark.skipif(not native.available(torch.device("cpu")),
                                  reason=f"native attention unavailable: {native.describe(torch.device('cpu'))}")


def _cache(B: int, nkv: int, slots: int, hd: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [L=2, R=B+1, nkv, slots, hd] like a KVCache's, so layer/row views are strided as in a forward."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, B + 1, nkv, slots, hd, generator=g) for _ in range(2))


def _reference(q, k, v, visible, scale):
    """Masked softmax attention in float64: q [B, nh, T, hd], k, v [B, nkv, S, hd] -> [B, T, nh * hd]."""
    B, nh, T, hd = q.shape
    g = nh // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible[:, None], float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, nh * hd)


@needs_native
@pytest.mark.parametrize("nh, nkv, hd", [(9, 3, 64), (4, 1, 256)])
def test_native_attention_is_attention(nh, nkv, hd):
    B, T, S = 2, 5, 256
    k, v = _cache(B, nkv, 384, hd, 0)
    kc, vc = k[1, 1:3, :, :S], v[1, 1:3, :, :S]                                # strided views, as read in a forward
    q = torch.randn(B, nh + nkv, T, hd, generator=torch.Generator().manual_seed(1))[:, :nh]
    visible = torch.rand(B, T, S, generator=torch.Generator().manual_seed(2)) < 0.6
    visible[:, :, 0] = True
    out = native.attend(q, kc, vc, visible, hd ** -0.5)
    torch.testing.assert_close(out.double(), _reference(q, kc, vc, visible, hd ** -0.5), rtol=1e-5, atol=1e-5)


@needs_native
def test_a_query_gets_the_bits_of_its_own_keys_whatever_shares_the_call():
    """Alone, among other queries and sequences, with more masked keys after its own, or with its keys
    scattered over the window in the same order: the same bits."""
    nh, nkv, hd = 9, 3, 64
    k, v = _cache(2, nkv, 512, hd, 3)
    q = torch.randn(2, nh, 6, hd, generator=torch.Generator().manual_seed(4))
    visible = torch.zeros(2, 6, 512, dtype=torch.bool)
    for t in range(6):
        visible[:, t, :200 + t] = True                                        # causal chains after 200 keys
    full = native.attend(q, k[0, :2], v[0, :2], visible, 0.125)               # [2, 6, nh*hd]
    for b in range(2):
        for t in range(6):
            n = 200 + t
            alone = native.attend(q[b:b + 1, :, t:t + 1], k[0, b:b + 1, :, :n], v[0, b:b + 1, :, :n],
                                  visible[b:b + 1, t:t + 1, :n].contiguous(), 0.125)
            assert torch.equal(alone[0, 0], full[b, t]), (b, t)
    # the same keys at other slots, in the same order, with gaps: the same bits
    slots = torch.arange(205) * 2
    k2, v2 = torch.zeros(1, nkv, 512, hd), torch.zeros(1, nkv, 512, hd)
    k2[0, :, slots], v2[0, :, slots] = k[0, 0, :, :205], v[0, 0, :, :205]
    vis2 = torch.zeros(1, 1, 512, dtype=torch.bool)
    vis2[0, 0, slots] = True
    moved = native.attend(q[:1, :, 5:6], k2, v2, vis2, 0.125)
    assert torch.equal(moved[0, 0], full[0, 5])


def test_torch_attention_keeps_rows_invariant_without_the_native_kernel(monkeypatch):
    """Where no compiler builds the kernel, forwards attend through torch ops: still row-invariant,
    chains and trees (a smaller version of test_model's checks)."""
    monkeypatch.setattr(native, "_TRIED", ["disabled in this test"])
    assert not native.available(torch.device("cpu"))
    model = target_shaped(5, torch.float32)
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 512, (1, 140), generator=g)
    cont = torch.randint(0, 512, (1, 6), generator=g)

    def prefilled():
        cache = model.new_cache(1, 256)
        pos = torch.arange(140)[None]
        model(prompt, pos, cache, torch.tensor([0]))
        cache.commit(torch.tensor([0]), pos, torch.tensor([140]))
        return cache

    cache, steps = prefilled(), []
    for t in range(6):
        steps.append(model(cont[:, t:t + 1], torch.tensor([[140 + t]]), cache, torch.tensor([0])))
        cache.commit(torch.tensor([0]), torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
    chunk = model(cont, 140 + torch.arange(6)[None], prefilled(), torch.tensor([0]))
    assert torch.equal(chunk, torch.cat(steps, 1))
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]])
    tokens = torch.cat([cont[:, :2], cont[:, 2:3], cont[:, 2:]], 1)[:, :6]
    tree = TokenTree(tokens, parents)
    hidden = model(tokens, 140 + tree.depth(), prefilled(), torch.tensor([0]), tree.mask())
    path = [0, 1, 3, 5]                                                       # node 5's path
    chain = model(tokens[:, path], 140 + torch.arange(4)[None], prefilled(), torch.tensor([0]))
    assert torch.equal(hidden[0, 5], chain[0, -1])


def test_native_attention_refuses_layouts_it_does_not_read():
    if not native.available(torch.device("cpu")):
        pytest.skip("native attention unavailable")
    q = torch.randn(1, 9, 1, 64)
    k = torch.randn(1, 3, 128, 64)
    with pytest.raises(ValueError, match="unsupported layout"):
        native.attend(q, k.transpose(2, 3), k, torch.ones(1, 1, 128, dtype=torch.bool), 0.125)
