"""The lean decoder with its static cache against the slow reference (tiny random models)."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.reference import exact_distribution, reference_greedy

from helpers import target_shaped, tiny_generator, tiny_model

pytestmark = pytest.mark.exactness


def _full_logits(model, tokens):
    return exact_distribution(model, tokens)


@pytest.mark.parametrize("gemma", [False, True])
def test_cached_greedy_equals_reference(gemma):
    model = tiny_model(seed=1, gemma=gemma)
    gen = tiny_generator(model)
    for seed in range(3):
        prompt = [random.Random(seed).randrange(97) for _ in range(5 + 4 * seed)]
        res = gen.generate(prompt, max_new_tokens=24)
        assert res.tokens == reference_greedy(model, prompt, 24)
        assert res.metrics["tau"] == 1.0 and res.metrics["acceptance_rate"] is None


@pytest.mark.parametrize("gemma", [False, True])
def test_ragged_batch_equals_one_by_one(gemma):
    model = tiny_model(seed=2, gemma=gemma)
    gen = tiny_generator(model)
    prompts = [[3, 5, 7], list(range(10, 30)), [42] * 11]
    batch = gen.generate(prompts, max_new_tokens=16)
    for p, r in zip(prompts, batch):
        assert r.tokens == gen.generate(p, max_new_tokens=16).tokens


@pytest.mark.parametrize("gemma", [False, True])
def test_commit_truncate_property(gemma):
    """Random chunked feeding with uncommitted scratch, rollbacks and refeeds ends at the full-context logits."""
    model = tiny_model(seed=3, gemma=gemma)
    rng = random.Random(0)
    for trial in range(6):
        tokens = [rng.randrange(97) for _ in range(30)]
        cache = model.new_cache(2, 64)
        rows = torch.tensor([1])                  # a row that is not the first: row indexing matters
        fed = 0
        while fed < len(tokens):
            n = min(rng.randint(1, 5), len(tokens) - fed)
            junk = rng.randint(0, 3)              # speculative scratch rows that are not kept
            chunk = tokens[fed:fed + n] + [rng.randrange(97) for _ in range(junk)]
            pos = torch.arange(fed, fed + n + junk)[None]
            model(torch.tensor([chunk]), pos, cache, rows)
            cache.commit(rows, torch.arange(n + junk)[None], torch.tensor([n]))
            fed += n
            if rng.random() < 0.3 and fed > 2:    # roll back and refeed later
                back = rng.randint(1, min(3, fed))
                fed -= back
                cache.truncate(rows, torch.tensor([fed]))
            assert int(cache.lengths[1]) == fed and int(cache.lengths[0]) == 0
        # score one more token after the committed context; compare to the no-cache forward
        h = model(torch.tensor([[tokens[-1]]]), torch.tensor([[len(tokens)]]), cache, rows)
        expect = _full_logits(model, tokens + [tokens[-1]])
        torch.testing.assert_close(model.lm_head(h[0, -1]), expect, atol=1e-4, rtol=1e-4)


def test_truncate_rejects_growth():
    model = tiny_model()
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError):
        cache.truncate(torch.tensor([0]), torch.tensor([3]))


@pytest.mark.parametrize("gemma", [False, True])
def test_tree_commit_equals_chain(gemma):
    """Score a tree a -> {b, c}, c -> d in one forward; committing path a, c, d equals feeding the chain."""
    model = tiny_model(seed=4, gemma=gemma)
    prefix = list(range(20, 32))
    a, b, c, d = 5, 6, 7, 8
    cache = model.new_cache(1, 64)
    rows = torch.tensor([0])
    model(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache, rows)
    cache.commit(rows, torch.arange(len(prefix))[None], torch.tensor([len(prefix)]))
    L = len(prefix)
    # nodes: 0=a (depth 0), 1=b (depth 1, parent a), 2=c (depth 1, parent a), 3=d (depth 2, parent c)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)[None]
    pos = torch.tensor([[L, L + 1, L + 1, L + 2]])
    h = model(torch.tensor([[a, b, c, d]]), pos, cache, rows, mask)
    torch.testing.assert_close(model.lm_head(h[0, 3]), _full_logits(model, prefix + [a, c, d]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.lm_head(h[0, 1]), _full_logits(model, prefix + [a, b]), atol=1e-4, rtol=1e-4)
    cache.commit(rows, torch.tensor([[0, 2, 3, 1]]), torch.tensor([3]))
    h = model(torch.tensor([[9]]), torch.tensor([[L + 3]]), cache, rows)
    torch.testing.assert_close(model.lm_head(h[0, 0]), _full_logits(model, prefix + [a, c, d, 9]), atol=1e-4, rtol=1e-4)


def test_sliding_window_is_applied():
    """Gemma local layers see only the last `window` positions: far-away tokens must not matter to them."""
    model = tiny_model(seed=5, gemma=True)
    assert model.config.is_local(0) and not model.config.is_local(1)
    # with only local layers, tokens beyond the window cannot influence the output
    local_only = tiny_model(seed=5, gemma=True, layers=1)
    a = _full_logits(local_only, [1] * 10 + list(range(30, 38)))
    b = _full_logits(local_only, [2] * 10 + list(range(30, 38)))
    torch.testing.assert_close(a, b)
    c = _full_logits(model, [1] * 10 + list(range(30, 38)))
    d = _full_logits(model, [2] * 10 + list(range(30, 38)))
    assert not torch.allclose(c, d)              # the global layer still sees them


@pytest.mark.parametrize("shape", ["smollm2", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_do_not_depend_on_how_many_tokens_are_scored(dtype, shape):
    """Bit-for-bit: a token scored alone, with 1..16 drafts after it, or in a ragged batch gets the same hidden.

    This is what makes greedy speculation token-identical to plain decoding in bfloat16
    too. Shapes are the real target's (CPU GEMMs switch kernels by shape), 2 layers;
    contexts of 30..300 tokens, so key lengths cross attention blocks.
    """
    model = target_shaped(3, dtype, shape)
    g = torch.Generator().manual_seed(0)
    lens = [30, 283, 121]
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in lens]
    cont = torch.randint(0, 512, (3, 17), generator=g)

    def score(rows: list[int], chunks: list[int]) -> torch.Tensor:
        cache = model.new_cache(3, 320)
        r = torch.tensor(rows)
        n = torch.tensor([lens[i] for i in rows])
        for j, i in enumerate(rows):                                          # prefill one by one, like the engine
            pos = torch.arange(lens[i])[None]
            model(prompts[i][None], pos, cache, r[j:j + 1])
            cache.commit(r[j:j + 1], pos, n[j:j + 1])
        out, at = [], 0
        for c in chunks:
            p = n[:, None] + torch.arange(at, at + c)
            out.append(model(cont[rows, at:at + c], p, cache, r))
            cache.commit(r, torch.arange(c).expand(len(rows), c), torch.full((len(rows),), c))
            at += c
        return torch.cat(out, 1)                                              # [B, 17, H]

    for row in range(3):
        one_by_one = score([row], [1] * 17)
        for chunks in ([2] * 8 + [1], [5, 5, 7], [17], [1, 16]):
            assert torch.equal(score([row], chunks), one_by_one), (row, chunks)
        assert torch.equal(score([0, 1, 2], [5, 5, 7])[row:row + 1], one_by_one), row
        assert torch.equal(score([2, 0, 1], [1] * 17)[(row + 1) % 3:(row + 1) % 3 + 1], one_by_one), row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_length_prompts_prefilled_together_get_the_bits_of_their_own_prefill(dtype):
    """The engine prefills equal-length prompts of up to batch_prefill_limit tokens in one forward
    (up to 8 x 72 = 576 rows per GEMM): each prompt's hidden states and cached keys and values must
    equal those of a prefill of its own, bit for bit, on target-shaped layers (a bf16 model's prefill
    takes the float32 linears)."""
    model = target_shaped(6, dtype)
    g = torch.Generator().manual_seed(2)
    for n in (1, 9, 24, model.batch_prefill_limit):
        prompts = torch.randint(0, 512, (8, n), generator=g)                  # [G, P]
        pos = torch.arange(n).expand(8, n)
        together = model.new_cache(8, 128)
        rows = torch.tensor([5, 0, 3, 1, 7, 2, 6, 4])                         # any rows, any order
        hidden = model.prefill(prompts, pos, together, rows)
        for j in range(8):
            alone = model.new_cache(8, 128)
            own = model.prefill(prompts[j:j + 1], pos[:1], alone, rows[j:j + 1])
            assert torch.equal(hidden[j:j + 1], own), (n, j)
            r = int(rows[j])
            assert torch.equal(together.k[:, r, :, :n], alone.k[:, r, :, :n]), (n, j)
            assert torch.equal(together.v[:, r, :, :n], alone.v[:, r, :, :n]), (n, j)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_is_the_causal_forward(dtype):
    """prefill computes forward's function: bit for bit in float32; a bf16 model's prefill goes
    through float32 copies of the linears where that pays, which agree with the bf16 kernels to bf16
    rounding."""
    from specdec.models.decoder import float32_prefill_pays

    model = target_shaped(7, dtype)
    wide = float32_prefill_pays(dtype, model.device)
    assert bool(model.layers[0].prefill_kernels) == wide
    g = torch.Generator().manual_seed(3)
    for n in (1, 24, 100):                                                    # 100: the SDPA path
        tokens = torch.randint(0, 512, (2, n), generator=g)
        pos = torch.arange(n).expand(2, n)
        rows = torch.tensor([1, 0])
        a = model(tokens, pos, model.new_cache(2, 128), rows)
        b = model.prefill(tokens, pos, model.new_cache(2, 128), rows)
        if wide and n > 1:
            assert not torch.equal(a, b), n                                   # the float32 path ran
            torch.testing.assert_close(b.float(), a.float(), atol=0.1, rtol=0.05)
        elif not wide:
            assert torch.equal(a, b), n


@pytest.mark.parametrize("shape", ["smollm2", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context", [40, 120, 250, 433])
def test_tree_nodes_score_like_the_chain_along_their_path(dtype, context, shape):
    """Bit-for-bit: every node of a token tree gets the hidden state a chain along its path gets,
    though its ancestors sit at scratch slots that are not their positions (contexts put the tree
    inside one key block and across a block boundary; 433: four key blocks, where torch's sum over
    the blocks associated 4 and 5 terms differently before `_sum_blocks`)."""
    from specdec.tree import TokenTree

    model = target_shaped(4, dtype, shape)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 512, (1, context), generator=g)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3, 6, 5, 9]])             # root + 10 nodes, depth 5
    tokens = torch.randint(0, 512, (1, 11), generator=g)
    tree = TokenTree(tokens, parents)

    def prefilled():
        cache = model.new_cache(1, 640)
        pos = torch.arange(context)[None]
        model(prompt, pos, cache, torch.tensor([0]))
        cache.commit(torch.tensor([0]), pos, torch.tensor([context]))
        return cache

    hidden = model(tokens, context + tree.depth(), prefilled(), torch.tensor([0]), tree.mask())  # [1, 11, H]
    for node in range(11):
        path = [node]
        while int(parents[0, path[-1]]) >= 0:
            path.append(int(parents[0, path[-1]]))
        path = path[::-1]
        chain = model(tokens[:, path], context + torch.arange(len(path))[None], prefilled(), torch.tensor([0]))
        assert torch.equal(hidden[0, node], chain[0, -1]), node


def test_rolled_rope_is_the_half_rotation_bit_for_bit():
    from specdec.models.decoder import apply_rope, rope, rope_tables, signed_sin

    cos, sin = rope_tables(64, 10000.0, 300)
    x = torch.randn(2, 12, 7, 64, generator=torch.Generator().manual_seed(0))
    pos = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(1))
    c, s = cos[pos][:, None], sin[pos][:, None]
    assert torch.equal(rope(x, c, signed_sin(s)), apply_rope(x, c, s))


@pytest.mark.parametrize("rows, lengths", [([1], [5]), ([0, 1, 2], [7, 7, 7]), ([0, 1, 2], [3, 9, 7]),
                                           ([2, 0], [4, 6])])
def test_forward_slots_write_and_read_what_indexing_does(rows, lengths):
    """The strided fast paths of ForwardSlots (one block of rows, equal lengths) put and read the same values
    as KVCache.write / read by advanced indexing."""
    from specdec.cache import KVCache

    caches = [KVCache(2, 3, 2, 32, 4, torch.float32, "cpu") for _ in range(2)]
    for c in caches:
        c.lengths[:] = torch.tensor([3, 9, 7])
        c.lengths[torch.tensor(rows)] = torch.tensor(lengths)
    r = torch.tensor(rows)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(len(rows), 2, 3, 4, generator=g), torch.randn(len(rows), 2, 3, 4, generator=g)
    slots = caches[0].slots_of(r, 3, 16)
    slots.write(1, k, v)
    caches[1].write(1, r, k, v)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    for got, want in zip(slots.read(1), caches[1].read(1, r, 16, False)):
        assert torch.equal(got, want)


def test_a_chains_mask_is_its_causal_tree_mask():
    """The causal chain's visibility, built without a tree mask, is the one a lower-triangular tree mask gives."""
    from specdec.models.decoder import CAUSAL, Transformer

    lengths = torch.tensor([0, 5, 17])
    for T in (1, 3, 6):
        tril = torch.ones(T, T, dtype=torch.bool).tril().expand(3, T, T)
        assert torch.equal(Transformer._mask(lengths, T, 32, CAUSAL), Transformer._mask(lengths, T, 32, tril))
