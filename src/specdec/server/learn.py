"""Online distillation of the EAGLE-3 head from served traffic (`specdec serve --learn`).

Every verification of an engine drafting with the EAGLE-3 head (eagle3, and hybrid, whose head drafts where
prompt lookup finds no match) computes, for free, the target's features of the tokens it commits (the final
hidden state and the head's three feature layers, [.., H*(1+3)]); the prefill computed them for
the prompt. A `FeatureTap` around the engine's proposer keeps them per cache row; when a sequence finishes
its (tokens, features) enter a bounded `TrafficBuffer` (bfloat16, the most recent tokens).

Between engine steps, on the worker thread, the `OnlineLearner` trains a float32 copy of the head with
AdamW and the training-time-test loss of `specdec train eagle3` (train/eagle3.ttt_losses) over windows
from the buffer, one micro-batch at a time: back to back while the server is idle (a new request waits
for at most one micro-batch), and while it is busy at most `busy_share` of the wall time. After each
update the learnt weights are copied into every live head and re-packed (Eagle3Head.prepare), at a
step boundary: a step drafts with one set of weights from start to end. The head only proposes, and
verification is lossless, so outputs are the same as without learning (greedy: token for token; seeded
sampling with point-mass drafts: equal to plain sampling); only the acceptance changes.

Learning spends `passes` training tokens per token collected, so an idle server stops training once it
has gone over what it saw that many times. The learnt head is written every `save_minutes` and when the
worker stops, as an EAGLE-3 weights file (`--learn-checkpoint`, by default under the specdec cache and
named after the model); a server started with --learn drafts with it, so a restart keeps what was learnt.
eagle3 and hybrid engines share one learnt head: with --learn both draft from the same file.
"""
from __future__ import annotations

import json
import os
import random
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol, cast

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge
from torch import Tensor

from ..api import DraftSource, has_shipped, train_hint
from ..errors import SpecdecError
from ..files import writable_file
from ..models.decoder import Transformer
from ..models.eagle3 import Eagle3Head
from ..proposers.base import ActiveBatch, Proposer
from ..engine import SequenceState
from ..verify import Draft, Verdict

LEARNED_METHODS = ("eagle3", "hybrid")   # the methods that draft with the EAGLE-3 head (hybrid: where lookup misses)


class HeadProposer(Proposer, Protocol):
    """A proposer that drafts with an EAGLE-3 head (EagleProposer; HybridProposer, where prompt lookup misses)."""

    @property
    def head(self) -> torch.nn.Module: ...


@dataclass(frozen=True)
class LearnConfig:
    """What `specdec serve --learn` does; the defaults suit a 135M target on a few cores."""
    enabled: bool = False
    checkpoint: str = ""                # the learnt head's file ("": $SPECDEC_CACHE/learn/MODEL-eagle3.safetensors)
    buffer_tokens: int = 16384          # committed tokens whose features are kept (the most recent)
    window: int = 32                    # tokens per training window
    batch: int = 2                      # windows per update
    ttt_steps: int = 4                  # training-time-test steps (draft positions trained)
    lr: float = 2e-4
    busy_share: float = 0.1             # at most this share of a busy server's wall time goes to training
    passes: float = 4.0                 # training tokens per collected token (then training waits for traffic)
    save_minutes: float = 5.0
    recent_requests: int = 32           # requests per method in the rolling acceptance window of /metrics
    train_dtype: str = "auto"           # auto: bfloat16 autocast only where this CPU makes it faster
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("buffer_tokens", "batch", "recent_requests"):
            if getattr(self, name) < 1:
                raise SpecdecError(f"learn {name} must be >= 1, got {getattr(self, name)}")
        if self.window < self.ttt_steps + 2:
            raise SpecdecError(f"learn window ({self.window}) must be >= ttt_steps + 2 ({self.ttt_steps + 2})")
        if not 0 < self.busy_share <= 1:
            raise SpecdecError(f"learn busy_share must be in (0, 1], got {self.busy_share}")
        if self.train_dtype not in ("auto", "float32", "bfloat16"):
            raise SpecdecError(f"learn train_dtype must be auto, float32 or bfloat16, got {self.train_dtype!r}")
        if self.lr <= 0 or self.passes <= 0 or self.save_minutes <= 0:
            raise SpecdecError("learn lr, passes and save_minutes must be > 0")

    def checkpoint_path(self, model: str) -> Path:
        """The file the learnt head is kept in (and drafted with at the next start)."""
        from ..models.registry import cache_dir

        return Path(self.checkpoint) if self.checkpoint else cache_dir() / "learn" / f"{model}-eagle3.safetensors"


