"""Per-request and aggregated speculation metrics: tau, acceptance, time split."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counters:
    new_tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0                                   # drafts proposed (valid ones)
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)    # per draft position
    accepted_at: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    wall_seconds: float = 0.0
    accepted_prediction: int = 0                       # drafts taken from the request's prediction: accepted
    rejected_prediction: int = 0                       # ... and rejected
    predicted_at: list[int] = field(default_factory=list)  # per draft position: drafts taken from the prediction
    accepted_predicted_at: list[int] = field(default_factory=list)
    last: tuple[int, int, int, bool] = (0, 0, 0, False)   # the last step's (valid, accepted, committed, predicted)

    def record_step(self, valid: int, accepted: int, committed: int, predicted: bool = False) -> None:
        """One target forward that proposed `valid` drafts (from the request's prediction if `predicted`),
        accepted `accepted`, committed `committed` tokens."""
        self._count(valid, accepted, committed, predicted, 1)
        self.target_forwards += 1
        self.last = (valid, accepted, committed, predicted)

    def drop_last(self, n: int) -> None:
        """The last step's final `n` committed tokens are dropped (they followed the end of the output: an
        EOS, max_new_tokens, a stop string): the counters keep its drafts up to the tokens that stay, so
        accepted drafts never outnumber the tokens a user gets. Dropping none changes nothing (a step that
        ended on its last token, e.g. a recovered EOS, keeps every draft it verified)."""
        if n <= 0:
            return
        valid, accepted, committed, predicted = self.last
        n = min(n, committed)
        kept = committed - n
        self._count(valid, accepted, committed, predicted, -1)
        self.last = (min(valid, kept), min(accepted, kept), kept, predicted)
        self._count(*self.last, 1)

    def _count(self, valid: int, accepted: int, committed: int, predicted: bool, sign: int) -> None:
        self.new_tokens += sign * committed
        self.drafted += sign * valid
        self.accepted += sign * accepted
        if predicted:
            self.accepted_prediction += sign * accepted
            self.rejected_prediction += sign * (valid - accepted)
        _add_steps(self.drafted_at, self.accepted_at, valid, accepted, sign)
        if predicted:
            _add_steps(self.predicted_at, self.accepted_predicted_at, valid, accepted, sign)

    def own(self) -> tuple[list[int], list[int]]:
        """(drafted_at, accepted_at) of the method's own drafts: the prediction's left out."""
        n = len(self.drafted_at)
        pred = self.predicted_at + [0] * (n - len(self.predicted_at))
        acc = self.accepted_predicted_at + [0] * (n - len(self.accepted_predicted_at))
        drafted = [d - p for d, p in zip(self.drafted_at, pred)]
        accepted = [a - p for a, p in zip(self.accepted_at, acc)]
        while drafted and not drafted[-1]:
            drafted.pop()
            accepted.pop()
        return drafted, accepted

    def merge(self, other: "Counters") -> None:
        for name in ("new_tokens", "target_forwards", "drafted", "accepted",
                     "draft_seconds", "target_seconds", "wall_seconds", "accepted_prediction", "rejected_prediction"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("drafted_at", "accepted_at", "predicted_at", "accepted_predicted_at"):
            mine, theirs = getattr(self, name), getattr(other, name)
            n = max(len(mine), len(theirs))
            setattr(self, name, [a + b for a, b in zip(mine + [0] * n, theirs + [0] * n)][:n])

    def as_dict(self) -> dict:
        """The public metrics object (keys fixed by the CLI's --json contract)."""
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "tau": self.new_tokens / self.target_forwards if self.target_forwards else 0.0,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,  # nothing drafted: null
            "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
            "tokens_per_second": self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0,
            "wall_seconds": self.wall_seconds,
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "accepted_prediction_tokens": self.accepted_prediction,
            "rejected_prediction_tokens": self.rejected_prediction,
        }


def _add_steps(drafted_at: list[int], accepted_at: list[int], valid: int, accepted: int, sign: int) -> None:
    """Count (sign 1) or uncount (sign -1) one step's `valid` drafts, `accepted` of them, per position; positions
    no step drafts any more are dropped."""
    while len(drafted_at) < valid:
        drafted_at.append(0)
        accepted_at.append(0)
    for i in range(valid):
        drafted_at[i] += sign
        if i < accepted:
            accepted_at[i] += sign
    while drafted_at and not drafted_at[-1]:
        drafted_at.pop()
        accepted_at.pop()
