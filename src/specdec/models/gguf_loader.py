"""Load a lean `Transformer` from a GGUF file (weights dequantized with `gguf`)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import SpecdecError
from .config import ModelConfig
from .decoder import Transformer, cfg_dtype_name
from . import native
from .int4 import (HEAD, HEAD_TYPES, NATIVE_HEAD, NATIVE_HEAD_Q8R, NATIVE_HEAD_Q8X8, INT4_TYPES, INT8_TYPES, Blocks4,
                   Blocks8, Int4Linear, read_blocks, read_blocks8, read_head)
from .kernels import Kernel, fastest, pack
from .registry import check_model_file, exclusive

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")


@dataclass(frozen=True)
class Weights:
    """A model converted from its file: what `build` makes a decoder of, and the cache stores."""
    config: ModelConfig                        # the file's own (full context)
    state: dict[str, torch.Tensor]             # Transformer parameter name -> dequantized weight (CPU)
    int4: dict[tuple[int, str], Kernel]        # (layer, fused linear name) or int4.HEAD -> 4-bit kernel (`Int4Linear`)
    q8_head: dict[str, torch.Tensor]           # a Q8_0 LM head as stored ({"q": int8 codes, "d": scales}) or empty
    q4: dict[tuple[int, str], dict[str, torch.Tensor]]  # the same 4-bit linears in the native layout (`native.q4_layout`)
    q8: dict[tuple[int, str], dict[str, torch.Tensor]]  # linears of 8-bit codes (`int4.Blocks8`) in `native.q8_rows_layout`


def check_gguf(path: Path) -> None:
    """A clear error where `path` is missing, a directory or not a GGUF file (its first 4 bytes are not the magic)."""
    check_model_file(path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SpecdecError(f"not a GGUF file: {path} (it does not begin with the GGUF magic bytes)")


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader`, or a clear error for a missing or corrupt file."""
    import gguf

    p = Path(path)
    check_gguf(p)
    try:
        return gguf.GGUFReader(p)
    except Exception as e:  # the reader raises many kinds on garbage
        if _ends_early(e):
            raise SpecdecError(f"truncated GGUF file: {p} ({p.stat().st_size} bytes) ends before its header or tensors "
                               f"do; an interrupted download or copy? ({type(e).__name__}: {e})") from None
        raise SpecdecError(f"not a readable GGUF file: {p} ({type(e).__name__}: {e})") from None


def _ends_early(e: Exception) -> bool:
    """Whether the reader's error is its memory map ending early: an array shorter than the header's counts."""
    return ((isinstance(e, ValueError) and str(e).startswith(("cannot reshape array of size",
                                                               "When changing to a larger dtype")))
            or (isinstance(e, IndexError) and "out of bounds" in str(e)))


_REQUIRED = object()          # `field`'s default where the key must be present


def field(reader, key: str, default=_REQUIRED):
    """The value of metadata `key`, else `default`; a clear error where the key is required and missing."""
    f = reader.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise SpecdecError(f"the GGUF lacks the metadata key {key!r}: not a complete model file")
        return default
    return f.contents()


