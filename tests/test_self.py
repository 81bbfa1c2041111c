"""Self-speculation: the target's first N layers with a trained exit draft for it, losslessly."""
from __future__ import annotations

import pytest
import torch

from helpers import PROMPTS, V, check_joint, exact_joint, sample_engine, tiny_generator, tiny_model
from specdec.errors import SpecdecError
from specdec.models.early_exit import EarlyExitDraft
from specdec.draft_length import make_policy
from specdec.engine import Engine
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.self_spec import SelfProposer
from specdec.reference import reference_greedy
from specdec.sampling import SamplingParams
from specdec.train.exit import exit_losses


def _exit(target, n: int = 2, seed: int = 0) -> EarlyExitDraft:
    torch.manual_seed(seed)
    d = EarlyExitDraft(target, n, torch.arange(0, target.vocab_size, 2))
    with torch.no_grad():
        d.proj.add_(0.05 * torch.randn_like(d.proj))
    return d


@pytest.mark.parametrize("k, batch, conf", [(1, 1, 0.0), (3, 1, 0.0), (4, 3, 0.0), (4, 3, 0.3)])
def test_self_greedy_equals_plain(k, batch, conf):
    target = tiny_model(seed=7, layers=4)
    gen = tiny_generator(target, SelfProposer(_exit(target).prepare(target.dtype), conf), "fixed", k)
    for p, r in zip(PROMPTS[:batch], gen.generate(PROMPTS[:batch], max_new_tokens=30)):
        assert r.tokens == reference_greedy(target, p, 30)


@torch.inference_mode()
def test_reused_layers_give_the_targets_own_bits():
    """Verification that reuses the draft's first N layers leaves the target's cache and output bit for bit as
    a separate draft (the full verification forward) does, and the draft did reuse them."""
    from specdec.engine import Request

    target = tiny_model(seed=9, layers=4).pack()
    caches, outs = [], []
    for prop in (DraftModelProposer(_exit(target, 2).prepare(target.dtype)),
                 SelfProposer(_exit(target, 2).prepare(target.dtype))):
        reused = []
        orig = prop.propose
        prop.propose = lambda batch, k, orig=orig, reused=reused: _record(orig(batch, k), reused)
        eng = Engine(target, prop, make_policy("fixed", 3), lambda ids: "", frozenset())
        eng.allocate(2, 96)
        seqs = [eng.add(Request(list(p), 30)) for p in PROMPTS[:2]]
        while eng.busy:
            eng.step()
        outs.append([s.generated for s in seqs])
        n = [len(s.tokens) - 1 for s in seqs]
        caches.append([(eng.cache.k[:, r, :, :n[r]].clone(), eng.cache.v[:, r, :, :n[r]].clone()) for r in range(2)])
        assert reused and all(reused) == isinstance(prop, SelfProposer)
    assert outs[0] == outs[1] == [reference_greedy(target, p, 30) for p in PROMPTS[:2]]
    for (k0, v0), (k1, v1) in zip(*caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def _record(draft, into: list):
    into.append(draft.reuse is not None)
    return draft


def test_the_draft_runs_the_targets_own_first_layers():
    """Its hidden state is the target's layer-N output under the target's final norm, bit for bit."""
    target = tiny_model(seed=3, layers=4)
    d = _exit(target, 3).prepare(target.dtype)
    toks = torch.tensor([[3, 14, 15, 92, 65]])
    h = d(toks, torch.arange(5)[None], d.new_cache(1, 16), torch.tensor([0]))
    wide = target(toks, torch.arange(5)[None], target.new_cache(1, 16), torch.tensor([0]), features=(2,))
    H = target.config.dim
    assert torch.equal(h, target.final_norm(wide[..., H:].reshape(-1, H)).view_as(h))


def test_exit_training_lowers_its_loss_and_roundtrips(tmp_path):
    target = tiny_model(seed=5, layers=4)
    d = _exit(target, 2)
    toks = torch.randint(0, target.vocab_size, (4, 24))
    feats = target(toks, torch.arange(24).expand(4, 24), target.new_cache(4, 32), torch.arange(4),
                   features=(1,)).reshape(-1, 2 * target.config.dim)
    w_sub = d.lm_rows().float()
    opt = torch.optim.Adam([d.scale, d.proj], lr=1e-2)
    first = None
    for _ in range(30):
        loss, _ = exit_losses(d, feats, w_sub)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.9 * first
    path = tmp_path / "exit.safetensors"
    d.save(path, {})
    back = EarlyExitDraft.load(path, target)
    assert back.n_layers == 2 and torch.equal(back.vocab_ids, d.vocab_ids)
    assert torch.allclose(back.proj.float(), d.proj.detach(), atol=0.02)
    with pytest.raises(SpecdecError, match="trained for another target"):
        EarlyExitDraft.load(path, tiny_model(seed=6, layers=4))
    with pytest.raises(SpecdecError, match="1 <= N < 4"):
        EarlyExitDraft(target, 4, torch.arange(4))


@pytest.mark.slow        # 20,000 sequences: `make test`
def test_self_sampling_matches_exact_distribution():
    target = tiny_model(seed=20, vocab=V, std=0.5, layers=3)
    d = EarlyExitDraft(target, 1, torch.arange(V - 2)).prepare(target.dtype)
    params = SamplingParams(1.0, 6, 0.95)
    prompt = [1, 2, 1]
    samples = sample_engine(target, SelfProposer(d), params, prompt, n=20_000, k=3)
    assert check_joint(samples, exact_joint(target, prompt, params)) > 1e-3


def test_reuse_with_a_proposer_that_reads_feature_layers():
    """An engine whose forwards return feature layers (as one sharing the target with EAGLE-3 would ask):
    reusing the first layers still gives plain decoding's tokens."""
    target = tiny_model(seed=7, layers=4)
    prop = SelfProposer(_exit(target, 2).prepare(target.dtype))
    prop.feature_layers = (0, 3)
    gen = tiny_generator(target, prop, "fixed", 3)
    assert gen.generate(PROMPTS[1], max_new_tokens=20).tokens == reference_greedy(target, PROMPTS[1], 20)


def test_self_with_n_untrained_layers_is_reported_as_self():
    """`method self` with `self:N` (the first N layers and the target's own head) is still method self."""
    from specdec.api import make_proposer

    target = tiny_model(seed=7, layers=4)
    gen = tiny_generator(target, make_proposer("self", target, tiny_generator(target).tokenizer, "self:2",
                                               "float32", "cpu"), "fixed", 3)
    assert gen.method == "self"
    assert gen.generate([1, 2, 3], max_new_tokens=12).tokens == reference_greedy(target, [1, 2, 3], 12)