# ---- collecting --------------------------------------------------------------------------
class FeatureTap:
    """A proposer drafting with the EAGLE-3 head (eagle3, hybrid) that also keeps, per cache row, the target's
    features of the row's committed positions (bfloat16 copies); everything else is the wrapped proposer's."""

    def __init__(self, inner: HeadProposer, method: str) -> None:
        self.inner, self.method = inner, method
        self.name = inner.name
        self.feature_layers = inner.feature_layers
        self.feats: dict[int, list[Tensor]] = {}          # row -> features [n, H*(1+3)] of positions 0, 1, ..
        self.learnt = False                                # the head has had a learnt update copied in
        self.started_learnt: dict[int, bool] = {}          # row -> whether its request started with a learnt head

    @property
    def head(self) -> Eagle3Head:
        return cast(Eagle3Head, self.inner.head)

    def allocate(self, rows: int, slots: int) -> None:
        self.feats = {}
        self.inner.allocate(rows, slots)

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        for i, r in enumerate(rows.tolist()):                 # prompts hold the first token too: P - 1 scored
            self.feats[r] = [hidden[i, :len(prompts[i]) - 1].to(torch.bfloat16, copy=True)]
            self.started_learnt[r] = self.learnt
        self.inner.start(rows, prompts, hidden)

    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        return self.inner.propose(batch, k)

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: Tensor) -> None:
        n = verdict.num_new.tolist()
        for i, r in enumerate(batch.rows.tolist()):           # the positions of the committed path, in order
            self.feats[r].append(hidden[i, verdict.path[i, :n[i]]].to(torch.bfloat16, copy=True))
        self.inner.commit(batch, verdict, hidden)

    def forget(self) -> None:
        self.inner.forget()

    def take(self, seq: SequenceState) -> tuple[list[int], Tensor]:
        """A finished sequence's tokens and the features of its positions [T, H*(1+3)] (the last token,
        never scored, and tokens cut after an EOS or the length limit are left out)."""
        parts = self.feats.pop(seq.row, [])                  # none: the row was reallocated meanwhile
        if not parts:
            return [], torch.empty(0)
        f = torch.cat(parts)
        n = min(len(f), len(seq.tokens))
        return seq.tokens[:n], f[:n]


