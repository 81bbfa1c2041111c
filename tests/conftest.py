"""Shared fixtures: tiny random models (fast unit tests) and the real GGUF models (integration)."""
from __future__ import annotations

import os

import specdec  # noqa: F401  (first: applies $SPECDEC_ISA before torch computes anything)
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.api import Generator
from specdec.models.config import ModelConfig
from specdec.models.decoder import Transformer, init_random
from specdec.proposers.base import NoProposer

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Greedy-equality tests of every proposer carry the promise of exactness: mark them `exactness`
    (CI runs that marker again under SPECDEC_ISA=avx2, the portable kernels)."""
    for item in items:
        if "greedy" in item.name and "equals_plain" in item.name:
            item.add_marker(pytest.mark.exactness)


def needs_bf16(dtype: torch.dtype) -> None:
    """Skip a bfloat16 case where oneDNN cannot compute bfloat16 (the library refuses that dtype there)."""
    from specdec.machine import probe

    if dtype == torch.bfloat16 and not probe().onednn_bf16:
        pytest.skip("no oneDNN bfloat16 on this CPU (or SPECDEC_ISA limits it)")


class TinyTokenizer:
    """Token ids as space-separated numbers; id 1 is EOS (only when asked)."""

    def __init__(self, vocab_size: int, eos: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = frozenset() if eos is None else frozenset({eos})
        self.has_chat_template = False
        self.vocab = {str(i): i for i in range(vocab_size)}

    def encode(self, text: str, chat: bool) -> list[int]:
        return [int(t) % self.vocab_size for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {i}" for i in ids)


def tiny_config(vocab: int = 97, layers: int = 2, gemma: bool = False, max_seq_len: int = 256) -> ModelConfig:
    if gemma:
        return ModelConfig(vocab_size=vocab, dim=32, n_layers=layers, n_heads=4, n_kv_heads=1, head_dim=16,
                           hidden_dim=64, max_seq_len=max_seq_len, embed_scale=32 ** 0.5,
                           qk_norm=True, sandwich_norm=True, gelu=True, sliding_window=8, sliding_pattern=2,
                           name="tiny-gemma")
    return ModelConfig(vocab_size=vocab, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, head_dim=8,
                       hidden_dim=64, max_seq_len=max_seq_len, name="tiny-llama")


def tiny_model(seed: int = 0, vocab: int = 97, layers: int = 2, gemma: bool = False, std: float = 0.3) -> Transformer:
    """A random fp32 model; a larger std makes its distributions peaky enough to be interesting."""
    return init_random(Transformer(tiny_config(vocab, layers, gemma)), seed, std).eval().requires_grad_(False)


def perturbed_copy(model: Transformer, noise: float, seed: int = 5) -> Transformer:
    """A copy of `model` with Gaussian noise (absolute std `noise`) on every weight: a close but imperfect draft."""
    copy = Transformer(model.config)
    copy.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return copy.eval().requires_grad_(False)


def tiny_generator(model: Transformer, proposer=None, policy: str = "fixed", k: int = 4,
                   eos: int | None = None) -> Generator:
    return Generator(model, TinyTokenizer(model.vocab_size, eos), proposer or NoProposer(), policy, k, "tiny")


@pytest.fixture(scope="session")
def smollm2():
    """(generator factory input) the real default target in fp32: model, tokenizer."""
    from specdec.api import load_model
    return load_model("smollm2-135m", "float32")


def chi2_pvalue(observed: np.ndarray, probs: np.ndarray, n: int) -> float:
    """Chi-square goodness of fit; bins with expected count < 5 are pooled."""
    exp = probs * n
    assert observed[exp == 0].sum() == 0, "a sample fell on a zero-probability outcome"
    small = exp < 5
    obs_b = np.append(observed[~small & (exp > 0)], observed[small & (exp > 0)].sum())
    exp_b = np.append(exp[~small & (exp > 0)], exp[small & (exp > 0)].sum())
    if exp_b[-1] == 0:
        obs_b, exp_b = obs_b[:-1], exp_b[:-1]
    exp_b = exp_b.astype(np.float64) * obs_b.sum() / exp_b.sum()
    obs_b = obs_b.astype(np.float64)
    exp_b[-1] += obs_b.sum() - exp_b.sum()
    return float(chisquare(obs_b, exp_b).pvalue)
