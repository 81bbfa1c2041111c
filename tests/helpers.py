"""Shared test helpers: tiny random models and tokenizers, prompts, exact enumerated distributions, the
chi-square test, many sequences sampled through the engine, tiny EAGLE / Medusa heads. Imported by the
test files (which never import each other; conftest.py holds fixtures and hooks only)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.api import Generator
from specdec.draft_length import make_policy
from specdec.engine import Engine, Request, SequenceState
from specdec.models.config import ModelConfig
from specdec.models.decoder import Transformer, init_random
from specdec.models.eagle import EagleHead
from specdec.models.medusa import MedusaHeads
from specdec.prefix_cache import PrefixCache
from specdec.proposers.base import NoProposer, Proposer
from specdec.reference import exact_distribution
from specdec.sampling import BatchSampling, SamplingParams, to_probs


def needs_bf16(dtype: torch.dtype) -> None:
    """Skip a bfloat16 case where oneDNN cannot compute bfloat16 (the library refuses that dtype there)."""
    from specdec.machine import probe

    if dtype == torch.bfloat16 and not probe().onednn_bf16:
        pytest.skip("no oneDNN bfloat16 on this CPU (or SPECDEC_ISA limits it)")


def cache_at(monkeypatch: pytest.MonkeyPatch, where) -> None:
    """$SPECDEC_CACHE at `where` for one test, holding the native libraries and kernel checks the running cache
    has already built (tens of seconds of compiling and timing that the test is not about)."""
    import shutil

    from specdec.models.registry import cache_dir

    built = cache_dir()
    for part in ("native", "kernel-checks"):
        if (built / part).is_dir() and not (where / part).exists():
            shutil.copytree(built / part, where / part)
    monkeypatch.setenv("SPECDEC_CACHE", str(where))


def same_bits_on_one_and_two_threads(kernel, x: torch.Tensor) -> bool:
    """Whether kernel(x) gives the same bits with one torch thread and with two."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x)
        torch.set_num_threads(2)
        return torch.equal(kernel(x), one)
    finally:
        torch.set_num_threads(threads)


