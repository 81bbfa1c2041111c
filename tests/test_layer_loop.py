"""The native layer loop (layers.cpp) gives the bits of the Python layer loop it replaces: every layer's
4-bit, 8-bit and dense linears, norms and attention, for one token, K tokens, token trees, ragged batches and
feature taps, Llama's and Gemma's layer shapes, bfloat16 and float32 activations."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from specdec.models import native
from specdec.models.config import ModelConfig
from specdec.models.decoder import LINEARS, Transformer, init_random, truncated
from specdec.models.int4 import GROUP, Blocks4, Int4Linear

from helpers import needs_bf16

pytestmark = pytest.mark.exactness

CPU = torch.device("cpu")
needs_loop = pytest.mark.skipif(not (native.available(CPU) and native.loop_available()),
                                reason="native layer loop unavailable (no C/C++ compiler or SPECDEC_LOOP=0)")

SHAPES = {
    "llama": ModelConfig(vocab_size=512, dim=576, n_layers=3, n_heads=9, n_kv_heads=3, head_dim=64,
                         hidden_dim=1536, max_seq_len=512, name="llama-shaped"),
    "gemma": ModelConfig(vocab_size=512, dim=640, n_layers=3, n_heads=4, n_kv_heads=1, head_dim=256,
                         hidden_dim=2048, max_seq_len=512, embed_scale=640 ** 0.5, qk_norm=True, sandwich_norm=True,
                         gelu=True, sliding_window=12, sliding_pattern=2, name="gemma-shaped"),
}


def random_blocks(n: int, k: int, rng: np.random.Generator) -> Blocks4:
    g = k // GROUP
    return Blocks4(rng.integers(0, 16, (n, k), dtype=np.uint8), rng.uniform(0.002, 0.02, (n, g)).astype(np.float32),
                   rng.normal(0, 0.02, (n, g)).astype(np.float32))


_MODELS: dict[tuple[str, torch.dtype, str], Transformer] = {}


def q4_model(shape: str, dtype: torch.dtype, kernel: str = "int4") -> Transformer:
    """A random 3-layer model whose linears are 4-bit, as the q4 mode loads one: through torch's int4 kernel,
    the native one (`native.Q4Linear`), a mix (layer by layer and linear by linear), or that mix with every
    third linear in another format (dense: a oneDNN-prepacked weight); q8: a third each native 4-bit, 8-bit
    codes (`native.Q8Rows`, a scale per 32 inputs as gemma3's Q5_0 and Q8_0 tensors or per 16 as its Q6_K ones)
    and dense."""
    needs_bf16(dtype)
    if (shape, dtype, kernel) not in _MODELS:
        cfg = SHAPES[shape]
        model = init_random(Transformer(cfg), seed=3, std=0.05).to(dtype).eval().requires_grad_(False)
        rng = np.random.default_rng(0)
        kernels = {}
        for i, layer in enumerate(model.layers):
            for j, n in enumerate(LINEARS):
                b = random_blocks(*getattr(layer, n).shape, rng)
                native_here = kernel in ("native", "q8") or (kernel in ("mixed", "dense") and (i + j) % 2)
                if kernel in ("dense", "q8") and (i + j) % 3 == 0:
                    continue                                                 # `pack` gives it a PackedLinear
                if kernel == "q8" and (i + j) % 3 == 1:
                    n_out, n_in = getattr(layer, n).shape
                    q = torch.from_numpy(rng.integers(-128, 128, (n_out, n_in), dtype=np.int8))
                    per = GROUP if i % 2 else GROUP // 2                     # a scale per 32 or (Q6_K) 16 inputs
                    d = torch.from_numpy(rng.uniform(0.0005, 0.003, (n_out, n_in // per)).astype(np.float32))
                    kernels[i, n] = native.Q8Rows.of_layout(native.q8_rows_layout(q, d))
                    continue
                kernels[i, n] = (native.Q4Linear.of(native.q4_layout(b.q, b.scale, b.zero)) if native_here
                                 else Int4Linear.of(b))
        _MODELS[shape, dtype, kernel] = model.use_int4(kernels).pack()
    return _MODELS[shape, dtype, kernel]


def forward_both(model: Transformer, lengths: list[int], t: int, tree: bool = False,
                 features: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, key cache) of one forward of t tokens per row after `lengths` tokens, through the native loop
    and through the Python loop, from the same prefilled cache."""
    B = len(lengths)
    g = torch.Generator().manual_seed(sum(lengths) + t)
    rows = torch.arange(B)
    prompt = torch.randint(0, model.vocab_size, (B, max(lengths)), generator=g)
    tokens = torch.randint(0, model.vocab_size, (B, t), generator=g)
    mask = None
    depth = torch.arange(t)
    if tree:                                                                 # a root and its t - 1 children
        depth = (torch.arange(t) > 0).long()
        mask = (torch.eye(t, dtype=torch.bool) | (torch.arange(t) == 0)[None, :]).expand(B, t, t).contiguous()
    out = []
    loop = model.loop
    for use_loop in (True, False):
        cache = model.new_cache(B, 256)
        model.prefill(prompt, torch.arange(prompt.shape[1]).expand(B, -1), cache, rows)   # the same prefill
        model.loop = loop if use_loop else None
        cache.lengths[rows] = torch.tensor(lengths)
        pos = cache.lengths[rows][:, None] + depth
        hidden = model.forward(tokens, pos, cache, rows, mask, features=features)
        out.append((hidden, cache.k.clone()))
    model.loop = loop
    return out


@needs_loop
@pytest.mark.parametrize("kernel", ["int4", "native", "mixed", "dense", "q8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", ["llama", "gemma"])
@pytest.mark.parametrize("case", ["one token", "K tokens", "tree", "ragged batch", "features"])
def test_the_native_loop_gives_the_python_loops_bits(shape, dtype, case, kernel):
    model = q4_model(shape, dtype, kernel)
    assert model.loop is not None and model.loop.dtype == dtype
    kinds = {type(k).__name__ for layer in model.layers for k in layer.packed.values()}
    assert ("PackedLinear" in kinds) == (kernel in ("dense", "q8")) and ("Q8Rows" in kinds) == (kernel == "q8")
    lengths, t, tree, features = {
        "one token": ([30], 1, False, ()),
        "K tokens": ([30], 5, False, ()),
        "tree": ([30], 6, True, ()),
        "ragged batch": ([30, 17, 41], 4, False, ()),
        "features": ([30, 9], 3, False, (0, 2)),
    }[case]
    (a, ka), (b, kb) = forward_both(model, lengths, t, tree, features)
    assert a.shape == b.shape and a.shape[-1] == model.config.dim * (1 + len(features))
    assert torch.equal(a, b), f"max difference {(a.float() - b.float()).abs().max()}"
    assert torch.equal(ka, kb)                                               # the same keys written


@needs_loop
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", ["llama", "gemma"])
def test_attention_split_over_two_threads_keeps_the_bits(shape, dtype):
    """On long contexts the loop splits attention's (token, query head) pairs over torch's threads, cutting kv
    groups apart (llama: 9 heads in groups of 3; gemma: 4 heads in one group): the bits of one thread and of
    the Python loop, outputs and keys."""
    model = q4_model(shape, dtype, "native")
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(forward_both(model, [200, 121, 7], 3))
    finally:
        torch.set_num_threads(threads)
    [(one, k_one), (python, k_python)], [(two, k_two), _] = runs
    assert torch.equal(one, two) and torch.equal(one, python)
    assert torch.equal(k_one, k_two) and torch.equal(k_one, k_python)


@needs_loop
def test_the_loop_runs_and_is_used_by_decoding_forwards(monkeypatch):
    model = q4_model("llama", torch.float32, "mixed")
    calls = []
    real = native.LayerLoop._run
    monkeypatch.setattr(native.LayerLoop, "_run",
                        lambda self, *a: calls.append((*a[2:4], a[6].numel() > 0)) or real(self, *a))
    forward_both(model, [20], 2, features=(1,))
    # both prefills run through the loop; the looped forward splits at the feature tap; the last layers' call
    # makes the final norm too
    assert calls == [(0, 3, True), (0, 2, False), (2, 3, True), (0, 3, True)]


@needs_loop
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", ["llama", "gemma"])
def test_a_prefill_through_the_loop_is_decoding_token_by_token(shape, dtype, monkeypatch):
    """A prompt piece longer than the loop's rows is prefilled through the loop in forwards of its rows: every
    position's output and the keys and values written are those of feeding the prompt one token at a time,
    after what the row held; the cache's committed length is left to the caller."""
    model = q4_model(shape, dtype, "mixed")
    calls = []
    real = native.LayerLoop._run
    monkeypatch.setattr(native.LayerLoop, "_run", lambda self, *a: calls.append(len(a[0])) or real(self, *a))
    P, held = model.loop.max_rows + 9, 5
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, model.vocab_size, (1, held + P), generator=g)
    rows = torch.tensor([0])
    runs = []
    for whole in (True, False):
        cache = model.new_cache(1, 256)
        model.prefill(prompt[:, :held], torch.arange(held)[None], cache, rows)
        cache.lengths[0] = held
        if whole:
            out = model.prefill(prompt[:, held:], torch.arange(held, held + P)[None], cache, rows)      # [1, P, D]
            assert int(cache.lengths[0]) == held
            cache.lengths[0] = held + P
        else:
            outs = []
            for t in range(held, held + P):
                outs.append(model.forward(prompt[:, t:t + 1], torch.tensor([[t]]), cache, rows))
                cache.lengths[0] += 1
            out = torch.cat(outs, 1)
        runs.append((out, cache.k[:, :, :, :held + P].clone(), cache.v[:, :, :, :held + P].clone()))
    (a, ka, va), (b, kb, vb) = runs
    assert torch.equal(a, b), f"max difference {(a.float() - b.float()).abs().max()}"
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    rows_run = model.loop.max_rows
    assert calls == [held, rows_run, P - rows_run, held] + [1] * P          # the loop ran every forward
    assert native.describe_loop(model).endswith(f"prompts too, {rows_run} tokens per forward)")   # as `info` says


@needs_loop
def test_a_truncated_model_runs_its_own_layers_through_the_shared_loop(monkeypatch):
    """An early-exit draft (`truncated`) shares the target's loop: its forwards run its own layers and its final
    norm there (the bits of the Python loop), and the loop refuses layers it does not have."""
    model = q4_model("llama", torch.float32, "mixed")
    short = truncated(model, 2)
    plans = []
    real = native.LayerLoop._run
    monkeypatch.setattr(native.LayerLoop, "_run",
                        lambda self, *a: plans.append(a) or real(self, *a))
    (a, ka), (b, kb) = forward_both(short, [9, 4], 3)
    assert torch.equal(a, b) and torch.equal(ka, kb)
    assert {(p[2], p[3]) for p in plans} == {(0, 2)}
    x, o, _, _, attend, local, w = plans[-1]
    with pytest.raises(ValueError, match=r"layers \[0, 3\) but a cache of 2"):
        model.loop.normed(x, o, 0, 3, attend, local, w)                  # the truncated model's cache: 2 layers
    with pytest.raises(ValueError, match=r"no layers \[-1, 2\)"):
        model.loop.normed(x, o, -1, 2, attend, local, w)                 # refused by layers.cpp itself


@needs_loop
def test_forwards_beyond_the_checked_row_limit_run_from_python(monkeypatch):
    model = q4_model("llama", torch.float32, "mixed")
    calls = []
    real = native.LayerLoop._run
    monkeypatch.setattr(native.LayerLoop, "_run", lambda self, *a: calls.append(len(a[0])) or real(self, *a))
    (a, _), (b, _) = forward_both(model, [10], model.loop.max_rows + 1)
    assert calls == [10, 10] and torch.equal(a, b)                           # the two prefills only


@pytest.mark.skipif(not (native.available(CPU) and native._cxx()) or os.environ.get("SPECDEC_LOOP") == "0",
                    reason="no native kernels or no C++ compiler")
def test_the_loop_builds_where_a_cpp_compiler_is_found():
    assert native.loop_available(), native._LOOP_TRIED


def test_models_without_int4_linears_have_no_loop():
    cfg = SHAPES["llama"]
    model = init_random(Transformer(cfg), seed=0, std=0.05).eval().requires_grad_(False).pack()
    assert model.loop is None


def test_specdec_loop_0_keeps_the_python_loop_and_says_so():
    import subprocess
    import sys

    code = ("import torch; from specdec.models import native; "
            "print(native.loop_available(), native.describe_loop(object()))")
    env = {**os.environ, "SPECDEC_LOOP": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("False") and "SPECDEC_LOOP=0" in out.stdout
