"""RoPE scaling a GGUF declares: linear scaling and Llama 3.x frequency factors are computed, other kinds are
refused, and so is any tensor the decoder would leave out (it would compute another model without a word)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.errors import SpecdecError
from specdec.models.config import ModelConfig
from specdec.models.decoder import Transformer, rope_tables
from specdec.models.gguf_loader import load_gguf

DIM, HEADS, HEAD_DIM, VOCAB, CTX = 16, 2, 8, 6, 64


def tiny_llama_gguf(path, keys: dict | None = None, tensors: dict | None = None) -> None:
    """A complete one-layer Llama GGUF (random float32 weights), with extra metadata `keys` (name -> value:
    str or float) and extra `tensors`."""
    import gguf

    r = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(CTX)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(16)
    w.add_head_count(HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in (keys or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    shapes = {"token_embd.weight": (VOCAB, DIM), "output_norm.weight": (DIM,), "blk.0.attn_norm.weight": (DIM,),
              "blk.0.ffn_norm.weight": (DIM,), "blk.0.attn_q.weight": (DIM, DIM), "blk.0.attn_k.weight": (DIM, DIM),
              "blk.0.attn_v.weight": (DIM, DIM), "blk.0.attn_output.weight": (DIM, DIM),
              "blk.0.ffn_gate.weight": (16, DIM), "blk.0.ffn_up.weight": (16, DIM), "blk.0.ffn_down.weight": (DIM, 16)}
    for name, shape in shapes.items():
        w.add_tensor(name, r.standard_normal(shape).astype(np.float32))
    for name, t in (tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load(path, cache: bool = False) -> Transformer:
    return load_gguf(path, torch.float32, use_cache=cache)


def test_linear_scaling_rotates_by_scaled_positions(tmp_path):
    tiny_llama_gguf(tmp_path / "plain.gguf")
    tiny_llama_gguf(tmp_path / "linear.gguf", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    tiny_llama_gguf(tmp_path / "legacy.gguf", {"llama.rope.scale_linear": 2.0})
    plain = load(tmp_path / "plain.gguf")
    for name in ("linear.gguf", "legacy.gguf"):
        scaled = load(tmp_path / name)
        assert scaled.config.rope_scale == 0.5
        assert torch.equal(scaled.cos[0:CTX:2], plain.cos[:CTX // 2])           # position 2p turns as p did
        assert torch.equal(scaled.sin_signed[0:CTX:2], plain.sin_signed[:CTX // 2])
        assert not torch.equal(scaled.cos[1:CTX // 2], plain.cos[1:CTX // 2])
        tokens = torch.tensor([[1, 2, 3, 4, 5]])
        out = [m.lm_head(m(tokens, torch.arange(5)[None], m.new_cache(1, 8), torch.tensor([0]))) for m in (plain, scaled)]
        assert not torch.equal(out[0][0, 1:], out[1][0, 1:])                     # the model computes it
        assert torch.equal(out[0][0, 0], out[1][0, 0])                           # position 0 does not turn
    tiny_llama_gguf(tmp_path / "none.gguf", {"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 8.0})
    assert torch.equal(load(tmp_path / "none.gguf").cos, plain.cos)


def test_llama3_frequency_factors_divide_each_frequency(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    factors = np.array([1.0, 4.0, 1.0, 1.0], dtype=np.float32)                  # [head_dim / 2]
    tiny_llama_gguf(tmp_path / "plain.gguf")
    tiny_llama_gguf(tmp_path / "freqs.gguf", tensors={"rope_freqs.weight": factors})
    plain, freqs = load(tmp_path / "plain.gguf"), load(tmp_path / "freqs.gguf")
    assert freqs.config.rope_freq_factors == (1.0, 4.0, 1.0, 1.0)
    # NeoX layout: columns i and i + hd/2 share frequency i; frequency 1 turns 4x slower, the others as before
    same = [0, 2, 3, 4, 6, 7]
    assert torch.equal(freqs.cos[:, same], plain.cos[:, same])
    assert torch.equal(freqs.cos[0:CTX:4, [1, 5]], plain.cos[:CTX // 4, [1, 5]])
    assert not torch.equal(freqs.cos[1:, [1, 5]], plain.cos[1:, [1, 5]])
    cached = load(tmp_path / "freqs.gguf", cache=True)                          # converted, then read back
    again = load(tmp_path / "freqs.gguf", cache=True)
    assert cached.config.rope_freq_factors == again.config.rope_freq_factors == (1.0, 4.0, 1.0, 1.0)
    assert torch.equal(again.cos, freqs.cos)


def test_sliding_window_layers_keep_unscaled_rope():
    """Gemma 3 scales its global layers' RoPE only (local layers keep base 10000, unscaled), as llama.cpp does."""
    cfg = ModelConfig(vocab_size=VOCAB, dim=DIM, n_layers=1, n_heads=HEADS, n_kv_heads=HEADS, head_dim=HEAD_DIM,
                      hidden_dim=16, max_seq_len=CTX, rope_base=1e6, rope_scale=0.125, sliding_window=4,
                      sliding_pattern=6)
    m = Transformer(cfg)
    assert torch.equal(m.lcos, rope_tables(HEAD_DIM, 10000.0, CTX)[0])
    assert torch.equal(m.cos, rope_tables(HEAD_DIM, 1e6, CTX, 0.125)[0])


@pytest.mark.parametrize("keys, tensors, message", [
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, {},
     "declares RoPE scaling 'yarn' .factor 4.*does not compute"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": -2.0}, {}, "factor -2.0 is not positive"),
    ({"llama.rope.dimension_count": 2}, {}, "rotates 2 of each head's 8 dimensions .partial RoPE."),
    ({}, {"rope_freqs.weight": np.ones(3, dtype=np.float32)}, "rope_freqs.weight holds 3 factors"),
    ({}, {"blk.0.attn_q.bias": np.zeros(DIM, dtype=np.float32)},
     "holds 1 tensor.s. this decoder does not compute .blk.0.attn_q.bias.: another variant of llama"),
])
def test_what_the_decoder_does_not_compute_is_refused(tmp_path, keys, tensors, message):
    tiny_llama_gguf(tmp_path / "m.gguf", keys, tensors)
    with pytest.raises(SpecdecError, match=message):
        load(tmp_path / "m.gguf")
