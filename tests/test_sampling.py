"""The sampling transform and the verifier alone, against exact distributions."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.errors import SpecdecError
import specdec.sampling as sampling_module
from specdec.sampling import (BatchSampling, SamplingParams, Stream, derive_seed, position_uniforms, sample, seed_tensor,
                              step_seeds, to_probs)
from specdec.verify import Draft, verify

from helpers import chi2_pvalue, rng

N = 20_000


def bs(t=1.0, k=0, p=1.0, n=1):
    return BatchSampling.of([SamplingParams(t, k, p)] * n)


def test_transform_greedy_and_edge_cases():
    logits = torch.randn(3, 2, 50, generator=rng(0))
    greedy = to_probs(logits, bs(0.0, n=3))
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1)) and torch.all(greedy.max(-1).values == 1)
    assert torch.equal(to_probs(logits, bs(0.8, k=1, n=3)), greedy)            # top_k=1 == greedy
    assert torch.equal(to_probs(logits, bs(1.3, p=1e-6, n=3)), greedy)         # tiny top_p == greedy
    assert torch.equal(to_probs(logits, bs(1.3, p=1e-300, n=3)), greedy)       # 0 in float32: the top token stays
    assert torch.equal(to_probs(logits, bs(1.3, p=0.0, n=3)), greedy)          # top_p 0: the top token alone
    tied = torch.tensor([[[0.5, 2.0, 1.0, 2.0]]])
    assert torch.equal(to_probs(tied, bs(0.9, p=0.0)), to_probs(tied, bs(0.0)))    # ties: the first, as greedy
    for t in (1e-20, 1e-38, 1e-44):                  # the quotient would overflow: the limit, no NaN
        assert torch.equal(to_probs(logits * 50, bs(t, n=3)), greedy)
    for t in (1e30, 1e39, 1e300):                    # inf in float32: still uniform over the top k, not over all
        flat = to_probs(logits, bs(t, k=5, n=3))
        assert torch.all((flat > 0).sum(-1) == 5) and torch.allclose(flat.max(-1).values, torch.tensor(0.2))
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
    logits = torch.randn(2, 1, 30, generator=rng(1))
    mixed = to_probs(logits, BatchSampling.of([SamplingParams(0.0), SamplingParams(0.7, 5, 0.9)]))
    torch.testing.assert_close(mixed[0:1], to_probs(logits[0:1], bs(0.0)))
    torch.testing.assert_close(mixed[1:2], to_probs(logits[1:2], bs(0.7, 5, 0.9)))


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=-0.1), dict(top_p=1.5), dict(top_k=-1),
                                 dict(temperature=float("nan")), dict(top_k=1.5), dict(temperature=True),
                                 dict(top_p=True), dict(seed=1 << 64), dict(seed=-(1 << 63) - 1), dict(seed=True)])
def test_bad_sampling_params(bad):
    with pytest.raises(SpecdecError):
        SamplingParams(**bad)


def test_inverse_cdf_sampling_matches_probs():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    u = torch.rand(N, generator=rng(2))
    x = sample(probs.expand(N, 4), u)
    obs = np.bincount(x.numpy(), minlength=4)
    assert obs[1] == 0
    assert chi2_pvalue(obs, probs.numpy(), N) > 1e-3


def _random_dist(v, seed, peaky=2.0):
    return torch.softmax(torch.randn(v, generator=rng(seed)) * peaky, -1)


@pytest.mark.parametrize("deterministic", [False, True])
def test_verifier_first_token_is_distributed_as_p(deterministic):
    V = 6
    p, q = _random_dist(V, 10), _random_dist(V, 11)
    g = rng(12)
    if deterministic:
        x = torch.full((N, 1), 2)                                               # a fixed guess (point mass)
        draft = Draft(x)
    else:
        x = sample(q.expand(N, V), torch.rand(N, generator=g))[:, None]
        draft = Draft(x, q.expand(N, 1, V))
    P = torch.stack([p, _random_dist(V, 13)]).expand(N, 2, V)
    v = verify(draft, P, torch.rand(N, 2, generator=g), torch.rand(N, 1, generator=g))
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
    logits = torch.randn(3, 4, V, generator=rng(3))
    am = logits.argmax(-1)
    drafts = am[:, :3].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % V                                       # row 1 rejects at position 1
    drafts[2, 0] = -1                                                           # row 2 has no draft
    p = to_probs(logits, bs(0.0, n=3))
    v = verify(Draft(drafts), p, torch.rand(3, 4), torch.rand(3, 3))
    assert v.num_accepted.tolist() == [3, 1, 0]
    assert v.tokens[0].tolist() == am[0].tolist()
    assert v.tokens[1].tolist() == [int(am[1, 0]), int(am[1, 1]), -1, -1]
    assert v.tokens[2].tolist() == [int(am[2, 0]), -1, -1, -1]


# ---- the transform against a reference written from the definitions --------------------------------
def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, float]:
    """Plain-Python sampling transform of one row of logits (float64), and how close top-p's cut came to
    top_p (a margin under float32 rounding makes the float32 transform's cut ambiguous there).

    Greedy: the one-hot of the first maximum. Otherwise divide by the temperature; top-k keeps every token
    whose logit is at least the k-th largest; softmax; top-p keeps the smallest prefix of the tokens sorted
    by descending probability (then by id) whose mass reaches top_p, the most likely token always."""
    V = len(logits)
    if temperature == 0:
        out = np.zeros(V)
        out[int(np.argmax(logits))] = 1.0
        return out, np.inf
    x = [float(v) / temperature for v in logits]
    keep = [True] * V
    if top_k > 0:
        kth = sorted(x, reverse=True)[min(top_k, V) - 1]
        keep = [v >= kth for v in x]
    top = max(v for v, k in zip(x, keep) if k)
    e = [np.exp(v - top) if k else 0.0 for v, k in zip(x, keep)]
    p = np.array(e) / sum(e)
    margin = np.inf
    if top_p < 1:
        kept, mass = [], 0.0
        for i in sorted(range(V), key=lambda i: (-p[i], i)):
            if kept:                                            # the most likely token stays, whatever top_p
                margin = min(margin, abs(mass - top_p))
                if mass >= top_p:
                    break
            kept.append(i)
            mass += p[i]
        cut = np.zeros(V)
        cut[kept] = p[kept]
        p = cut / cut.sum()
    return p, margin


@pytest.mark.parametrize("vocab", [5, 12, 40])
def test_transform_matches_the_reference_on_random_logits_with_ties(vocab):
    """400 rows, each with its own random temperature (0 included), top-k and top-p; logits on a grid of
    0.5 so that many are tied (at the top-k boundary, inside top-p's prefix, at the maximum)."""
    g = np.random.default_rng(vocab)
    B = 400
    logits = np.round(g.normal(size=(B, vocab)) * 3) / 2
    params = [SamplingParams(float(g.choice([0.0, 0.3, 0.7, 1.0, 1.6])), int(g.choice([0, 0, 1, 2, 3, vocab - 1, vocab + 3])),
                             float(g.choice([1.0, 1.0, 0.0, 0.05, 0.37, 0.63, 0.81, 0.9, 0.99]))) for _ in range(B)]
    got = to_probs(torch.tensor(logits, dtype=torch.float32)[:, None], BatchSampling.of(params))[:, 0].double().numpy()
    ambiguous = 0
    for row, (lg, sp) in enumerate(zip(logits, params)):
        want, margin = reference_probs(lg, sp.temperature, sp.top_k, sp.top_p)
        if margin < 1e-5:
            ambiguous += 1
            continue
        assert np.array_equal(got[row] > 0, want > 0), (row, sp, lg)
        np.testing.assert_allclose(got[row], want, atol=2e-6, err_msg=str((row, sp)))
    assert ambiguous < B // 20


def test_each_row_of_the_transform_depends_only_on_its_own_logits_and_parameters():
    """Bit for bit: a row gets the same probabilities alone and in a batch mixing greedy, temperature-only,
    top-k and top-p rows (the server batches requests with different parameters)."""
    logits = torch.randn(6, 3, 97, generator=rng(4)) * 2
    params = [SamplingParams(0.0), SamplingParams(0.8), SamplingParams(1.0, 7), SamplingParams(1.0, 0, 0.9),
              SamplingParams(0.7, 20, 0.95), SamplingParams(1.3)]
    batch = to_probs(logits, BatchSampling.of(params))
    for i, sp in enumerate(params):
        assert torch.equal(batch[i], to_probs(logits[i:i + 1], BatchSampling.of([sp]))[0]), sp


def test_top_p_cut_from_a_window_equals_the_full_sort_bit_for_bit(monkeypatch):
    """The top-p cut decided among a row's most likely tokens (torch.topk) gives the bits of sorting the whole row,
    for peaked, flat and tied rows, rows with zeros (after top-k), and top_p from 0 to within 1e-7 of 1; both the
    windows and the fallback to the full sort are taken."""
    sorted_rows = []
    by_sort = sampling_module.top_p_cut_by_sort
    monkeypatch.setattr(sampling_module, "top_p_cut_by_sort", lambda p, t: sorted_rows.append(len(p)) or by_sort(p, t))
    g = torch.Generator().manual_seed(0)
    rows = 0
    for V, scales, top_ps in ((300, (0.3, 3.0, 8.0), (0.0, 1e-6, 0.3, 0.9, 0.95, 0.99999, 0.9999999)),
                              (5000, (0.3, 3.0, 8.0), (0.0, 1e-6, 0.3, 0.9, 0.95, 0.99999, 0.9999999)),
                              (49152, (3.0, 8.0), (0.3, 0.95, 0.99999))):            # smollm2's vocabulary
        for scale in scales:
            x = torch.randn(16, V, generator=g) * scale
            x[8:] = (x[8:] * 2).round() / 2                                 # ties, at the top and at the window's edge
            x[:4, V // 2:] = float("-inf")                                 # zero mass (as top-k leaves)
            x[4:6, :40] += 9.0                                             # a peak of tied tokens
            probs = torch.softmax(x, -1)
            for top_p in top_ps:
                t = torch.full((16,), top_p)
                assert torch.equal(sampling_module.top_p_cut(probs, t), by_sort(probs, t)), (V, scale, top_p)
                rows += 16
    assert 0 < sum(sorted_rows) < rows / 2          # most rows decided within a window, some by the full sort
    # the window's mass reaches top_p exactly, and the float32 rounding of the cumulative sum lets the full sort
    # keep the next token too (mass before it 0.5 - 2e-8 rounds below 0.5): the margin sends such a row to the sort
    edge = torch.full((1, 1000), 2e-8)
    edge[0, :2] = 0.25
    half = torch.tensor([0.5])
    assert int((by_sort(edge, half) > 0).sum()) == 3
    assert torch.equal(sampling_module.top_p_cut(edge, half), by_sort(edge, half))


def test_drawing_over_the_support_in_id_order_is_drawing_over_the_whole_row():
    """Where a row is 0 off a set of ids (a head's reduced vocabulary), sampling its entries at those ids in
    ascending order and mapping back draws the very token sampling the whole row draws, for every uniform
    (exact zeros leave the float64 running sums as they are)."""
    g = torch.Generator().manual_seed(2)
    V = 5000
    support = torch.randperm(V, generator=g)[:700].sort().values
    logits = torch.full((4, V), float("-inf"))
    logits[:, support] = torch.randn(4, 700, generator=g) * 3
    params = [SamplingParams(1.0), SamplingParams(0.7, 0, 0.9), SamplingParams(1.0, 50), SamplingParams(0.5)]
    q = to_probs(logits[:, None], BatchSampling.of(params))[:, 0]
    for seed in range(20):
        u = torch.rand(4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(support[sample(q[:, support], u)], sample(q, u))
    u = torch.tensor([0.0, 1 - 2.0 ** -53, 0.5, 0.999], dtype=torch.float64)        # the ends too
    assert torch.equal(support[sample(q[:, support], u)], sample(q, u))


# ---- counter-based random streams -------------------------------------------------------------------
def test_inverse_cdf_reaches_every_token_of_a_long_tail():
    """A 262,144-token distribution with a few likely tokens and a long tail (an LM's shape): the uniform at the
    middle of each token's interval of the cumulative mass draws that very token, the least likely included
    (a float32 cumulative sum, or uniforms of 24 bits, leave much of such a tail unreachable), and the largest
    uniform never draws a token of probability zero."""
    V = 262144
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g) * 2.5
    logits[torch.randperm(V, generator=g)[:5]] += 12
    logits[-7:] = float("-inf")                                             # zero mass at the end
    p = to_probs(logits[None, None], BatchSampling.of([SamplingParams(1.0)]))[0, 0]   # [V] float32
    live = torch.nonzero(p > 0)[:, 0]
    p64 = p.double()
    cdf = p64.cumsum(0)
    mid = (cdf - p64 / 2) / cdf[-1]
    u = torch.floor(mid * 2.0 ** 53) * 2.0 ** -53                          # on the grid position_uniforms draws
    assert torch.equal(sample(p, u[live]), live)
    assert int(sample(p, torch.tensor([1 - 2.0 ** -53], dtype=torch.float64))) == int(live[-1])


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)          # torch splits a lone row's reduction across threads, not a batch's rows
    yield
    torch.set_num_threads(threads)


def test_the_transform_is_row_invariant_at_a_real_vocabulary_on_two_threads(two_threads):
    """Bit for bit: a row of plain decoding ([1, 1, V]) and the same row in a verification forward or a batch
    ([B, T, V]), at smollm2's vocabulary, with top-p rows (their renormalisation sums a whole row)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 49152, generator=g) * 3
    params = [SamplingParams(1.0, 0, 0.95), SamplingParams(0.7, 40, 0.9), SamplingParams(1.0, 0, 0.5)]
    batch = to_probs(logits, BatchSampling.of(params))
    for b, sp in enumerate(params):
        for t in range(5):
            assert torch.equal(to_probs(logits[b:b + 1, t:t + 1], BatchSampling.of([sp]))[0, 0], batch[b, t]), (sp, t)


def test_the_residual_is_row_invariant_at_a_real_vocabulary_on_two_threads(two_threads):
    """A sampled draft's recovered token does not depend on its batch-mates."""
    from specdec.verify import residual

    g = torch.Generator().manual_seed(1)
    s = BatchSampling.of([SamplingParams(1.0)] * 3)
    for _ in range(10):
        p = to_probs(torch.randn(3, 1, 49152, generator=g), s)[:, 0]
        q = to_probs(torch.randn(3, 1, 49152, generator=g), s)[:, 0]
        assert torch.equal(residual(p[:1], q[:1])[0], residual(p, q)[0])


def test_position_uniforms_are_a_fixed_function_of_seed_stream_and_position():
    """Pinned values (uniforms are multiples of 2**-53; their top 24 bits pinned, and the whole of the first
    column): the same on every machine and device."""
    seeds = seed_tensor([0, 12345, -1, 2 ** 64 + 5])
    pos = torch.tensor([[0, 1, 1000]] * 4)
    pinned = {Stream.TARGET: [[16113010, 8154846, 3700396], [14429567, 2812827, 8284045],
                              [1996116, 10732072, 14677484], [804047, 7244488, 10640704]],
              Stream.ACCEPT: [[10877906, 13599118, 3723468], [5878427, 1109754, 13096593],
                              [7587889, 3436946, 4267941], [13759239, 14402131, 9375383]],
              Stream.DRAFT: [[14882988, 612396, 10081875], [4154511, 515608, 15332784],
                             [8253871, 4652974, 12592947], [1424048, 12756690, 10852649]]}
    whole = {Stream.TARGET: [8650606541436692, 7746814959950593, 1071656643035291, 431669664793209],
             Stream.ACCEPT: [5840031822642871, 3155956843306937, 4073717304280756, 7386935286827579],
             Stream.DRAFT: [7990243349904502, 2230436157421767, 4431263618037849, 764530024732162]}
    for stream, want in pinned.items():
        u = position_uniforms(seeds, pos, stream)
        assert u.dtype == torch.float64 and u.shape == (4, 3)
        bits = (u * 2 ** 53).long()
        assert torch.equal(bits.double() * 2.0 ** -53, u)                  # exactly on the grid
        assert (bits >> 29).tolist() == want and bits[:, 0].tolist() == whole[stream], stream
    assert seed_tensor([2 ** 64 + 5, 5, -1, 2 ** 64 - 1]).tolist() == [5, 5, -1, -1]    # seeds modulo 2**64


def test_position_uniforms_of_a_few_positions_have_the_bits_of_the_vectorised_hash(monkeypatch):
    """A step's few uniforms are hashed in Python integers, many in numpy's uint64: the same bits, extremes of
    seeds and positions included, whatever the shape."""
    import specdec.sampling as sampling

    g = torch.Generator().manual_seed(4)
    extremes = torch.tensor([0, 1, 2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1])
    for B, n in ((1, 1), (3, 5), (2, 0), (0, 3), (4, 16), (8, 8)):
        seeds = torch.randint(-2 ** 63, 2 ** 63 - 1, (B,), generator=g)
        seeds[:min(B, 2)] = torch.tensor([-1, 2 ** 63 - 1])[:min(B, 2)]
        pos = torch.randint(0, 10 ** 6, (B, n), generator=g)
        pos.view(-1)[:min(B * n, 5)] = extremes[:min(B * n, 5)]
        for stream in Stream:
            few = position_uniforms(seeds, pos, stream)
            monkeypatch.setattr(sampling, "FEW_UNIFORMS", -1)
            many = position_uniforms(seeds, pos, stream)
            monkeypatch.undo()
            assert few.dtype == many.dtype == torch.float64 and few.shape == many.shape == (B, n)
            assert torch.equal(few, many), (B, n, stream)


def test_position_uniforms_do_not_depend_on_what_else_is_asked():
    """A (seed, position) pair gets its uniform whatever the other rows, columns and call order."""
    seeds = seed_tensor([3, 99, 3])
    pos = torch.tensor([[5, 6, 7], [0, 5, 9], [7, 5, 6]])
    u = position_uniforms(seeds, pos, Stream.TARGET)
    assert u[0, 0] == u[2, 1] and u[0, 1] == u[2, 2] and u[0, 2] == u[2, 0]
    alone = position_uniforms(seeds[1:2], torch.tensor([[9]]), Stream.TARGET)
    assert alone[0, 0] == u[1, 2]


def test_position_uniforms_are_uniform_and_independent_across_seeds_positions_and_streams():
    n_seeds, n_pos = 4000, 25
    seeds = seed_tensor(list(range(n_seeds)))                              # consecutive seeds, positions
    pos = torch.arange(n_pos).expand(n_seeds, n_pos)
    streams = [position_uniforms(seeds, pos, s).double().numpy() for s in Stream]
    for u in streams:
        assert u.min() >= 0 and u.max() < 1
        counts = np.bincount((u * 20).astype(int).ravel(), minlength=20)
        assert chi2_pvalue(counts, np.full(20, 1 / 20), u.size) > 1e-3
        pairs = np.bincount(((u[:, :-1] * 8).astype(int) * 8 + (u[:, 1:] * 8).astype(int)).ravel(), minlength=64)
        assert chi2_pvalue(pairs, np.full(64, 1 / 64), pairs.sum()) > 1e-3       # neighbouring positions
        assert abs(np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]) < 0.01     # neighbouring seeds
    for a in range(3):
        for b in range(a + 1, 3):
            assert abs(np.corrcoef(streams[a].ravel(), streams[b].ravel())[0, 1]) < 0.01


def test_derived_seeds_differ_per_index_and_step_seeds_per_start():
    assert len({derive_seed(7, i) for i in range(1000)}) == 1000
    assert all(0 <= derive_seed(s, i) < 2 ** 62 for s in (0, -1, 2 ** 70) for i in range(5))
    assert derive_seed(7, 0) != derive_seed(8, 0)
    seeds = seed_tensor([1, 1, 2])
    steps = step_seeds(seeds, torch.tensor([10, 11, 10]))
    assert len(set(steps.tolist()) | set(seeds.tolist())) == 5


def test_inverse_cdf_never_picks_a_token_without_mass():
    u = torch.tensor([0.0, 0.5, 1 - 2 ** -24])
    for total in (1e-3, 0.3, 1.0, 1.5, 3.3):
        probs = (torch.tensor([0.0, 0.4, 0.0, 0.6, 0.0, 0.0]) * total).expand(3, 6)
        assert sample(probs, u).tolist() == [1, 3, 3]


def test_argmax_is_torchs_first_index_of_the_largest():
    """numpy's vectorised argmax stands in for torch's on float32 CPU rows: the same index on ties, infinities and
    NaN (the first NaN wins), for any leading shape; other dtypes go to torch."""
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1., 3., nan, 3., nan], [-inf] * 5, [2., 5., 5., inf, inf], [0., -0., 0., 1., 1.],
                         [-1., -1., -1., -1., -1.]])
    assert torch.equal(sampling_module.argmax(rows), rows.argmax(-1))
    logits = torch.randn(3, 4, 49152, generator=torch.Generator().manual_seed(3))
    logits[1, 2, 7] = logits[1, 2, 9] = logits[1, 2].max() + 1                 # a tie: the first index
    got = sampling_module.argmax(logits)
    assert got.dtype == torch.long and got.shape == (3, 4) and torch.equal(got, logits.argmax(-1))
    assert int(got[1, 2]) == 7
    assert torch.equal(sampling_module.argmax(logits[:, 1:3, ::2]), logits[:, 1:3, ::2].argmax(-1))   # strided
    assert torch.equal(sampling_module.argmax(logits[0, 0]), logits[0, 0].argmax(-1))
    half = logits.bfloat16()
    assert torch.equal(sampling_module.argmax(half), half.argmax(-1))
