"""Prompts prefilled in aligned pieces, between decode steps, and reused through the prefix cache."""
from __future__ import annotations

import pytest
import torch

from specdec.engine import Engine, Request
from specdec.models.decoder import Transformer, init_random
from specdec.prefix_cache import PREFILL_PIECE, PrefixCache
from specdec.proposers.ngram import NgramProposer

from helpers import needs_bf16, tiny_config, tiny_generator

pytestmark = pytest.mark.exactness

NEW = 12


def long_model(dtype: torch.dtype) -> Transformer:
    """A tiny packed model with room for prompts of several pieces."""
    needs_bf16(dtype)
    m = init_random(Transformer(tiny_config(max_seq_len=1024)), seed=4, std=0.3)
    return m.to(dtype).eval().requires_grad_(False).pack()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model: Transformer, budget: int, cache: PrefixCache, rows: int = 4, ngram: bool = False) -> Engine:
    gen = tiny_generator(model, NgramProposer(1, 3) if ngram else None)
    return gen.engine(rows, 700, cache, budget)


def run(eng: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Greedy outputs and each sequence's cached keys and values of its prompt."""
    seqs = [eng.add(Request(p, NEW)) for p in prompts]
    kv = {}
    with torch.inference_mode():
        while eng.busy:
            eng.step()
            for s in eng.active:
                if s.row not in kv:
                    kv[s.row] = eng.cache.span(s.row, 0, len(s.request.prompt))
    return [s.generated for s in seqs], [kv[s.row] for s in seqs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_budget_does_not_change_the_bits(dtype):
    """However many prompt tokens a step may prefill, every prompt is cut at the same multiples of
    PREFILL_PIECE: outputs and cached keys/values are identical bit for bit."""
    model = long_model(dtype)
    prompts = [prompt(n, i) for i, n in enumerate((300, 5, 128, 257))]
    small = run(engine(model, 1, PrefixCache(0)), prompts)
    large = run(engine(model, 4096, PrefixCache(0)), prompts)
    assert small[0] == large[0]
    for (ka, va), (kb, vb) in zip(small[1], large[1]):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_cache_reuses_pieces_bit_for_bit(dtype):
    """A prompt that starts like an earlier one (a chat's next turn) copies the earlier full pieces and
    gets the output and cache bits of a prefill from scratch; a prompt that is exactly cached pieces
    needs no forward at all; a different prompt gets no hit."""
    model = long_model(dtype)
    first = prompt(300, 1)
    turn2 = first[:270] + prompt(90, 2)                                        # shares 2 full pieces
    whole = first[:2 * PREFILL_PIECE]                                          # exactly 2 pieces
    other = prompt(300, 3)
    cache = PrefixCache(64 << 20)
    eng = engine(model, 256, cache)
    run(eng, [first])
    assert len(cache.pieces) == 2
    for p, hit in ((turn2, 2 * PREFILL_PIECE), (whole, 2 * PREFILL_PIECE), (other, 0)):
        seq = eng.add(Request(p, NEW))
        assert seq.cached == hit
        eng.cancel(seq)
    for p in (turn2, whole, other):
        reused = run(eng, [p])
        fresh = run(engine(model, 256, PrefixCache(0)), [p])
        assert reused[0] == fresh[0]
        assert all(torch.equal(a, b) for a, b in zip(reused[1][0], fresh[1][0]))
    assert cache.hit_tokens >= 4 * 2 * PREFILL_PIECE


def test_prefix_cache_keeps_to_its_budget():
    """Least recently used pieces leave once the stored tensors would exceed the byte budget."""
    model = long_model(torch.float32)
    probe = PrefixCache(1 << 30)
    run(engine(model, 4096, probe), [prompt(PREFILL_PIECE, 9)])
    piece_bytes = probe.nbytes
    cache = PrefixCache(2 * piece_bytes)
    eng = engine(model, 4096, cache)
    a, b, c = (prompt(PREFILL_PIECE + 3, s) for s in (10, 11, 12))
    run(eng, [a])
    run(eng, [b])
    assert eng.add(Request(a, 1)).cached == PREFILL_PIECE                      # a is now the most recent
    eng.cancel(eng.active[0] if eng.active else eng.pending[0])
    run(eng, [c])                                                              # evicts b, not a
    assert cache.nbytes <= 2 * piece_bytes and len(cache.pieces) == 2
    assert eng.add(Request(a, 1)).cached == PREFILL_PIECE
    assert eng.add(Request(b, 1)).cached == 0
    with pytest.raises(ValueError):
        PrefixCache(-1)


def test_decoding_goes_on_while_a_long_prompt_is_prefilled():
    """With sequences decoding, prefill steps (bounded by the budget) and decode steps alternate: a
    long newcomer does not stall the others until its whole prompt is in."""
    model = long_model(torch.float32)
    eng = engine(model, PREFILL_PIECE, PrefixCache(0), ngram=True)
    short = eng.add(Request(prompt(10, 5), 200))
    with torch.inference_mode():
        eng.step()
        assert short in eng.active
        long_seq = eng.add(Request(prompt(600, 6), 4))
        before = len(short.generated)
        prefill_steps = 0
        while long_seq not in eng.active and not long_seq.done:
            prefills = eng.prefills_next
            eng.step()
            prefill_steps += prefills
        assert prefill_steps == 5                                              # ceil(600 / 128) pieces
        assert len(short.generated) - before >= 4                              # decode steps in between


def test_cancelling_a_half_prefilled_prompt_frees_its_row():
    model = long_model(torch.float32)
    eng = engine(model, PREFILL_PIECE, PrefixCache(0), rows=1)
    seq = eng.add(Request(prompt(400, 7), 4))
    with torch.inference_mode():
        eng.step()
        assert 0 < seq.prefilled < 400
        eng.cancel(seq)
        assert not eng.busy and eng.free == [0]
        out, _ = run(eng, [prompt(200, 8)])
    assert len(out[0]) == NEW


def test_a_disabled_prefix_cache_looks_nothing_up_and_counts_nothing():
    off = PrefixCache(0)
    assert off.lookup(list(range(3 * PREFILL_PIECE))) == [] and off.queried_tokens == 0 and off.hit_tokens == 0
    on = PrefixCache(1 << 20)
    assert on.lookup(list(range(3 * PREFILL_PIECE))) == [] and on.queried_tokens == 3 * PREFILL_PIECE
