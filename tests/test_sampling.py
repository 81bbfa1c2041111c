"""The sampling transform and the verifier alone, against exact distributions."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.errors import SpecdecError
from specdec.sampling import BatchSampling, SamplingParams, make_rng, sample, to_probs
from specdec.verify import Draft, verify

from conftest import chi2_pvalue

N = 20_000


def bs(t=1.0, k=0, p=1.0, n=1):
    return BatchSampling.of([SamplingParams(t, k, p)] * n)


def test_transform_greedy_and_edge_cases():
    logits = torch.randn(3, 2, 50, generator=make_rng(0))
    greedy = to_probs(logits, bs(0.0, n=3))
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1)) and torch.all(greedy.max(-1).values == 1)
    assert torch.equal(to_probs(logits, bs(0.8, k=1, n=3)), greedy)            # top_k=1 == greedy
    assert torch.equal(to_probs(logits, bs(1.3, p=1e-6, n=3)), greedy)         # tiny top_p == greedy
    p = to_probs(logits, bs(1.0, k=7, n=3))
    assert torch.all((p > 0).sum(-1) == 7)
    torch.testing.assert_close(p.sum(-1), torch.ones(3, 2))
    full = torch.softmax(logits, -1)
    p = to_probs(logits, bs(1.0, p=0.5, n=3))
    for row, prow in zip(full.view(-1, 50), p.view(-1, 50)):
        kept = prow > 0
        assert row[kept].sum() >= 0.5 - 1e-6                                    # enough mass kept
        assert row[kept].sum() - row[kept].min() < 0.5                          # and minimal
    hot = to_probs(logits, bs(2.0, n=3))
    torch.testing.assert_close(hot, torch.softmax(logits / 2, -1))


def test_mixed_batch_rows_use_their_own_params():
    logits = torch.randn(2, 1, 30, generator=make_rng(1))
    mixed = to_probs(logits, BatchSampling.of([SamplingParams(0.0), SamplingParams(0.7, 5, 0.9)]))
    torch.testing.assert_close(mixed[0:1], to_probs(logits[0:1], bs(0.0)))
    torch.testing.assert_close(mixed[1:2], to_probs(logits[1:2], bs(0.7, 5, 0.9)))


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(temperature=float("nan")), dict(top_k=1.5)])
def test_bad_sampling_params(bad):
    with pytest.raises(SpecdecError):
        SamplingParams(**bad)


def test_inverse_cdf_sampling_matches_probs():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    u = torch.rand(N, generator=make_rng(2))
    x = sample(probs.expand(N, 4), u)
    obs = np.bincount(x.numpy(), minlength=4)
    assert obs[1] == 0
    assert chi2_pvalue(obs, probs.numpy(), N) > 1e-3


def _random_dist(v, seed, peaky=2.0):
    return torch.softmax(torch.randn(v, generator=make_rng(seed)) * peaky, -1)


@pytest.mark.parametrize("deterministic", [False, True])
def test_verifier_first_token_is_distributed_as_p(deterministic):
    V = 6
    p, q = _random_dist(V, 10), _random_dist(V, 11)
    g = make_rng(12)
    if deterministic:
        x = torch.full((N, 1), 2)                                               # a fixed guess (point mass)
        draft = Draft(x)
    else:
        x = sample(q.expand(N, V), torch.rand(N, generator=g))[:, None]
        draft = Draft(x, q.expand(N, 1, V))
    P = torch.stack([p, _random_dist(V, 13)]).expand(N, 2, V)
    v = verify(draft, P, torch.rand(N, 1, generator=g), torch.rand(N, generator=g))
    first = v.tokens[:, 0].numpy()
    assert chi2_pvalue(np.bincount(first, minlength=V), p.numpy(), N) > 1e-3
    # the recovered token (after a rejection) follows norm(max(0, p - q))
    rej = (v.num_accepted == 0).numpy()
    qq = torch.zeros(V).scatter_(0, torch.tensor([2]), 1.0) if deterministic else q
    resid = (p - qq).clamp(min=0)
    resid = (resid / resid.sum()).numpy()
    assert chi2_pvalue(np.bincount(first[rej], minlength=V), resid, int(rej.sum())) > 1e-3
    # the bonus token (all accepted) comes from the last position's p
    acc = (v.num_accepted == 1).numpy()
    assert chi2_pvalue(np.bincount(v.tokens[acc, 1].numpy(), minlength=V), P[0, 1].numpy(), int(acc.sum())) > 1e-3


def test_verifier_greedy_is_argmax_walk():
    V = 10
    logits = torch.randn(3, 4, V, generator=make_rng(3))
    am = logits.argmax(-1)
    drafts = am[:, :3].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % V                                       # row 1 rejects at position 1
    drafts[2, 0] = -1                                                           # row 2 has no draft
    p = to_probs(logits, bs(0.0, n=3))
    v = verify(Draft(drafts), p, torch.rand(3, 3), torch.rand(3))
    assert v.num_accepted.tolist() == [3, 1, 0]
    assert v.tokens[0].tolist() == am[0].tolist()
    assert v.tokens[1].tolist() == [int(am[1, 0]), int(am[1, 1]), -1, -1]
    assert v.tokens[2].tolist() == [int(am[2, 0]), -1, -1, -1]