class TrafficBuffer:
    """(tokens, features) of finished sequences, the oldest dropped beyond `capacity` tokens."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.seqs: deque[tuple[list[int], Tensor]] = deque()
        self.tokens = 0

    def add(self, tokens: list[int], feats: Tensor) -> None:
        if len(tokens) > self.capacity:                      # a sequence longer than the buffer: its tail
            tokens, feats = tokens[-self.capacity:], feats[-self.capacity:]
        self.seqs.append((tokens, feats))
        self.tokens += len(tokens)
        while self.tokens > self.capacity:
            self.tokens -= len(self.seqs.popleft()[0])

    def windows(self, n: int, window: int, rng: random.Random) -> tuple[Tensor, Tensor, Tensor]:
        """n random windows (sequences drawn by length): tokens [n, W], features [n, W, F] (float32,
        right-padded), lengths [n]."""
        from ..train.features import windows as cut

        seqs = list(self.seqs)
        idx = rng.choices(range(len(seqs)), weights=[len(t) for t, _ in seqs], k=n)
        toks, f, lens, _ = cut([t for t, _ in seqs], [x for _, x in seqs], idx, window, rng)
        return toks, f, lens


# ---- measuring -----------------------------------------------------------------------------
class AcceptanceStats:
    """Draft acceptance per position of one method's finished requests: those that started before the first learnt
    update reached the head, and the most recent `recent` ones."""

    def __init__(self, recent: int) -> None:
        self.before: tuple[list[int], list[int]] = ([], [])          # drafted, accepted per position
        self.recent: deque[tuple[list[int], list[int]]] = deque(maxlen=recent)
        self.requests = {"before": 0}

    def add(self, drafted_at: list[int], accepted_at: list[int], learnt: bool) -> None:
        if not drafted_at:
            return                                                   # drafted nothing (e.g. method none)
        self.recent.append((list(drafted_at), list(accepted_at)))
        if not learnt:
            self.requests["before"] += 1
            for dst, src in zip(self.before, (drafted_at, accepted_at)):
                dst.extend([0] * (len(src) - len(dst)))
                for i, v in enumerate(src):
                    dst[i] += v

    def rates(self) -> dict[str, list[float]]:
        """Acceptance per draft position (accepted / drafted there) by phase: before, recent."""
        n = max((len(d) for d, _ in self.recent), default=0)
        drafted, accepted = [0] * n, [0] * n
        for d, a in self.recent:
            for i in range(len(d)):
                drafted[i] += d[i]
                accepted[i] += a[i]
        per = {"before": self.before, "recent": (drafted, accepted)}
        return {k: [a / d if d else 0.0 for d, a in zip(*da)] for k, da in per.items()}


class LearnMetrics:
    """The learner's Prometheus metrics, in the server's registry."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.first = Gauge("specdec:learn_acceptance_first", "First-draft acceptance of a learning method's "
                           "requests (eagle3, hybrid): before the first learnt update (phase before) and over the "
                           "most recent requests (phase recent)", ["method", "phase"], registry=r)
        self.per_pos = Gauge("specdec:learn_acceptance_per_pos", "Draft acceptance per position of a learning "
                             "method's requests by phase (before, recent)", ["method", "phase", "position"],
                             registry=r)
        self.requests = Gauge("specdec:learn_requests", "Requests behind each method's and phase's acceptance",
                              ["method", "phase"], registry=r)
        self.updates = Counter("specdec:learn_updates", "Learning updates (AdamW steps) of the EAGLE-3 head",
                               registry=r)
        self.tokens = Counter("specdec:learn_tokens", "Training tokens learnt from (window positions)", registry=r)
        self.collected = Counter("specdec:learn_collected_tokens", "Committed tokens whose features were collected",
                                 registry=r)
        self.buffer = Gauge("specdec:learn_buffer_tokens", "Tokens in the learning buffer", registry=r)
        self.pending = Gauge("specdec:learn_pending_tokens", "Training tokens left before learning waits for "
                             "more traffic", registry=r)
        self.seconds = Counter("specdec:learn_seconds", "Worker time spent learning (updates and swaps)", registry=r)
        self.loss = Gauge("specdec:learn_loss", "Training-time-test loss of the last update", registry=r)


# ---- learning ------------------------------------------------------------------------------
class Learner(Protocol):
    """What the engine pool and the scheduler call (NoLearning: nothing happens)."""

    def source(self, drafts: dict[str, DraftSource]) -> dict[str, DraftSource]:
        """What each method's proposers draft with (a learnt head where one was kept)."""
        ...

    def adopt(self, method: str, proposer: Proposer) -> Proposer:
        """The proposer an engine of `method` drafts with (tapped where it learns)."""
        ...

    def finished(self, proposer: Proposer, seq: SequenceState) -> None:
        """`seq`, drafted by `proposer`, finished (not cancelled)."""
        ...

    def wants_time(self) -> bool:
        """Whether an idle worker should keep calling `tick` instead of waiting for requests."""
        ...

    def tick(self, idle: bool) -> None:
        """A step boundary of the worker: learn for one slice if due, swap learnt weights in."""
        ...

    def close(self) -> None:
        """The worker stops: keep what was learnt."""
        ...


class NoLearning:
    """A server without --learn."""

    def source(self, drafts: dict[str, DraftSource]) -> dict[str, DraftSource]:
        return drafts

    def adopt(self, method: str, proposer: Proposer) -> Proposer:
        return proposer

    def finished(self, proposer: Proposer, seq: SequenceState) -> None:
        pass

    def wants_time(self) -> bool:
        return False

    def tick(self, idle: bool) -> None:
        pass

    def close(self) -> None:
        pass


