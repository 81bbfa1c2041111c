"""An EAGLE-style draft head: feature-level autoregression over the target's last hidden states.

Input at position i: fc([embed(x_{i+1}); f_i]) -> one decoder layer -> f^_{i+1}, the
predicted target feature; the target's own LM head (restricted to a reduced draft
vocabulary of frequent tokens, where the head's cost is dominated by it) turns it
into draft logits. Token embeddings and LM-head rows are the target's, frozen.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from ..cache import KVCache
from ..errors import SpecdecError
from .decoder import Transformer, materialize
from .kernels import linear, pack, packed_linear_available


def target_fingerprint(target: Transformer) -> str:
    """Identifies the target a head was trained for (shapes + a hash of some embedding rows)."""
    c = target.config
    rows = (target.embed[:: max(1, c.vocab_size // 64)] > 0).numpy().tobytes()   # dtype-independent
    return f"{c.n_layers}x{c.dim}x{c.vocab_size}-" + hashlib.sha1(rows).hexdigest()[:12]


class EagleHead(nn.Module):
    feature_layers: tuple[int, ...] = ()                       # reads the target's final hidden state only

    def __init__(self, target: Transformer, vocab_ids: Tensor, n_layers: int = 1) -> None:
        super().__init__()
        cfg = replace(target.config, n_layers=n_layers, vocab_size=1, name="eagle-head")
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=True)
        with torch.device("meta"):
            core = Transformer(cfg)
        core = materialize(core)
        core.cos, core.sin_signed = target.cos.cpu(), target.sin_signed.cpu()
        for name, p in core.named_parameters():
            with torch.no_grad():
                if "norm" in name:
                    p.fill_(1.0)
                elif p.numel():
                    p.normal_(0, 0.02)
        self.core = core
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        self.target = [target]                                 # not a submodule: frozen, never saved
        self.packed: dict[str, Tensor] = {}

    # target pieces, frozen and shared
    @property
    def tgt(self) -> Transformer:
        return self.target[0]

    def lm_weight(self) -> Tensor:
        t = self.tgt
        w = t.output if t.output.numel() else t.embed
        return w[self.vocab_ids.to(w.device)]                  # [V', H]

    @property
    def max_seq_len(self) -> int:
        """Positions the head takes: its rotary table's (the target's)."""
        return self.core.config.max_seq_len

    def new_cache(self, rows: int, slots: int, past_context: int = 0) -> KVCache:
        return self.core.new_cache(rows, slots, past_context)

    def input_features(self, target_hidden: Tensor) -> Tensor:
        """The target's output (wider when it returns features) -> its final hidden state [.., H]."""
        return target_hidden[..., :self.core.config.dim]

    def forward(self, tokens: Tensor, features: Tensor, positions: Tensor, cache: KVCache, rows: Tensor,
                tree_mask: Tensor | None = None) -> Tensor:
        """tokens [B, T] (x_{i+1}), features [B, T, H] (f_i) -> predicted features f^_{i+1} [B, T, H]."""
        e = self.tgt.embed_tokens(tokens).to(features.dtype)
        x = linear(torch.cat([e, features], -1), self.fc.weight, self.packed, "fc")
        x = x + self.fc.bias.to(x.dtype)
        return self.core.forward_embeds(x, positions, cache, rows, tree_mask, exact_tree=False)

    def logits(self, features: Tensor) -> Tensor:
        """Draft logits over the reduced vocabulary [.., V'] (float32)."""
        return linear(features, self.lm_weight_cached, self.packed, "lm_sub").float()

    def prepare(self, dtype: torch.dtype) -> "EagleHead":
        """Inference set-up: cast to the target's dtype, cache the LM-head rows, prepack on CPU."""
        self.to(dtype).eval().requires_grad_(False)
        self.core.cos, self.core.sin_signed = self.tgt.cos, self.tgt.sin_signed  # float32 rope, never cast
        self.lm_weight_cached = self.lm_weight().to(dtype).contiguous()
        if packed_linear_available(self.lm_weight_cached.device):
            self.core.pack()
            self.packed = {"fc": pack(self.fc.weight), "lm_sub": pack(self.lm_weight_cached)}
        return self

    # ---- persistence -------------------------------------------------------------------
    def save(self, path: Path, meta: dict) -> None:
        sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()
              if k != "vocab_ids" and v.numel()}
        sd["vocab_ids"] = self.vocab_ids.to(torch.int32)
        info = {"kind": "eagle", "n_layers": str(self.core.config.n_layers),
                "target": target_fingerprint(self.tgt), **{k: str(v) for k, v in meta.items()}}
        write_weights(path, sd, info)

    @staticmethod
    def load(path: Path, target: Transformer) -> "EagleHead":
        sd, meta = read_weights(path, "eagle", target)
        with fitting(path, "an EAGLE head"):
            head = EagleHead(target, sd.pop("vocab_ids").long(), int(meta["n_layers"]))
            missing, unexpected = head.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
        if unexpected or [m for m in missing if m != "vocab_ids" and not m.endswith("output")]:
            raise SpecdecError(f"{path} does not fit an EAGLE head: missing {missing}, unexpected {unexpected}")
        return head.prepare(target.dtype)


def write_weights(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """A head's safetensors file, whole or not at all (a temporary file renamed over it: a reader, or a server
    loading it while training rewrites it, sees the old file or the new), in the umask's usual mode."""
    import os

    from safetensors.torch import save

    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    try:
        tmp.write_bytes(save(tensors, metadata=metadata))
        os.replace(tmp, p)
    except BaseException:                          # a full disk, Ctrl-C: no partial temporary file stays
        tmp.unlink(missing_ok=True)
        raise


def read_weights(path: Path, kind: str, target: Transformer) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors and metadata of a shipped head; clear errors for corrupt files and foreign targets."""
    from safetensors import safe_open

    p = Path(path)
    if p.is_dir():
        raise SpecdecError(f"{p} is a directory, not a weights file")
    if not p.is_file():
        raise SpecdecError(f"weights not found: {p}")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise SpecdecError(f"corrupt weights file {p}: {type(e).__name__}: {e}") from None
    if meta.get("kind") != kind:
        raise SpecdecError(f"{p} holds {meta.get('kind', 'unknown')!r} weights, not {kind!r}")
    want = target_fingerprint(target)
    if meta.get("target") != want:
        raise SpecdecError(f"{p} was trained for another target ({meta.get('target')}, "
                           f"this target is {want}); train one with `specdec train {kind}`")
    ids = sd.get("vocab_ids")
    if ids is not None:
        check_vocab_ids(ids, target.vocab_size, f"{p}: its vocabulary ids")
    return sd, meta


def check_vocab_ids(ids: Tensor, vocab: int, what: str) -> None:
    """A head's draft-to-target ids [draft_vocab] must name target tokens: a clear error, not an index error later."""
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
        raise SpecdecError(f"{what} leave the target's vocabulary of {vocab}")


@contextmanager
def fitting(source: Path | str, what: str) -> Iterator[None]:
    """Building `what` from the tensors of `source`: shapes or a configuration that do not fit are one
    SpecdecError line (not a RuntimeError from deep in torch)."""
    try:
        yield
    except SpecdecError:
        raise
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        last = (str(e).strip().splitlines() or [""])[-1].strip()[:200]
        raise SpecdecError(f"{source} does not fit {what}: {type(e).__name__}: {last}") from None
