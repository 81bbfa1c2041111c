"""How many tokens to draft next step.

- `fixed`: always K.
- `heuristic`: the well-known +2 when every draft was accepted, -1 otherwise.
- `auto` (ours): pick the K that maximises expected committed tokens per second for the
  batch at hand, B * E[tokens](k) / (c_draft(k) + c_target(B * (k + 1))), from the measured
  conditional acceptance at each draft position and linear fits of the cost of drafting against
  the tokens drafted and of the target forward's cost against the rows it scores. K = 0 (a plain step)
  is a candidate: when a large batch makes the target compute-bound, speculation stops paying
  and `auto` stops drafting (vLLM's "disable by batch size", but measured, not configured).
  It adapts to the proposer, the prompt, the batch and the machine. Until it has measured what
  drafting costs, it probes with one or two drafts (a draft model that reads the prompt first and
  turns out too slow to pay then costs a few steps, not K drafts each), and while plain steps win it
  still drafts now and then, so that a prompt where drafts start to be accepted is noticed.
"""
from __future__ import annotations

import numbers

from typing import Callable, Protocol

from torch import Tensor

from .errors import SpecdecError

MAX_DRAFT_TOKENS = 64


class DraftPolicy(Protocol):
    def choose(self, batch: int, remaining: int) -> int:
        """Drafts per sequence for the next step of a batch of `batch` sequences whose longest may still
        write `remaining` tokens (0: a plain step)."""
        ...

    def observe(self, batch: int, k: int, valid: Tensor, accepted: Tensor, draft_s: float, target_s: float, *,
                asked: int) -> None:
        """The step's outcome: k drafts per sequence scored, valid [B] drafts offered, accepted [B], seconds drafting
        and verifying; `asked`: the drafts the step asked its proposer for (more than k where it drafted fewer)."""
        ...


class Fixed:
    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, batch: int, remaining: int) -> int:
        return self.k

    def observe(self, batch: int, k: int, valid: Tensor, accepted: Tensor, draft_s: float, target_s: float, *,
                asked: int) -> None:
        pass


class Heuristic:
    def __init__(self, k: int, k_max: int) -> None:
        self.k, self.k_max = k, k_max

    def choose(self, batch: int, remaining: int) -> int:
        return self.k

    def observe(self, batch: int, k: int, valid: Tensor, accepted: Tensor, draft_s: float, target_s: float, *,
                asked: int) -> None:
        if k == 0:
            return
        self.k = min(self.k_max, k + 2) if bool((accepted >= k).all()) else max(1, k - 1)


def line(points: dict[int, float], x: int, prior_overhead: float) -> float:
    """A least-squares line through measured (x, seconds) points, evaluated at x (slope >= 0); one point
    is scaled by (prior_overhead + x) / (prior_overhead + x0); none gives the prior in relative units."""
    pts = sorted(points.items())
    if not pts:
        return prior_overhead + x
    if len(pts) == 1:
        (x0, y0), = pts
        return y0 * (prior_overhead + x) / (prior_overhead + x0)
    n = len(pts)
    mx = sum(a for a, _ in pts) / n
    my = sum(b for _, b in pts) / n
    var = sum((a - mx) ** 2 for a, _ in pts)
    slope = max(0.0, sum((a - mx) * (b - my) for a, b in pts) / var)
    return max(1e-6, my + slope * (x - mx))


