"""How many tokens to draft next step.

- `fixed`: always K.
- `heuristic`: the well-known +2 when every draft was accepted, -1 otherwise.
- `auto` (ours): pick the K that maximises expected committed tokens per second for the
  batch at hand, B * E[tokens](k) / (k * c_draft + c_target(B * (k + 1))), from the measured
  conditional acceptance at each draft position, the measured cost of drafting one token and
  a linear fit of the target forward's cost against the rows it scores. K = 0 (a plain step)
  is a candidate: when a large batch makes the target compute-bound, speculation stops paying
  and `auto` stops drafting (vLLM's "disable by batch size", but measured, not configured).
  It adapts to the proposer, the prompt, the batch and the machine. Until it has measured what
  drafting costs, it probes with one draft (a draft model that reads the prompt first and turns out
  too slow to pay then costs one step, not K drafts).
"""
from __future__ import annotations

from typing import Callable, Protocol

from torch import Tensor

from .errors import SpecdecError

MAX_DRAFT_TOKENS = 64


class DraftPolicy(Protocol):
    def choose(self, batch: int) -> int:
        """Drafts per sequence for the next step of a batch of `batch` sequences (0: a plain step)."""
        ...

    def observe(self, batch: int, k: int, valid: Tensor, accepted: Tensor, draft_s: float, target_s: float) -> None:
        """The step's outcome: valid [B] drafts offered, accepted [B], seconds drafting and verifying."""
        ...


class Fixed:
    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, batch: int) -> int:
        return self.k

    def observe(self, batch: int, k: int, valid: Tensor, accepted: Tensor, draft_s: float, target_s: float) -> None:
        pass


class Heuristic:
    def __init__(self, k: int, k_max: int) -> None:
        self.k, self.k_max = k, k_max

    def choose(self, batch: int) -> int:
        return self.k

    def observe(self, batch: int, k: int, valid: Tensor, accepted: Tensor, draft_s: float, target_s: float) -> None:
        if k == 0:
            return
        self.k = min(self.k_max, k + 2) if bool((accepted >= k).all()) else max(1, k - 1)


class Auto:
    """The `auto` policy: argmax_k B * (1 + sum_i prod_{j<=i} alpha_j) / (k * c_draft + c_target(B * (k + 1))),
    k in 0..k_max.

    alpha_j: conditional acceptance at draft position j (decayed counts, prior `prior`).
    c_target(rows): least-squares line through the measured (rows scored, seconds) points; with
    fewer than two distinct points, the one measured scaled by (OVERHEAD_ROWS + rows), the prior
    that a forward costs a fixed overhead worth OVERHEAD_ROWS rows plus a per-row part.
    """

    OVERHEAD_ROWS = 16.0            # prior; measured here: 1 row 19 ms, 17 rows 41 ms -> ~13 rows

    def __init__(self, k: int, k_max: int, prior: float = 0.6, decay: float = 0.98) -> None:
        self.k, self.k_max, self.decay = k, k_max, decay
        self.tried = [2.0] * k_max                  # pseudo-counts: conditional acceptance per position
        self.hit = [2.0 * prior] * k_max
        self.c_draft = 0.0                          # seconds per drafted position (whole batch)
        self.c_target: dict[int, float] = {}        # rows scored -> seconds per target forward
        self.drafted = False                        # a drafting step was observed (c_draft is measured)

    def target_cost(self, rows: int) -> float:
        """Predicted seconds of a target forward over `rows` token rows (relative units before any data)."""
        pts = sorted(self.c_target.items())
        if not pts:
            return self.OVERHEAD_ROWS + rows
        if len(pts) == 1:
            (r0, s0), = pts
            return s0 * (self.OVERHEAD_ROWS + rows) / (self.OVERHEAD_ROWS + r0)
        n = len(pts)
        mx = sum(x for x, _ in pts) / n
        my = sum(y for _, y in pts) / n
        var = sum((x - mx) ** 2 for x, _ in pts)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in pts) / var)
        return max(1e-6, my + slope * (rows - mx))

    def expected_tokens(self, k: int) -> float:
        """E[tokens committed per sequence] with k drafts: 1 + sum_i prod_{j<=i} alpha_j."""
        expect, reach = 1.0, 1.0
        for i in range(k):
            reach *= self.hit[i] / self.tried[i]
            expect += reach
        return expect

    def choose(self, batch: int) -> int:
        rates = [batch * self.expected_tokens(k) / (k * self.c_draft + self.target_cost(batch * (k + 1)))
                 for k in range(self.k_max + 1)]
        self.k = max(range(self.k_max + 1), key=lambda k: (rates[k], -k))
        if not self.drafted:
            self.k = min(self.k, 1)                 # the cost of drafting is unknown: probe with one draft
        return self.k

    def observe(self, batch: int, k: int, valid: Tensor, accepted: Tensor, draft_s: float, target_s: float) -> None:
        rows = batch * (k + 1)
        old = self.c_target.get(rows)
        self.c_target[rows] = target_s if old is None else 0.8 * old + 0.2 * target_s
        if k == 0:
            return
        for v, a in zip(valid.tolist(), accepted.tolist()):
            for i in range(min(v, a + 1)):           # positions reached
                self.tried[i] = self.tried[i] * self.decay + 1.0
                self.hit[i] = self.hit[i] * self.decay + (1.0 if i < a else 0.0)
        self.c_draft = 0.8 * self.c_draft + 0.2 * (draft_s / k) if self.drafted else draft_s / k
        self.drafted = True


POLICY_BUILDERS: dict[str, Callable[[int], DraftPolicy]] = {
    "fixed": Fixed,
    "heuristic": lambda k: Heuristic(k, k_max=min(MAX_DRAFT_TOKENS, 2 * k + 4)),
    "auto": lambda k: Auto(k, k_max=min(MAX_DRAFT_TOKENS, max(2 * k, 8))),
}
POLICIES = tuple(POLICY_BUILDERS)


def make_policy(name: str, k: int) -> DraftPolicy:
    if not isinstance(k, int) or k < 1 or k > MAX_DRAFT_TOKENS:
        raise SpecdecError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
    build = POLICY_BUILDERS.get(name)
    if build is None:
        raise SpecdecError(f"unknown draft policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return build(k)
