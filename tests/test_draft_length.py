"""Draft-length policies: the cost-aware choice of K (incl. K = 0 for big batches) and losslessness
when plain and speculative steps mix."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.draft_length import Auto
from specdec.engine import Engine, Request
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.hybrid import HybridProposer
from specdec.proposers.medusa import MedusaProposer
from specdec.proposers.ngram import NgramProposer
from specdec.reference import reference_greedy

from helpers import PROMPTS, head_for, heads_for, tiny_model


def trained(policy: Auto, alpha: float, cost, batches=(1, 8), steps: int = 40) -> Auto:
    """Feed `policy` steps at each batch size: every 4th step tries the next K in turn, the others
    take the K it picks; each draft position is accepted with probability alpha (seeded) and a
    target forward over `rows` rows takes cost(rows) seconds."""
    rng = random.Random(0)
    for b in batches:
        for step in range(steps):
            k = policy.choose(b, 1000) if step % 4 else step // 4 % (policy.k_max + 1)
            accepted = []
            for _ in range(b):
                n = 0
                while n < k and rng.random() < alpha:
                    n += 1
                accepted.append(n)
            policy.observe(b, k, torch.full((b,), k), torch.tensor(accepted), 1e-5 * k, cost(b * (k + 1)), asked=k)
    return policy


def test_cost_aware_drafts_long_when_forwards_are_overhead_bound():
    p = trained(Auto(4, 8), alpha=0.9, cost=lambda rows: 0.020 + 0.0001 * rows)
    assert p.choose(1, 1000) >= 4
    assert p.choose(8, 1000) >= 4


def test_cost_aware_stops_drafting_when_the_batch_is_compute_bound():
    """Cost proportional to rows: extra rows cost as much as the tokens they may save, so K=0 wins."""
    p = trained(Auto(4, 8), alpha=0.5, cost=lambda rows: 0.001 + 0.002 * rows)
    assert p.choose(16, 1000) == 0
    q = trained(Auto(4, 8), alpha=0.5, cost=lambda rows: 0.020 + 0.0005 * rows)
    assert q.choose(1, 1000) > 0 and q.choose(64, 1000) == 0                               # same machine, bigger batch


def test_cost_aware_prior_before_any_measurement_probes_with_one_draft():
    one = torch.ones(1, dtype=torch.long)
    p = Auto(4, 8)
    assert p.choose(1, 1000) == 1
    assert p.target_cost(40) > p.target_cost(8) > 0
    p.observe(1, 1, one, one, 0.5, 0.02, asked=1)   # the first drafting step: one-off costs (a draft's catch-up)
    assert p.choose(1, 1000) == 2                         # ... are not the cost of drafting: probe again
    p.observe(1, 2, 2 * one, 2 * one, 2e-5, 0.02, asked=2)  # cheap drafts, accepted
    assert p.choose(1, 1000) > 2
    q = Auto(4, 8)
    q.observe(1, 1, one, 0 * one, 0.5, 0.02, asked=1)
    q.observe(1, 2, 2 * one, 0 * one, 0.1, 0.02, asked=2)  # a draft costs 2.5 target forwards
    assert q.choose(1, 1000) == 0


def test_a_fixed_drafting_cost_is_told_from_a_per_token_one():
    """Drafting k tokens costing 30 ms + 1 ms per token (a draft's sync, then cheap steps) favours long drafts
    once two sizes are measured; before, 32 ms for two drafts counts as 16 ms each."""
    p = Auto(4, 8, prior=0.9)
    one = torch.ones(1, dtype=torch.long)
    for k in (1, 2):
        assert p.choose(1, 1000) == k
        p.observe(1, k, k * one, k * one, 0.030 + 0.001 * k, 0.050, asked=k)
    assert p.draft_cost(4) == pytest.approx(0.064)
    p.observe(1, 3, 3 * one, 3 * one, 0.033, 0.050, asked=3)
    assert p.draft_cost(6) == pytest.approx(0.036)
    assert p.choose(1, 1000) >= 4


def test_while_plain_steps_win_it_still_probes_now_and_then():
    p = Auto(4, 8)
    one = torch.ones(1, dtype=torch.long)
    for k in (1, 2):
        assert p.choose(1, 1000) == k
        p.observe(1, k, k * one, 0 * one, 0.2, 0.05, asked=k)                     # costly drafts, all rejected
    ks = []
    for _ in range(7 * Auto.REPROBE + 3):
        ks.append(p.choose(1, 1000))
        p.observe(1, ks[-1], ks[-1] * one, 0 * one, 0.3 if ks[-1] else 0.0, 0.05, asked=ks[-1])
    probes = [i for i, k in enumerate(ks) if k]                              # after 32, 64, 128 plain steps
    assert probes == [Auto.REPROBE, 3 * Auto.REPROBE + 1, 7 * Auto.REPROBE + 2]
    assert p.draft_cost(2) == pytest.approx(0.2)     # a probe after plain steps (0.3 s, with the catch-up)
                                                      # teaches no cost
    late = Auto(k=4, k_max=8)                                                # the same, near the end of the output
    for k in (1, 2):
        late.choose(1, 1000)
        late.observe(1, k, k * one, 0 * one, 0.2, 0.05, asked=k)
    assert not any(late.choose(1, Auto.REPROBE - 1) or late.observe(1, 0, 0 * one, 0 * one, 0.0, 0.05, asked=0)
                   for _ in range(3 * Auto.REPROBE))                         # no re-probe that could not pay


class Alternating:
    """A scripted policy: plain steps (K = 0) between speculative ones of varying K."""

    def __init__(self, ks: list[int]) -> None:
        self.ks, self.i = ks, 0

    def choose(self, batch: int, remaining: int) -> int:
        self.i += 1
        return self.ks[self.i % len(self.ks)]

    def observe(self, batch, k, valid, accepted, draft_s, target_s, *, asked) -> None:
        pass


@pytest.mark.parametrize("method", ["draft", "ngram", "eagle", "medusa", "hybrid"])
def test_greedy_equals_plain_when_plain_and_speculative_steps_mix(method):
    """`auto` may choose K = 0 between speculative steps: the target stays exact, proposers stay in step."""
    target = tiny_model(seed=8)
    if method == "draft":
        draft = tiny_model(seed=8, layers=1)
        draft.load_state_dict({n: p for n, p in target.state_dict().items() if not n.startswith("layers.1.")})
        prop = DraftModelProposer(draft)
    elif method == "ngram":
        prop = NgramProposer(1, 3)
    elif method == "eagle":
        prop = EagleProposer(head_for(target), 2, 3, 6)
    elif method == "hybrid":
        prop = HybridProposer(EagleProposer(head_for(target), 1, 4, 4), NgramProposer(1, 3), 2)
    else:
        prop = MedusaProposer(heads_for(target, 3))
    eng = Engine(target, prop, Alternating([0, 3, 0, 0, 2, 4, 1, 0]), lambda ids: "", frozenset())
    eng.allocate(len(PROMPTS), max(map(len, PROMPTS)) + 40)
    seqs = [eng.add(Request(list(p), 25)) for p in PROMPTS]
    fed: dict[int, int] = {}
    with torch.inference_mode():
        while eng.busy:
            eng.step()
            if method == "draft":                  # the draft's cache only grows: a plain step rolls nothing back
                for s in seqs:
                    assert prop.fed.get(s.row, 0) >= fed.get(s.row, 0), "draft cache rolled back on a plain step"
                    fed[s.row] = prop.fed.get(s.row, 0)
    for p, s in zip(PROMPTS, seqs):
        assert s.generated == reference_greedy(target, p, 25)
    assert sum(s.counters.drafted for s in seqs) > 0


def test_what_low_acceptance_taught_ages():
    """A server's policy outlives requests: after a long run of rejected drafts (K = 0 wins) a later request
    whose drafts are accepted must get drafting back (plain steps age the estimates toward the prior; probes
    alone, each one observation among decayed counts of about 50, took thousands of steps)."""
    one = torch.ones(1, dtype=torch.long)
    p = Auto(4, 8)
    for _ in range(200):                                                     # a long run of rejected drafts
        p.choose(1, 1000)
        p.observe(1, 2, 2 * one, 0 * one, 0.02, 0.053, asked=2)
    for _ in range(2000):                                                    # then the policy's own choice
        k = p.choose(1, 1000)
        p.observe(1, k, k * one, 0 * one, 0.01 * k, 0.05 + 0.001 * k, asked=k)
    assert p.choose(1, 1000) == 0
    ks = []
    for _ in range(1000):                                                    # now every draft is accepted
        ks.append(p.choose(1, 1000))
        p.observe(1, ks[-1], ks[-1] * one, ks[-1] * one, 0.01 * ks[-1], 0.05 + 0.001 * ks[-1], asked=ks[-1])
    assert sum(k > 0 for k in ks[-100:]) == 100 and ks[-1] >= 2               # drafting again


def test_the_probes_back_off_stops_doubling():
    """Where drafting stays too costly, a probe still comes at least every REPROBE_MAX plain steps."""
    one = torch.ones(1, dtype=torch.long)
    costly = Auto(4, 8)
    for _ in range(40 * Auto.REPROBE_MAX):                                   # drafts cost 4 forwards: never pay
        k = costly.choose(1, 100_000)
        costly.observe(1, k, k * one, 0 * one, 0.2 if k else 0.0, 0.05, asked=k)
    gaps, last = [], 0
    for i in range(8 * Auto.REPROBE_MAX):
        if costly.choose(1, 100_000):
            gaps.append(i - last)
            last = i
        costly.observe(1, costly.k, costly.k * one, 0 * one, 0.2 if costly.k else 0.0, 0.05, asked=costly.k)
    assert len(gaps) >= 7 and max(gaps) <= Auto.REPROBE_MAX + 1


@pytest.mark.parametrize("decline_cost, drafting", [(0.007, False), (0.00005, True)])
def test_a_proposer_that_often_drafts_nothing_is_asked_only_where_asking_pays(decline_cost, drafting):
    """A proposer that drafts nothing in 70% of the steps that ask it (an EAGLE chain below its confidence cut,
    prompt lookup without a match) and is accepted at 0.7 where it drafts (a plain step 14 ms, a drafting step
    19 ms and 3 ms of drafting): asking pays where drafting nothing costs nothing, and does not where each
    decline costs half a plain step (declines counted as plain steps had kept it asking)."""
    one, none = torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    rng = random.Random(3)
    p, asked = Auto(4, 8), []
    for _ in range(600):
        k = p.choose(1, 1000)
        asked.append(k > 0)
        if k == 0:
            p.observe(1, 0, none, none, 0.0, 0.014, asked=0)
        elif rng.random() < 0.7:                                             # declined: nothing drafted
            p.observe(1, 0, none, none, decline_cost, 0.014, asked=k)
        else:
            n = next((i for i in range(k) if rng.random() >= 0.7), k)       # accepted drafts
            p.observe(1, k, k * one, n * one, 0.003 * k, 0.014 + 0.005 * k, asked=k)
    share = sum(asked[-300:]) / 300
    assert share > 0.9 if drafting else share < 0.1


def test_a_long_catch_up_starts_the_heads_cache_afresh_on_its_last_window(monkeypatch):
    """Where more pairs wait than CATCH_UP_WINDOW (a prompt, a run of plain steps), the head's cache holds only
    the last window after catching up, drafts still happen and the output stays the target's, batched."""
    import specdec.proposers.eagle as eagle_mod

    monkeypatch.setattr(eagle_mod, "CATCH_UP_WINDOW", 3)
    target = tiny_model(seed=8)
    prop = EagleProposer(head_for(target), 1, 4, 4)
    seen = []
    catch_up = prop._catch_up

    def watched(rows):
        waiting = {r: len(prop.unfed[r][0]) for r in rows.tolist() if r in prop.unfed}
        before = prop.cache.lengths[rows].tolist()
        catch_up(rows)
        seen.extend((n, b, int(prop.cache.lengths[r])) for (r, n), b in zip(waiting.items(), before))
    prop._catch_up = watched
    eng = Engine(target, prop, Alternating([0, 0, 0, 0, 2, 4, 1, 0, 0, 0, 0, 0, 3]), lambda ids: "", frozenset())
    eng.allocate(len(PROMPTS), max(map(len, PROMPTS)) + 40)
    seqs = [eng.add(Request(list(p), 25)) for p in PROMPTS]
    with torch.inference_mode():
        while eng.busy:
            eng.step()
    for p, s in zip(PROMPTS, seqs):
        assert s.generated == reference_greedy(target, p, 25)
    assert sum(s.counters.drafted for s in seqs) > 0
    assert any(n > 3 for n, _, _ in seen) and any(n <= 3 and b > 0 for n, b, _ in seen)
    assert all(after == (3 if n > 3 else b + n) for n, b, after in seen)