class Auto:
    """The `auto` policy: argmax_k B * (1 + sum_i prod_{j<=i} alpha_j) / (c_draft(k) + c_target(B * (k + 1))),
    k in 0..k_max.

    alpha_j: conditional acceptance at draft position j (decayed counts, prior `prior`).
    c_target(rows), c_draft(k): least-squares lines through the measured (rows scored, seconds per target
    forward) and (drafts, seconds drafting) points; a forward's fixed overhead is worth OVERHEAD_ROWS rows
    until two sizes are measured, drafting's fixed part (a draft model's sync, a re-tokenization) nothing.

    Probing: the first drafting steps draft PROBE_KS tokens (the first one's cost is not taken: it carries
    one-off work, a draft catching up on the prompt, first calls). Where K = 0 wins, a step of
    PROBE_KS[-1] drafts after REPROBE plain steps, then after twice as many, and so on up to REPROBE_MAX,
    keeps the acceptance estimate fresh (only drafting measures it) at a bounded price; its cost is not
    taken either, for it includes the catch-up over the plain steps. No re-probe where fewer than REPROBE
    tokens are left to write: drafting found then could not pay for the probe.

    Declines: a proposer may draft nothing although asked (an EAGLE chain whose first draft falls below its
    confidence cut, prompt lookup without a match), after paying for it (the head's catch-up and step). The share
    of asking steps that drafted nothing (decayed counts, prior 0) and what such a step's proposing cost weigh
    every k > 0: E[tokens] and E[seconds] mix a declined step's one token and cost with a drafting step's. A decline
    teaches no acceptance (nothing was offered) and is not a plain step.

    Ageing: a policy outlives requests (a server's engine serves one after another), and acceptance is the
    requests' own (a repetitive edit, a free-form answer at temperature 1). Every plain step moves the
    acceptance estimates a little back toward the prior (PLAIN_DECAY), so what low acceptance taught under
    one load does not keep later requests from drafting: where drafting still does not pay, the few
    drafting steps that the returned estimate allows measure it again.
    """

    OVERHEAD_ROWS = 16.0            # prior; measured here: 1 row 19 ms, 17 rows 41 ms -> ~13 rows
    PROBE_KS = (1, 2)               # drafts of the first drafting steps (the first one absorbs one-off costs)
    REPROBE = 32                    # plain steps between probes while K = 0 wins
    REPROBE_MAX = 512               # ... doubling per probe up to this many
    PLAIN_DECAY = 0.99              # per plain step, the acceptance counts' weight against the prior's
    PRIOR_COUNT = 2.0               # the prior's weight in pseudo-counts

    def __init__(self, k: int, k_max: int, prior: float = 0.6, decay: float = 0.98) -> None:
        self.k, self.k_max, self.decay = k, k_max, decay
        self.prior = prior
        self.tried = [self.PRIOR_COUNT] * k_max     # pseudo-counts: conditional acceptance per position
        self.hit = [self.PRIOR_COUNT * prior] * k_max
        self.c_draft: dict[int, float] = {}         # drafts -> seconds drafting (whole batch)
        self.c_target: dict[int, float] = {}        # rows scored -> seconds per target forward
        self.draft_steps = 0                        # drafting steps observed
        self.plain_run = 0                          # plain steps since the last drafting step
        self.reprobe = self.REPROBE                 # plain steps before the next probe (doubles per probe)
        self.asks = self.PRIOR_COUNT                # steps that asked for drafts (decayed; the prior's weight) ...
        self.declines = 0.0                         # ... and those among them that got none
        self.c_decline = 0.0                        # seconds proposing in a declined step (0 until measured)

    def target_cost(self, rows: int) -> float:
        """Predicted seconds of a target forward over `rows` token rows (relative units before any data)."""
        return line(self.c_target, rows, self.OVERHEAD_ROWS)

    def draft_cost(self, k: int) -> float:
        """Predicted seconds of drafting k tokens (0 before any measurement)."""
        return 0.0 if k == 0 or not self.c_draft else line(self.c_draft, k, 0.0)

    def expected_tokens(self, k: int) -> float:
        """E[tokens committed per sequence] with k drafts: 1 + sum_i prod_{j<=i} alpha_j."""
        expect, reach = 1.0, 1.0
        for i in range(k):
            reach *= self.hit[i] / self.tried[i]
            expect += reach
        return expect

    def _best(self, batch: int, draft_cost: Callable[[int], float]) -> int:
        d = self.declines / self.asks                                        # P(an asking step drafts nothing)
        plain = self.target_cost(batch)
        declined = self.c_decline + plain

        def rate(k: int) -> float:
            if k == 0:
                return batch / plain
            drafted = draft_cost(k) + self.target_cost(batch * (k + 1))
            return batch * ((1 - d) * self.expected_tokens(k) + d) / ((1 - d) * drafted + d * declined)

        rates = [rate(k) for k in range(self.k_max + 1)]
        return max(range(self.k_max + 1), key=lambda k: (rates[k], -k))

    def choose(self, batch: int, remaining: int) -> int:
        if self.draft_steps < len(self.PROBE_KS):   # drafting's cost is not fully known: probe, unless drafts
            least = min(self.c_draft.values(), default=0.0)         # costing the least measured cannot pay
            self.k = min(self._best(batch, lambda k: least if k else 0.0), self.PROBE_KS[self.draft_steps])
        else:
            self.k = self._best(batch, self.draft_cost)
            if self.k:
                self.reprobe = self.REPROBE
        if self.k == 0 and self.plain_run >= self.reprobe and remaining >= self.REPROBE:
            self.k = min(self.k_max, self.PROBE_KS[-1])
            self.reprobe = min(2 * self.reprobe, self.REPROBE_MAX)   # back off while probes find nothing
        return self.k

    def observe(self, batch: int, k: int, valid: Tensor, accepted: Tensor, draft_s: float, target_s: float, *,
                asked: int) -> None:
        rows = batch * (k + 1)
        old = self.c_target.get(rows)
        self.c_target[rows] = target_s if old is None else 0.8 * old + 0.2 * target_s
        if asked == 0:                               # a plain step
            self.plain_run += 1
            d, n = self.PLAIN_DECAY, self.PRIOR_COUNT                   # age the estimates toward the prior
            self.tried = [t * d + (1 - d) * n for t in self.tried]
            self.hit = [h * d + (1 - d) * n * self.prior for h in self.hit]
            self.asks = self.asks * d + (1 - d) * n
            self.declines = self.declines * d
            return
        declined = k == 0                            # proposing cost, nothing offered
        self.asks = self.asks * self.decay + 1.0
        self.declines = self.declines * self.decay + float(declined)
        if declined:
            if self.plain_run == 0:                  # (after plain steps it carries a catch-up over them)
                self.c_decline = 0.8 * self.c_decline + 0.2 * draft_s if self.c_decline else draft_s
            self.plain_run = 0
            return
        for v, a in zip(valid.tolist(), accepted.tolist()):
            for i in range(min(v, a + 1)):           # positions reached
                self.tried[i] = self.tried[i] * self.decay + 1.0
                self.hit[i] = self.hit[i] * self.decay + (1.0 if i < a else 0.0)
        self.draft_steps += 1
        if self.draft_steps > 1 and self.plain_run == 0:       # a step with one-off costs teaches no cost
            old = self.c_draft.get(k)
            self.c_draft[k] = draft_s if old is None else 0.8 * old + 0.2 * draft_s
        self.plain_run = 0


POLICY_BUILDERS: dict[str, Callable[[int], DraftPolicy]] = {
    "fixed": Fixed,
    "heuristic": lambda k: Heuristic(k, k_max=min(MAX_DRAFT_TOKENS, 2 * k + 4)),
    "auto": lambda k: Auto(k, k_max=min(MAX_DRAFT_TOKENS, max(2 * k, 8))),
}
POLICIES = tuple(POLICY_BUILDERS)


def make_policy(name: str, k: int) -> DraftPolicy:
    if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1 or k > MAX_DRAFT_TOKENS:
        raise SpecdecError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
    build = POLICY_BUILDERS.get(name)
    if build is None:
        raise SpecdecError(f"unknown draft policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return build(int(k))
