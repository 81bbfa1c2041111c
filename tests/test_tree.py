"""Token-tree verification: masks, greedy longest-path equality, exact distributions (chi-square)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specdec.reference import reference_greedy
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree, chain_tree
from specdec.verify import Draft, verify_tree

from helpers import PROMPTS, V, check_joint, chi2_pvalue, exact_joint, rng, sample_engine, tiny_generator, tiny_model

SHAPE = [-1, 0, 0, 0, 1, 1, 2, 4]          # parents: root, 3 children, grandchildren, a depth-3 node


def test_mask_and_depth():
    t = TokenTree(torch.tensor([[5, 1, 2, 3, 4, 6, 7, 8]]), torch.tensor([SHAPE]))
    assert t.depth().tolist() == [[0, 1, 1, 1, 2, 2, 2, 3]]
    m = t.mask()[0]
    assert m[7].nonzero().flatten().tolist() == [0, 1, 4, 7]
    assert m[3].nonzero().flatten().tolist() == [0, 3]
    c = chain_tree(torch.tensor([9]), torch.tensor([[1, 2, -1]]))
    assert c.parents.tolist() == [[-1, 0, 1, -1]] and c.depth().tolist() == [[0, 1, 2, 0]]


def test_tree_verifier_distribution_is_exact():
    """Emitted (first, second) tokens follow p_root(x) * p_x(y) for tree children x, p_root(x) otherwise."""
    Vv, N = 6, 20_000
    g = rng(0)
    tokens = torch.tensor([[0, 2, 4, 1, 3]])                  # root, children 2, 4, 1; node 4 (token 3) under node 1
    parents = torch.tensor([[-1, 0, 0, 0, 1]])
    p = torch.softmax(torch.randn(1, 5, Vv, generator=g) * 1.5, -1)
    tree = TokenTree(tokens.expand(N, 5), parents.expand(N, 5))
    u = torch.rand(N, 3, generator=g)[:, tree.depth()[0]]    # one uniform per depth (position), as the engine
    v = verify_tree(tree, p.expand(N, 5, Vv), u)
    child_node = {2: 1, 4: 2, 1: 3}
    exact, keys = [], []
    for x in range(Vv):
        if x in child_node:
            for y in range(Vv):
                keys.append((x, y))
                exact.append(float(p[0, 0, x] * p[0, child_node[x], y]))
        else:
            keys.append((x, -1))
            exact.append(float(p[0, 0, x]))
    idx = {k: i for i, k in enumerate(keys)}
    got = [idx[(int(a), int(b))] for a, b in zip(v.tokens[:, 0], v.tokens[:, 1])]
    assert chi2_pvalue(np.bincount(got, minlength=len(keys)), np.array(exact), N) > 1e-3
    # the committed path: the accepted child's node index follows the root
    acc = v.num_accepted == 1
    assert all(int(v.path[i, 1]) == child_node[int(v.tokens[i, 0])] for i in torch.nonzero(acc).flatten()[:200])


class TreeOracle:
    """A fixed-shape tree: one branch follows the oracle continuation (optionally corrupted), siblings are random."""
    name = "tree-oracle"
    feature_layers: tuple[int, ...] = ()

    def __init__(self, truth, vocab, corrupt=0.0, seed=0):
        self.truth, self.vocab, self.corrupt = truth, vocab, corrupt
        self.rng = random.Random(seed)

    def allocate(self, rows, slots):
        self.prompt = {}

    def start(self, rows, prompts, hidden):
        for r, p in zip(rows.tolist(), prompts):
            self.prompt[r] = tuple(p[:-1])

    def propose(self, batch, k):
        B = len(batch.tokens)
        toks = torch.full((B, len(SHAPE)), -1, dtype=torch.long)
        for i, (r, hist) in enumerate(zip(batch.rows.tolist(), batch.tokens)):
            n = len(hist) - len(self.prompt[r])
            cont = self.truth[self.prompt[r]][n:n + 3] + [0, 0, 0]
            toks[i, 0] = hist[-1]
            for node in range(1, len(SHAPE)):
                toks[i, node] = self.rng.randrange(self.vocab)
            on_path = [3, 4, 7][: 3]                                   # node 3 -> 4 -> 7 is a depth-1..3 chain
            for d, node in enumerate(on_path):
                if self.rng.random() >= self.corrupt:
                    toks[i, node] = cont[d]
        parents = torch.tensor(SHAPE).expand(B, len(SHAPE)).clone()
        parents[:, 4], parents[:, 7] = 3, 4                            # make the oracle chain 3 -> 4 -> 7
        return Draft(toks[:, 1:], parents=parents[:, 1:] - 1)          # node i + 1 is draft i; root: ROOT

    def commit(self, batch, verdict, hidden):
        pass


@pytest.mark.parametrize("corrupt", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("batch", [1, 3])
def test_tree_greedy_equals_plain(corrupt, batch):
    model = tiny_model(seed=7)
    prompts = PROMPTS[:batch]
    truth = {tuple(p): reference_greedy(model, p, 60) for p in prompts}
    gen = tiny_generator(model, TreeOracle(truth, 97, corrupt), "fixed", 4)
    for p, r in zip(prompts, gen.generate(prompts, max_new_tokens=30)):
        assert r.tokens == truth[tuple(p)][:30]
        if corrupt == 0.0:
            assert r.metrics["tau"] > 3.0                         # the oracle branch is always accepted


class RandomTree:
    """Deterministic random candidates in a fixed shape: lossless whatever they are."""
    name = "random-tree"
    feature_layers: tuple[int, ...] = ()

    def __init__(self, vocab):
        self.vocab = vocab
        self.g = torch.Generator().manual_seed(0)

    def allocate(self, rows, slots):
        pass

    def start(self, rows, prompts, hidden):
        pass

    def propose(self, batch, k):
        B = len(batch.tokens)
        toks = torch.randint(0, self.vocab, (B, len(SHAPE)), generator=self.g)
        toks[:, 0] = torch.tensor([t[-1] for t in batch.tokens])
        return Draft(toks[:, 1:], parents=torch.tensor(SHAPE[1:]).expand(B, len(SHAPE) - 1) - 1)

    def commit(self, batch, verdict, hidden):
        pass


@pytest.mark.slow        # 20,000 sequences: `make test`; fast loop: test_seeds.py (plain sampling's tokens)
@pytest.mark.parametrize("params", [SamplingParams(0.7, 5, 0.9), SamplingParams(1.0, 6, 0.95)], ids=["t0.7", "t1.0"])
def test_tree_sampling_matches_exact_distribution(params):
    target = tiny_model(seed=20, vocab=V, std=0.5)
    prompt = [1, 2, 3]
    exact = exact_joint(target, prompt, params)
    samples = sample_engine(target, RandomTree(V), params, prompt)
    assert check_joint(samples, exact) > 1e-3


@pytest.mark.parametrize("batch", [1, 3])
def test_tree_greedy_stops_at_max_new_tokens_when_eos_lies_beyond(batch):
    """An accepted tree path may reach past max_new_tokens: nodes deeper than a row's room are cut before
    verification, so an EOS the tree would accept beyond the limit never ends the text as "stop"."""
    model = tiny_model(seed=7)
    prompts = PROMPTS[:batch]
    truth = {tuple(p): reference_greedy(model, p, 60) for p in prompts}
    first = truth[tuple(prompts[-1])]
    for j in [i for i in range(6, 40) if first[i] not in first[:i]][:6]:   # a token first seen at position j
        for n in (j - 1, j - 2, j - 3):                                      # it lies just beyond the limit
            gen = tiny_generator(model, TreeOracle(truth, 97, 0.0), "fixed", 4, eos=first[j])
            plain = tiny_generator(model, None, "fixed", 4, eos=first[j]).generate(prompts, max_new_tokens=n)
            for a, b in zip(plain, gen.generate(prompts, max_new_tokens=n)):
                assert (b.tokens, b.finish_reason) == (a.tokens, a.finish_reason), (j, n)
                assert len(b.tokens) <= n
