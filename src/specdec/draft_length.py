"""How many tokens to draft next step.

- `fixed`: always K.
- `heuristic`: the well-known +2 when every draft was accepted, -1 otherwise.
- `auto` (ours): pick the K that maximises expected committed tokens per second,
  E[tokens](k) / cost(k), from the measured conditional acceptance at each draft
  position and the measured costs of drafting one token and of a target forward
  over k+1 tokens. It adapts to the proposer, the prompt and the machine.
"""
from __future__ import annotations

from typing import Protocol

from torch import Tensor

from .errors import SpecdecError

POLICIES = ("fixed", "heuristic", "auto")
MAX_DRAFT_TOKENS = 64


class DraftPolicy(Protocol):
    def choose(self) -> int: ...
    def observe(self, k: int, valid: Tensor, accepted: Tensor, draft_s: float, target_s: float) -> None: ...


class Fixed:
    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self) -> int:
        return self.k

    def observe(self, k: int, valid: Tensor, accepted: Tensor, draft_s: float, target_s: float) -> None:
        pass


class Heuristic:
    def __init__(self, k: int, k_max: int) -> None:
        self.k, self.k_max = k, k_max

    def choose(self) -> int:
        return self.k

    def observe(self, k: int, valid: Tensor, accepted: Tensor, draft_s: float, target_s: float) -> None:
        if k == 0:
            return
        self.k = min(self.k_max, k + 2) if bool((accepted >= k).all()) else max(1, k - 1)


class CostAware:
    """argmax_k (1 + sum_i prod_{j<=i} alpha_j) / (k * c_draft + c_target(k + 1))."""

    def __init__(self, k: int, k_max: int, prior: float = 0.6, decay: float = 0.98) -> None:
        self.k, self.k_max, self.decay = k, k_max, decay
        self.tried = [2.0] * k_max                  # pseudo-counts: conditional acceptance per position
        self.hit = [2.0 * prior] * k_max
        self.c_draft = 0.0                          # seconds per drafted token
        self.c_target: dict[int, float] = {}        # tokens scored -> seconds per target forward

    def _target_cost(self, t: int) -> float:
        if not self.c_target:
            return 1.0
        pts = sorted(self.c_target.items())
        if len(pts) == 1:
            return pts[0][1]
        n = len(pts)
        mx = sum(x for x, _ in pts) / n
        my = sum(y for _, y in pts) / n
        var = sum((x - mx) ** 2 for x, _ in pts)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in pts) / var) if var > 0 else 0.0
        return max(1e-6, my + slope * (t - mx))

    def choose(self) -> int:
        best, best_rate, expect, reach = 1, -1.0, 1.0, 1.0
        for k in range(1, self.k_max + 1):
            reach *= self.hit[k - 1] / self.tried[k - 1]
            expect += reach
            rate = expect / (k * self.c_draft + self._target_cost(k + 1))
            if rate > best_rate:
                best, best_rate = k, rate
        # explore one step past what we know well
        self.k = best
        return best

    def observe(self, k: int, valid: Tensor, accepted: Tensor, draft_s: float, target_s: float) -> None:
        if k == 0:
            return
        for v, a in zip(valid.tolist(), accepted.tolist()):
            for i in range(min(v, a + 1)):           # positions reached
                self.tried[i] = self.tried[i] * self.decay + 1.0
                self.hit[i] = self.hit[i] * self.decay + (1.0 if i < a else 0.0)
        self.c_draft = 0.8 * self.c_draft + 0.2 * (draft_s / k) if self.c_draft else draft_s / k
        old = self.c_target.get(k + 1)
        self.c_target[k + 1] = target_s if old is None else 0.8 * old + 0.2 * target_s


def make_policy(name: str, k: int) -> DraftPolicy:
    if not isinstance(k, int) or k < 1 or k > MAX_DRAFT_TOKENS:
        raise SpecdecError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
    if name == "fixed":
        return Fixed(k)
    if name == "heuristic":
        return Heuristic(k, k_max=min(MAX_DRAFT_TOKENS, 2 * k + 4))
    if name == "auto":
        return CostAware(k, k_max=min(MAX_DRAFT_TOKENS, max(2 * k, 8)))
    raise SpecdecError(f"unknown draft policy {name!r}; choose one of: {', '.join(POLICIES)}")