def config_from_gguf(reader, name: str, max_seq_len: int | None = None) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SpecdecError(f"unsupported architecture {arch!r} in GGUF; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    a = arch
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise SpecdecError("the GGUF lacks the tensor 'token_embd.weight': not a complete model file")
    try:
        n_heads = int(field(reader, f"{a}.attention.head_count"))
        dim = int(field(reader, f"{a}.embedding_length"))
        head_dim = int(field(reader, f"{a}.attention.key_length", dim // n_heads))
        vocab = int(field(reader, f"{a}.vocab_size", int(emb.shape[1])))
        ctx = int(field(reader, f"{a}.context_length"))
        common = dict(
            vocab_size=vocab, dim=dim, n_layers=int(field(reader, f"{a}.block_count")),
            n_heads=n_heads, n_kv_heads=int(field(reader, f"{a}.attention.head_count_kv", n_heads)),
            head_dim=head_dim, hidden_dim=int(field(reader, f"{a}.feed_forward_length")),
            max_seq_len=min(ctx, max_seq_len) if max_seq_len else ctx,
            norm_eps=float(field(reader, f"{a}.attention.layer_norm_rms_epsilon")),
            rope_base=float(field(reader, f"{a}.rope.freq_base", 10000.0)), name=name,
        )
        sliding_window = int(field(reader, f"{a}.attention.sliding_window", 0))
        rope_dims = int(field(reader, f"{a}.rope.dimension_count", head_dim))
        common.update(rope_scale=rope_scale(reader, a), rope_freq_factors=rope_freq_factors(reader, head_dim))
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise SpecdecError(f"the GGUF's {arch} metadata does not describe a model: {type(e).__name__}: {e}") from None
    if min(n_heads, dim, ctx, vocab, common["n_layers"]) <= 0:
        raise SpecdecError(f"the GGUF's {arch} metadata does not describe a model (a size is not positive)")
    if rope_dims != head_dim:
        raise SpecdecError(f"the GGUF rotates {rope_dims} of each head's {head_dim} dimensions (partial RoPE), which "
                           "this decoder does not compute")
    if arch == "llama":
        return ModelConfig(**common)
    return ModelConfig(**common, embed_scale=dim ** 0.5, qk_norm=True,
                       sandwich_norm=True, gelu=True, sliding_window=sliding_window,
                       sliding_pattern=6, rope_local_base=10000.0)


ROPE_FREQS = "rope_freqs.weight"       # Llama 3.x: a divisor per rotary frequency


def rope_scale(reader, arch: str) -> float:
    """The factor positions are multiplied by (1 / the GGUF's linear scaling factor; 1.0: none); other kinds of
    RoPE scaling (YaRN, LongRoPE, ...) are refused: this decoder would compute another model."""
    kind = str(field(reader, f"{arch}.rope.scaling.type", "linear"))    # absent: linear by the factor, if any
    factor = float(field(reader, f"{arch}.rope.scaling.factor", field(reader, f"{arch}.rope.scale_linear", 1.0)))
    if kind not in ("none", "linear"):
        raise SpecdecError(f"the GGUF declares RoPE scaling {kind!r} (factor {factor:g}), which this decoder does not "
                           "compute (it computes none, linear and Llama 3 frequency factors)")
    if kind == "none" or factor in (0.0, 1.0):                     # as llama.cpp reads them: 0 means none
        return 1.0
    if not factor > 0:
        raise SpecdecError(f"the GGUF's RoPE scaling factor {factor!r} is not positive")
    return 1.0 / factor


def rope_freq_factors(reader, head_dim: int) -> tuple[float, ...]:
    """The GGUF's per-frequency RoPE divisors (tensor `rope_freqs.weight`, [head_dim / 2]); () where it has none."""
    t = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if t is None:
        return ()
    factors = [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
    if len(factors) != head_dim // 2 or not all(f > 0 for f in factors):
        raise SpecdecError(f"the GGUF's {ROPE_FREQS} holds {len(factors)} factors (positive ones expected: one per "
                           f"rotary frequency, {head_dim // 2})")
    return tuple(factors)


_LAYER_MAP = {
    "attn_output": "wo", "ffn_down": "w2", "attn_norm": "attn_norm", "ffn_norm": "ffn_norm",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "post_attention_norm": "post_attn_norm",
    "post_ffw_norm": "post_ffn_norm",
}


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a GGUF llama q/k weight [n_heads*hd, dim] back to the halves layout of HF / NeoX rope."""
    out, dim = w.shape
    return w.view(n_heads, out // n_heads // 2, 2, dim).transpose(1, 2).reshape(out, dim)


def load_gguf(path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
              name: str | None = None, max_seq_len: int | None = None, int4: bool = False,
              use_cache: bool = True) -> Transformer:
    """Build the decoder and fill it with the file's dequantized weights (in `dtype`).

    int4: also decode and verify through the file's own blocks where a fused linear layer is stored in
    4-bit formats (Q4_0, Q4_1, Q4_K) or as 8-bit codes (Q8_0, Q5_0, Q4_0, Q6_K) entirely (see `int4.py`); prefills
    keep the dequantized weights.
    use_cache: read the weights from the packed-weight cache (`weight_cache.py`) when it holds this
    file in this form, else convert the file and store the result there."""
    from . import weight_cache

    path = Path(path)
    check_gguf(path)                                  # before hashing it for the cache (a wrong file may be big)
    if not use_cache:
        return build(read_gguf(path, dtype, int4), device, name or path.stem, max_seq_len)
    where = weight_cache.entry(path, dtype, int4)
    weights = weight_cache.read(where)
    if weights is None:                               # one process converts; others starting with it wait, then read
        with exclusive(where.with_name(f".{where.name}.lock"), f"waiting for another process converting {path.name} ..."):
            weights = weight_cache.read(where)
            if weights is None:
                logging.getLogger("specdec").info("converting %s for this machine (once; kept in %s) ...", path.name,
                                                  where.parent)
                weights = read_gguf(path, dtype, int4)
                weight_cache.write(where, weights)
    return build(weights, device, name or path.stem, max_seq_len)


def read_gguf(path: Path, dtype: torch.dtype, int4: bool) -> Weights:
    """The file's configuration, its weights dequantized to `dtype` (CPU) and, with int4, the packed
    4-bit kernels of the fused linears stored wholly in a 4-bit format, and the 8-bit codes of those stored
    wholly in formats of 8-bit codes."""
    from gguf.quants import dequantize

    reader = open_gguf(path)
    try:
        cfg = config_from_gguf(reader, path.stem)
    except SpecdecError as e:
        raise SpecdecError(f"{path}: {e}") from None
    raw = {t.name: t for t in reader.tensors}
    raw.pop(ROPE_FREQS, None)                               # read into the configuration

    def take(key: str) -> torch.Tensor:
        if key not in raw:
            raise SpecdecError(f"GGUF {path} lacks tensor {key!r}")
        t = raw.pop(key)
        try:
            w = dequantize(t.data, t.tensor_type).reshape([int(s) for s in reversed(t.shape)])
        except Exception as e:
            raise SpecdecError(f"corrupt tensor data in GGUF {path} ({key}): {type(e).__name__}: {e}") from None
        return torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)          # a copy: the file is read-only

    arch_interleaved = field(reader, "general.architecture") == "llama"
    blocks4 = fused_blocks(raw, cfg, arch_interleaved, INT4_TYPES, read_blocks) if int4 else {}
    blocks8 = fused_blocks(raw, cfg, arch_interleaved, INT8_TYPES, read_blocks8) if int4 else {}
    q8 = {key: native.q8_rows_layout(torch.from_numpy(b.q), torch.from_numpy(b.d)) for key, b in blocks8.items()
          if key not in blocks4 and native.q4_fits(b.q.shape)}
    head = "output.weight" if "output.weight" in raw else "token_embd.weight"
    kernels4 = {key: Int4Linear.of(b) for key, b in blocks4.items()}
    q4 = {key: native.q4_layout(b.q, b.scale, b.zero) for key, b in blocks4.items() if native.q4_fits(b.q.shape)}
    if int4 and head in raw and raw[head].tensor_type.name in HEAD_TYPES:   # an 8-bit head as 4-bit halves (int4.py)
        kernels4[HEAD] = Int4Linear.of(read_head(raw[head]), copies=2)
    q8_head = {}
    if int4 and head in raw and raw[head].tensor_type.name == "Q8_0":     # also as stored, for the native kernel
        q8_head = native.q8_0_codes(raw[head].data, (int(raw[head].shape[1]), int(raw[head].shape[0])))
    sd: dict[str, torch.Tensor] = {"embed": take("token_embd.weight"), "norm": take("output_norm.weight")}
    sd["output"] = take("output.weight") if "output.weight" in raw else torch.empty(0, dtype=dtype)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        q, k = take(p + "attn_q.weight"), take(p + "attn_k.weight")
        if arch_interleaved:                    # llama.cpp permutes llama's q/k rows for pairwise rope; undo it
            q, k = unpermute(q, cfg.n_heads), unpermute(k, cfg.n_kv_heads)
        sd[f"layers.{i}.wqkv"] = torch.cat([q, k, take(p + "attn_v.weight")])
        sd[f"layers.{i}.w13"] = torch.cat([take(p + "ffn_gate.weight"), take(p + "ffn_up.weight")])
        for src, dst in _LAYER_MAP.items():
            if p + src + ".weight" in raw:
                sd[f"layers.{i}.{dst}"] = take(p + src + ".weight")
    if raw:                                                   # parts of a model this decoder would leave out
        names = sorted(raw)
        raise SpecdecError(f"GGUF {path} holds {len(names)} tensor(s) this decoder does not compute "
                           f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): another variant of {field(reader, 'general.architecture')}?")
    return Weights(cfg, sd, kernels4, q8_head, q4, q8)


def build(weights: Weights, device: str | torch.device, name: str, max_seq_len: int | None) -> Transformer:
    """The decoder on `device` from converted weights (shared, not copied, on the CPU), packed."""
    cfg = weights.config
    cfg = dataclasses.replace(cfg, name=name, max_seq_len=min(cfg.max_seq_len, max_seq_len or cfg.max_seq_len))
    model = Transformer(cfg)                   # uninitialised parameters (untouched pages), replaced below
    try:
        missing, unexpected = model.load_state_dict(weights.state, strict=False, assign=True)
    except RuntimeError as e:
        raise SpecdecError(f"weights do not fit the {cfg.name} layout: {e}") from None
    if missing or unexpected:
        raise SpecdecError(f"weights do not fit the {cfg.name} layout: missing {missing}, unexpected {unexpected}")
    model = model.to(device)
    kernels = dict(weights.int4)
    if native.available(model.device):
        for (i, name), layout in weights.q4.items():                      # 4-bit linears: torch's or the native kernel
            kernels[(i, name)] = q4_kernel(kernels[(i, name)], layout, getattr(model.layers[i], name))
        for (i, name), layout in weights.q8.items():                      # 8-bit codes: native, or prepacked dense
            k = q8_kernel(layout, getattr(model.layers[i], name))
            if isinstance(k, native.Q8Rows):
                kernels[(i, name)] = k
    if weights.q8_head and native.available(model.device):                # LM head candidates (`pack` times them)
        kernels[NATIVE_HEAD] = native.Q8Head.of(weights.q8_head["q"], weights.q8_head["d"])
        kernels[NATIVE_HEAD_Q8X8] = native.Q8Head.of(weights.q8_head["q"], weights.q8_head["d"], quantized=True)
        if native.q4_fits(tuple(weights.q8_head["q"].shape)):
            kernels[NATIVE_HEAD_Q8R] = native.Q8Rows.of(weights.q8_head["q"], weights.q8_head["d"])
    return model.eval().requires_grad_(False).use_int4(kernels).pack()


def q4_kernel(int4: Int4Linear, layout: dict[str, torch.Tensor], w: torch.Tensor) -> Kernel:
    """A 4-bit linear's kernel: torch's int4 kernel (bfloat16 activations) or the native one (activations
    quantized to 8 bits, as llama.cpp computes), whichever is faster on this machine for its shape, timed at
    the first start (`kernels.fastest`) and kept, so every start computes the same bits."""
    makers = {"int4": lambda: int4, **split_or_not("native-q4", lambda: native.Q4Linear.of(layout))}
    return fastest(("q4-linear", *w.shape, cfg_dtype_name(w.dtype), *sorted(makers), native.source_stamp()), makers, w)


def q8_kernel(layout: dict[str, torch.Tensor], w: torch.Tensor) -> Kernel:
    """A linear of 8-bit codes: the native 8-bit kernel (activations quantized to 8 bits, as llama.cpp computes
    Q8_0, Q5_0 and Q6_K layers) or oneDNN on the dequantized weights prepacked, whichever is faster on this machine
    for its shape (timed at the first start and kept, as `q4_kernel`)."""
    makers = {"onednn": lambda: pack(w), **split_or_not("native-q8r", lambda: native.Q8Rows.of_layout(layout))}
    scales = f"scales/{32 * 16 // layout['d'].shape[-1]}"                  # a scale per 32 or per 16 inputs
    return fastest(("q8-linear", *w.shape, scales, cfg_dtype_name(w.dtype), *sorted(makers), native.source_stamp()),
                   makers, w)


def split_or_not(name: str, make: Callable[[], native.Q4Linear | native.Q8Rows]) -> dict[str, Callable[[], Kernel]]:
    """A native kernel as candidates of `fastest`: on the calling thread (`name`) and, where torch has several, its
    output groups split over them (`name`-threads). Which pays depends on the CPU and the shape (threads pay for a
    layer whose codes stream from memory, not for one whose call is shorter than waking them), so the first start
    times both; the bits are the same."""
    if torch.get_num_threads() == 1:
        return {name: make}
    return {name: lambda: dataclasses.replace(make(), threads=False),
            f"{name}-threads": lambda: dataclasses.replace(make(), threads=True)}


def fused_blocks(tensors: dict, cfg: ModelConfig, interleaved: bool, types: tuple[str, ...],
                 read: Callable) -> dict[tuple[int, str], Blocks4 | Blocks8]:
    """(layer, fused linear name) -> its blocks (`read` of each part, joined), for the fused layers whose parts
    are all stored in `types`."""
    parts = {"wqkv": ("attn_q", "attn_k", "attn_v"), "w13": ("ffn_gate", "ffn_up"), "wo": ("attn_output",),
             "w2": ("ffn_down",)}
    heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}
    out = {}
    for i in range(cfg.n_layers):
        for name, srcs in parts.items():
            ts = [tensors.get(f"blk.{i}.{s}.weight") for s in srcs]
            if any(t is None or t.tensor_type.name not in types for t in ts):
                continue
            bs = []
            for s, t in zip(srcs, ts):
                b = read(t)
                if interleaved and s in heads:                 # the rows' rope permutation, as for the weights
                    b = b.rows(unpermute(torch.arange(b.q.shape[0])[:, None], heads[s])[:, 0].numpy())
                bs.append(b)
            out[(i, name)] = type(bs[0]).cat(bs)
    return out