class TinyTokenizer:
    """Token ids as space-separated numbers; id 1 is EOS (only when asked)."""

    def __init__(self, vocab_size: int, eos: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = frozenset() if eos is None else frozenset({eos})
        self.has_chat_template = False
        self.vocab = {str(i): i for i in range(vocab_size)}
        self.bos_id = -1
        self.byte_ids: frozenset[int] = frozenset()

    def encode(self, text: str, chat: bool) -> list[int]:
        return [int(t) % self.vocab_size for t in text.split()]

    def encode_text(self, text: str) -> list[int]:
        return self.encode(text, False)

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


PROMPTS = [[3, 5, 7, 9], list(range(10, 28)), [42, 1, 42, 1, 42]]
V, NEW, N = 8, 4, 20_000            # chi-square tests: vocabulary, continuation length, sequences


def rng(seed: int) -> torch.Generator:
    """A seeded torch generator for test data."""
    return torch.Generator().manual_seed(seed)


def exact_joint(model, prompt: list[int], params: SamplingParams, new: int = NEW) -> dict[tuple, float]:
    """P(whole `new`-token continuation) under the transform, by enumeration."""
    s = BatchSampling.of([params])
    frontier = [((), 1.0)]
    for _ in range(new):
        nxt = []
        for path, pr in frontier:
            p = to_probs(exact_distribution(model, prompt + list(path))[None, None], s)[0, 0]
            for t in torch.nonzero(p).flatten().tolist():
                nxt.append((path + (t,), pr * float(p[t])))
        frontier = nxt
    return dict(frontier)


def run_engine(target, proposer: Proposer, requests: list[Request], policy: str = "fixed", k: int = 3,
               slots: int = 0) -> list[SequenceState]:
    """Decode `requests` as one batch (prefilled in one step) with `policy` drafting up to k tokens."""
    target.pack()                 # packed weights (as every loaded model has): equal prompts share a prefill
    budget = sum(len(r.prompt) for r in requests)
    eng = Engine(target, proposer, make_policy(policy, k), lambda ids: "", frozenset(), PrefixCache(0), budget)
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    eng.allocate(len(requests), slots or longest + 2 * max(k, 8) + 20)      # room for trees and `auto`'s K
    seqs = [eng.add(r) for r in requests]
    with torch.inference_mode():
        while eng.busy:
            eng.step()
    return seqs


SAMPLE_BATCH = 5000      # sequences per engine batch in the chi-square tests


def sample_engine(target, proposer: Proposer, params: SamplingParams | list[SamplingParams], prompt: list[int],
                  n: int = N, k: int = 3, policy: str = "fixed", new: int = NEW) -> list[tuple]:
    """n continuations of `prompt` (sequence i with seed i; params: one for all or one per sequence), decoded
    in batches of up to SAMPLE_BATCH sequences: a row's tokens do not depend on its batch (seeded per sequence,
    row-invariant kernels), and one batch of 20,000 took 11 GB."""
    per = params if isinstance(params, list) else [params] * n
    reqs = [Request(list(prompt), new, SamplingParams(p.temperature, p.top_k, p.top_p, seed))
            for seed, p in zip(range(n), per)]
    return [tuple(s.generated) for i in range(0, n, SAMPLE_BATCH)
            for s in run_engine(target, proposer, reqs[i:i + SAMPLE_BATCH], policy, k)]


def check_joint(samples: list[tuple], exact: dict[tuple, float]) -> float:
    """Chi-square p-value of the samples' continuations against the exact distribution."""
    keys = sorted(exact)
    index = {key: i for i, key in enumerate(keys)}
    assert all(s in index for s in samples), "sampled a continuation of probability zero"
    obs = np.bincount([index[s] for s in samples], minlength=len(keys))
    return chi2_pvalue(obs, np.array([exact[k] for k in keys]), len(samples))


def close_draft():
    """The target of the chi-square tests with noise on every weight: acceptance high but not certain."""
    return perturbed_copy(tiny_model(seed=20, vocab=V, std=0.5), 0.1)


def head_for(target, seed: int = 0, vocab: torch.Tensor | None = None) -> EagleHead:
    """A randomly initialised EAGLE head for `target` (over `vocab`, default all tokens)."""
    torch.manual_seed(seed)
    ids = torch.arange(target.vocab_size) if vocab is None else vocab
    return EagleHead(target, ids).prepare(torch.float32)


def heads_for(target, n: int = 3, seed: int = 0, vocab: torch.Tensor | None = None) -> MedusaHeads:
    """n random Medusa heads over `vocab` (default every third token)."""
    torch.manual_seed(seed)
    h = MedusaHeads(target, torch.arange(0, target.vocab_size, 3) if vocab is None else vocab, n)
    with torch.no_grad():
        h.w.normal_(0, 0.2)
    return h.prepare(torch.float32)


def stream_engine(target, proposer: Proposer, requests: list[Request], policy: str = "auto", k: int = 3,
                  rows: int = 4) -> list[SequenceState]:
    """Decode `requests` through `rows` slots, each newcomer joining as a sequence finishes (the server's
    continuous batching): batches of changing composition, and `auto` sees small batches, where it drafts."""
    target.pack()
    eng = Engine(target, proposer, make_policy(policy, k), lambda ids: "", frozenset())
    eng.allocate(rows, max(len(r.prompt) + r.max_new_tokens for r in requests) + 2 * max(k, 8) + 20)
    waiting, seqs = list(reversed(requests)), []
    with torch.inference_mode():
        while waiting or eng.busy:
            while waiting and eng.free:
                seqs.append(eng.add(waiting.pop()))
            eng.step()
    return seqs


class Stateless:
    """A test proposer's no-op bookkeeping: it keeps no state between steps (subclasses define propose)."""
    feature_layers: tuple[int, ...] = ()

    def allocate(self, rows, slots):
        pass

    def start(self, rows, prompts, hidden):
        pass

    def commit(self, batch, verdict, hidden):
        pass

    def forget(self):
        pass


class Recording:
    """A proposer that keeps every draft the wrapped one made."""

    def __init__(self, inner) -> None:
        self.inner, self.drafts = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, batch, k):
        self.drafts.append(self.inner.propose(batch, k))
        return self.drafts[-1]


def target_shaped(seed: int, dtype: torch.dtype, shape: str = "smollm2"):
    """A random, packed 2-layer model with smollm2-135m's or gemma3-270m's layer shapes (CPU GEMMs pick
    kernels by shape: MKL on an Intel Xeon switched by row count for Gemma's head_dim 256 attention)."""
    needs_bf16(dtype)
    if shape == "gemma3":
        cfg = ModelConfig(vocab_size=512, dim=640, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=256,
                          hidden_dim=2048, max_seq_len=512, embed_scale=640 ** 0.5, qk_norm=True,
                          sandwich_norm=True, gelu=True, sliding_window=256, sliding_pattern=2,
                          name="gemma3-shaped")
    else:
        cfg = ModelConfig(vocab_size=512, dim=576, n_layers=2, n_heads=9, n_kv_heads=3, head_dim=64,
                          hidden_dim=1536, max_seq_len=512, name="smollm2-shaped")
    return init_random(Transformer(cfg), seed=seed, std=0.05).to(dtype).eval().requires_grad_(False).pack()