def _adamw(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW, fused where this torch build fuses it on the CPU (a fifth of the time of the loop version)."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def _train_dtype(requested: str) -> torch.dtype:
    from ..train.precision import DTYPES, choose, machine_timings

    return DTYPES[requested] if requested in DTYPES else choose(requested, machine_timings())


class HeadTrainer:
    """A float32 copy of a live EAGLE-3 head, its AdamW state and the target's LM-head rows of the head's
    vocabulary (the distillation targets); built outside inference mode, so that it can learn."""

    def __init__(self, live: Eagle3Head, target: Transformer, config: LearnConfig) -> None:
        self.config = config
        with torch.inference_mode(False):
            head = Eagle3Head(target, live.cfg, live.vocab_ids.clone())
            head.load_state_dict({k: v.float() for k, v in live.state_dict().items()})
            self.head = head.train()
            w = target.output if target.output.numel() else target.embed
            self.w_sub = w[head.vocab_ids].float().detach().clone()         # [V', H]
            self.params = [p for p in head.parameters() if p.requires_grad]
            self.opt = _adamw(self.params, config.lr)
        self.dtype = _train_dtype(config.train_dtype)

    def update(self, buffer: TrafficBuffer, rng: random.Random) -> tuple[int, float]:
        """One AdamW step on `batch` windows of the buffer -> (tokens learnt from, loss)."""
        from ..train.eagle3 import ttt_losses
        from ..train.loop import autocast

        c = self.config
        with torch.inference_mode(False), torch.enable_grad():
            toks, f, lens = buffer.windows(c.batch, c.window, rng)
            with autocast(self.dtype):
                loss, _ = ttt_losses(self.head, toks, f, lens, self.w_sub, c.ttt_steps)
            self.opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.opt.step()
        return int((lens - 1).clamp(min=0).sum()), float(loss.detach())

    @torch.inference_mode()
    def copy_into(self, live: Eagle3Head) -> None:
        """The learnt weights into a live head (cast to its dtype), its prepacked linears re-packed."""
        learnt = dict(self.head.named_parameters())
        for name, p in live.named_parameters():
            p.copy_(learnt[name])
        live.prepare(live.tgt.dtype)                          # as loading prepared it (it may compute in float32)

    def save(self, path: Path, report: dict) -> None:
        """The learnt head as an EAGLE-3 weights file (written beside, then renamed into place)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")     # this process's own: no other writer's
        with torch.inference_mode(False):
            self.head.save(tmp, {"report": json.dumps(report)})
        tmp.replace(path)


def hold_lock(path: Path) -> IO[bytes]:
    """An exclusive lock beside the checkpoint `path`, held while the returned file stays open: a second server
    learning into the same file would drop the first one's learning (the last save wins), so it is refused."""
    import fcntl

    f = path.with_name(f".{path.name}.lock").open("a+b")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise SpecdecError(f"another specdec server learns into {path}; give this one its own --learn-checkpoint "
                           "(or stop the other)") from None
    return f


def earlier_report(path: Path) -> dict[str, int]:
    """The learning totals a checkpoint's report holds (counted across restarts); none where it has no report."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        try:
            report = json.loads((f.metadata() or {}).get("report", "{}"))
        except ValueError:
            return {}
    if not isinstance(report, dict):
        return {}
    return {k: int(report[k]) for k in ("learnt_updates", "learnt_tokens") if isinstance(report.get(k), int)}


class OnlineLearner:
    """Collects the traffic of the methods drafting with the EAGLE-3 head (eagle3, hybrid) and distils it into
    the live heads, on the worker thread only."""

    def __init__(self, config: LearnConfig, target: Transformer, model: str, registry: CollectorRegistry) -> None:
        self.config, self.target, self.model = config, target, model
        self.path = config.checkpoint_path(model)
        writable_file(self.path, "--learn-checkpoint")     # learning that cannot be kept: refused at start
        self.earlier = {"learnt_updates": 0, "learnt_tokens": 0}   # what the checkpoint's earlier runs learnt
        if self.path.exists():
            Eagle3Head.load(self.path, target)               # another target's or a misshapen file: refused at start
            self.earlier.update(earlier_report(self.path))
        self.lock = hold_lock(self.path)                     # one server learns into a checkpoint at a time
        self.metrics = LearnMetrics(registry)
        self.buffer = TrafficBuffer(config.buffer_tokens)
        self.stats = {m: AcceptanceStats(config.recent_requests) for m in LEARNED_METHODS}   # per method
        self.taps: weakref.WeakValueDictionary[int, FeatureTap] = weakref.WeakValueDictionary()  # live engines' taps
        self.rng = random.Random(config.seed)
        self.trainer: HeadTrainer | None = None              # built with the first engine of a learning method
        self.updates = self.saved_updates = 0
        self.tokens_learnt = 0
        self.pending = 0.0                                   # training tokens left (passes x collected)
        self.next_busy = 0.0                                 # time.monotonic() before which a busy worker only serves
        self.last_save = time.monotonic()

    def source(self, drafts: dict[str, DraftSource]) -> dict[str, DraftSource]:
        """The pool's drafts, with one head for every learning method: the checkpoint where one exists, else the
        head given for one of them (eagle3's first), else the shipped one."""
        given = [str(self.path)] if self.path.exists() else [drafts[m] for m in LEARNED_METHODS if drafts.get(m)]
        if not given and not has_shipped(self.model, "eagle3"):            # nothing to learn into: refused at start
            raise SpecdecError(f"--learn trains an EAGLE-3 head, and none is shipped for {self.model!r}: give one "
                               f"(--method eagle3 --draft-model HEAD.safetensors; {train_hint(self.model, 'eagle3')})")
        return {**drafts, **{m: given[0] for m in LEARNED_METHODS}} if given else drafts

    # ---- collecting (engine pool, scheduler) ----------------------------------------------
    def adopt(self, method: str, proposer: Proposer) -> Proposer:
        if method not in LEARNED_METHODS:
            return proposer
        tap = FeatureTap(cast(HeadProposer, proposer), method)
        if self.trainer is None:
            self.trainer = HeadTrainer(tap.head, self.target, self.config)
        elif self.updates:
            self.trainer.copy_into(tap.head)                 # a later engine drafts with what was learnt
        tap.learnt = self.updates > 0 or self.earlier["learnt_updates"] > 0      # a restart drafts with a learnt head
        self.taps[id(tap)] = tap
        return tap

    def finished(self, proposer: Proposer, seq: SequenceState) -> None:
        tap = self.taps.get(id(proposer))
        if tap is not proposer:
            return
        learnt = tap.started_learnt.pop(seq.row, tap.learnt)  # phase `before`: started with the head not yet learnt
        tokens, feats = tap.take(seq)
        drafted, accepted = seq.counters.own()              # the head's drafts, a prediction's left out
        self.stats[tap.method].add(drafted, accepted, learnt)
        if len(tokens) >= 2:
            self.buffer.add(tokens, feats)
            self.metrics.collected.inc(len(tokens))
            self.pending = min(self.config.passes * self.config.buffer_tokens,
                               self.pending + self.config.passes * len(tokens))
        self._export()

    # ---- learning (worker thread, between steps) -------------------------------------------
    def wants_time(self) -> bool:
        return self.trainer is not None and self.pending > 0 and self.buffer.tokens > 0

    def tick(self, idle: bool) -> None:
        if self.trainer is None:
            return
        if self.wants_time() and (idle or time.monotonic() >= self.next_busy):
            t0 = time.perf_counter()
            n, loss = self.trainer.update(self.buffer, self.rng)
            for tap in list(self.taps.values()):
                self.trainer.copy_into(tap.head)
                tap.learnt = True
            spent = time.perf_counter() - t0
            self.updates += 1
            self.tokens_learnt += n
            self.pending = max(0.0, self.pending - n)
            share = self.config.busy_share                   # a busy worker serves (1 - share) / share as long
            self.next_busy = time.monotonic() + spent * (1 - share) / share
            m = self.metrics
            m.updates.inc()
            m.tokens.inc(n)
            m.loss.set(loss)
            m.seconds.inc(spent)
            self._export()
        if self.updates > self.saved_updates and time.monotonic() - self.last_save >= self.config.save_minutes * 60:
            self.save()

    def close(self) -> None:
        if self.updates > self.saved_updates:
            self.save()
        self.lock.close()                                    # another server may learn into the file now

    def save(self) -> None:
        """Write the learnt head to the checkpoint file."""
        if self.trainer is None:
            return
        self.trainer.save(self.path, {"learnt_updates": self.earlier["learnt_updates"] + self.updates,
                                      "learnt_tokens": self.earlier["learnt_tokens"] + self.tokens_learnt})
        self.saved_updates = self.updates
        self.last_save = time.monotonic()

    def _export(self) -> None:
        m = self.metrics
        for method, stats in self.stats.items():
            if not stats.recent:
                continue                                     # no request of this method drafted yet
            for phase, rates in stats.rates().items():
                if rates:
                    m.first.labels(method, phase).set(rates[0])
                for pos, r in enumerate(rates):
                    m.per_pos.labels(method, phase, str(pos)).set(r)
            m.requests.labels(method, "before").set(stats.requests["before"])
            m.requests.labels(method, "recent").set(len(stats.recent))
        m.buffer.set(self.buffer.tokens)
        m.pending.set(self.pending)
