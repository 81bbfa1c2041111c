"""Staged speculation: prompt lookup drafts for the draft model, the draft model for the target."""
from __future__ import annotations

import pytest
import torch

from helpers import PROMPTS, V, check_joint, exact_joint, perturbed_copy, sample_engine, tiny_generator, tiny_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.staged import StagedProposer
from specdec.reference import reference_greedy
from specdec.sampling import SamplingParams

REPETITIVE = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 9, 9, 9, 9, 9]]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 3])
def test_staged_greedy_equals_plain(k, batch):
    target = tiny_model(seed=7)
    draft = perturbed_copy(target, 0.05)
    prompts = (PROMPTS + REPETITIVE)[:batch] if batch == 1 else PROMPTS + REPETITIVE
    gen = tiny_generator(target, StagedProposer(DraftModelProposer(draft)), "fixed", k)
    for p, r in zip(prompts, gen.generate(prompts, max_new_tokens=30)):
        assert r.tokens == reference_greedy(target, p, 30)


@torch.inference_mode()
def test_stage_two_drafts_what_the_draft_would_and_saves_its_forwards():
    """The staged drafts equal the draft model's own greedy drafts, in fewer draft forwards on repetitive text."""
    from specdec.engine import Request

    from helpers import run_engine

    target = tiny_model(seed=3)
    draft = perturbed_copy(target, 0.02)
    prompt = [5, 6, 7, 8] * 6
    plain = DraftModelProposer(draft, sample_drafts=False)
    staged = StagedProposer(DraftModelProposer(draft))
    drafts, forwards = {}, {}
    for name, prop in (("plain", plain), ("staged", staged)):
        seen, n_fwd = [], []
        orig = prop.propose

        def spy(batch, k, orig=orig, prop=prop, seen=seen, n_fwd=n_fwd):
            d = orig(batch, k)
            seen.append(d.tokens.tolist())
            n_fwd.append(getattr(prop, "draft_forwards", k))
            return d
        prop.propose = spy
        run_engine(target, prop, [Request(list(prompt), 24)], "fixed", 6)
        drafts[name], forwards[name] = seen, n_fwd
    assert drafts["staged"] == drafts["plain"]
    assert sum(forwards["staged"]) < sum(forwards["plain"])


@pytest.mark.slow        # 20,000 sequences: `make test`
def test_staged_sampling_matches_exact_distribution():
    target = tiny_model(seed=20, vocab=V, std=0.5)
    draft = perturbed_copy(target, 0.1)
    params = SamplingParams(1.0, 6, 0.95)
    prompt = [1, 2, 1, 2, 1]
    samples = sample_engine(target, StagedProposer(DraftModelProposer(draft)), params, prompt, n=20_000, k=3)
    assert check_joint(samples, exact_joint(target, prompt, params)) > 1e-3


@pytest.mark.parametrize("k", [8, 12])
def test_a_batch_at_the_end_of_the_context_stays_inside_the_draft_cache(k):
    """Repetitive prompts that fill the context: one forward of the draft model feeds every row as many slots
    as the longest guess, so near the end of the cache a batch-mate's long guesses must not run a row past it
    ('context full' from the draft's forward)."""
    import random

    target = tiny_model(seed=7, layers=4, vocab=16, std=0.5)
    r, new = random.Random(0), 49
    prompts = []
    for _ in range(3):
        pat = [r.randrange(16) for _ in range(r.randint(1, 6))]
        prompts.append([pat[j % len(pat)] for j in range(target.max_seq_len - new - 1)])
    gen = tiny_generator(target, StagedProposer(DraftModelProposer(perturbed_copy(target, 0.02, seed=86))), "fixed", k)
    for p, res in zip(prompts, gen.generate(prompts, max_new_tokens=new)):
        assert res.tokens == reference_greedy(target, p, new)
