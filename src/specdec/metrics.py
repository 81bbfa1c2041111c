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
        while len(self.drafted_at) < valid:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(valid):
            self.drafted_at[i] += sign
            if i < accepted:
                self.accepted_at[i] += sign
        while self.drafted_at and not self.drafted_at[-1]:    # positions only a dropped step drafted: gone
            self.drafted_at.pop()
            self.accepted_at.pop()

    def merge(self, other: "Counters") -> None:
        for name in ("new_tokens", "target_forwards", "drafted", "accepted",
                     "draft_seconds", "target_seconds", "wall_seconds", "accepted_prediction", "rejected_prediction"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        n = max(len(self.drafted_at), len(other.drafted_at))
        self.drafted_at = [a + b for a, b in zip(self.drafted_at + [0] * n, other.drafted_at + [0] * n)][:n]
        self.accepted_at = [a + b for a, b in zip(self.accepted_at + [0] * n, other.accepted_at + [0] * n)][:n]

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
