"""Architecture description shared by the Llama family and Gemma 3.

Differences between the families are feature flags, not string dispatch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scale: float = 1.0                # linear RoPE scaling: positions times this (1 / the GGUF's factor)
    rope_freq_factors: tuple[float, ...] = ()  # per-frequency divisors (Llama 3.x `rope_freqs.weight`); () = none
    # Gemma 3 features
    embed_scale: float = 1.0               # embeddings multiplied by sqrt(dim) in Gemma
    qk_norm: bool = False                  # RMSNorm on q and k per head
    sandwich_norm: bool = False            # post-attention and post-FFN norms
    gelu: bool = False                     # GELU(tanh) gate instead of SiLU
    query_scale: float = 0.0               # 0 -> 1/sqrt(head_dim)
    sliding_window: int = 0                # 0 -> all layers global
    sliding_pattern: int = 0               # every n-th layer is global (Gemma 3: 6)
    rope_local_base: float = 10000.0       # rope base of sliding-window layers
    name: str = "model"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_freq_factors", tuple(float(f) for f in self.rope_freq_factors))   # from JSON

    def is_local(self, layer: int) -> bool:
        """True if `layer` uses sliding-window attention."""
        if self.sliding_window <= 0 or self.sliding_pattern <= 0:
            return False
        return (layer + 1) % self.sliding_pattern != 0

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale > 0 else self.head_dim ** -0.5
