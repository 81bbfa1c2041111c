"""Continuous batching: one worker thread owns the engines; requests join and leave at step boundaries.

The HTTP side (an asyncio loop) never touches an Engine. It `submit`s a Job and
reads the Job's asyncio queue of events (text pieces, then Done or Failed); it
`cancel`s the Job when the client goes away. The worker thread drains its inbox,
admits waiting jobs while fewer than `max_batch` are running, and steps every busy
engine round-robin. One engine per (method, K): they share the target's weights,
each has its own caches.

`specdec serve` runs the worker loop in the main thread (`in_caller`), the thread that loaded the model,
and uvicorn in a helper thread: libgomp cuts its worker threads' spin-wait to almost nothing once more
threads than cores belong to OpenMP teams, so a second thread driving parallel regions (the main
thread's team from loading, plus the worker's) makes every parallel region of a step sleep and wake on
a futex. Measured on 2 cores with 2 torch threads, a decode step of 8 sequences took 130 ms from a
second thread vs 74-81 ms from the thread that loaded the model (docs/server.md, Threads).

With --learn, the worker also learns between steps (server/learn.py): `Learner.tick` at every step
boundary, back to back while idle; the same thread, so no step ever sees a head's weights change.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..api import DraftSource, Generator, make_proposer, serve_sample_drafts
from ..names import DEFAULT_SAMPLE_DRAFTS
from ..tree import TreeShape
from ..engine import Engine, Request, SequenceState, scratch_slots
from ..errors import SpecdecError
from ..logprobs import TokenLogprob
from ..prefix_cache import PrefixCache
from .learn import Learner, NoLearning

TRIM_EVERY_SECONDS = 20.0
IDLE_WAKE_SECONDS = 0.25
log = logging.getLogger("specdec")


@functools.cache
def _malloc_trim() -> Callable[[], int]:
    """glibc's malloc_trim, looked up once on first use (a no-op where the C library has none)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    return (lambda: trim(0)) if trim is not None else (lambda: 0)


def trim_heap() -> int:
    """Give free heap pages back to the OS (glibc's malloc_trim(0); elsewhere nothing).

    Prefills of varying lengths leave freed activation buffers in glibc's arenas, so a server's
    resident memory creeps up in steps though nothing leaks; giving free pages back to the OS
    now and then (a few ms) keeps it flat."""
    return _malloc_trim()()


LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0)


@dataclass(frozen=True)
class SpecChoice:
    """Which engine serves a request: a method and its draft length (0 for method none)."""
    method: str
    num_draft_tokens: int


@dataclass(frozen=True)
class Done:
    """The request finished: its text, token counts and speculation report."""
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    speculative: dict
    logprobs: tuple[TokenLogprob, ...] = ()      # every completion token's, where the request asks
    prompt_logprobs: tuple[TokenLogprob, ...] = ()   # the prompt's tokens' after the first, where asked
    choice: int = 0                                  # which of a request's n choices (Job.choice)


@dataclass(frozen=True)
class TextPiece:
    """Text the request's output gained (streamed as it comes), and the log-probabilities of the tokens committed
    since the last piece, where the request asks (a piece may carry tokens whose text is still held back)."""
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()   # in the request's first piece, where asked
    choice: int = 0


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 500
    code: str | None = None        # OpenAI's error code, where one names the cause
    choice: int = 0


Event = TextPiece | Done | Failed


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is at its bound."""


class Closed(Exception):
    """The worker loop has ended (the server is shutting down): nothing takes new jobs."""


class PoolFull(Exception):
    """A request names a (method, K) with no engine, and no idle engine can make room for one."""


@dataclass(eq=False)
class Job:
    """One request in flight; only the worker thread mutates it after `submit`."""
    request: Request
    spec: SpecChoice
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float = field(default_factory=time.perf_counter)
    seq: SequenceState | None = None
    engine: Engine | None = None
    last_emit: float | None = None
    finished: bool = False
    sent_logprobs: int = 0             # of seq.logprobs, how many went out in pieces
    choice: int = 0                    # its index among its request's choices (OpenAI's n); events carry it

    @staticmethod
    def create(request: Request, spec: SpecChoice) -> "Job":
        """A job bound to the running event loop (call from the asyncio side)."""
        return Job.choices([request], spec)[0]

    @staticmethod
    def choices(requests: list[Request], spec: SpecChoice) -> list["Job"]:
        """The jobs of one request's choices, request i as choice i: one event queue, each event tagged with its
        choice (call from the asyncio side)."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        return [Job(r, spec, loop, events, choice=i) for i, r in enumerate(requests)]


class PrefixCacheCollector:
    """The prefix cache's own counters (prompt tokens looked up, served from it) as Prometheus counters."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield CounterMetricFamily("specdec:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=self.cache.queried_tokens)
        yield CounterMetricFamily("specdec:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                  value=self.cache.hit_tokens)
        yield GaugeMetricFamily("specdec:prefix_cache_bytes", "Bytes the prefix cache holds (its bound: "
                                "--prefix-cache-mb)", value=self.cache.nbytes)
        yield GaugeMetricFamily("specdec:prefix_cache_pieces", "Prefill pieces the prefix cache holds",
                                value=len(self.cache.pieces))


class EngineCollector:
    """The pool's engines as a gauge: one series per (method, K) kept, valued at the sequences it holds (running
    or prefilling; 0: idle), so a scrape shows which engines exist and which serve."""

    def __init__(self, pool: "EnginePool") -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("specdec:engine_sequences", "Sequences in each engine kept by the server, by method "
                              "and K (engines are built per (method, K) on demand, --max-engines at most)",
                              labels=["method", "num_draft_tokens"])
        for key, eng in list(self.pool.engines.items()):           # a snapshot: the worker thread may change it
            g.add_metric([key.method, str(key.num_draft_tokens)], len(eng.active) + len(eng.pending))
        yield g


class ServerMetrics:
    """Prometheus metrics in their own registry (several apps may live in one process)."""

    def __init__(self, prefix_cache: PrefixCache) -> None:
        r = self.registry = CollectorRegistry()
        r.register(PrefixCacheCollector(prefix_cache))
        self.requests = Counter("specdec:requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.ttft = Histogram("specdec:time_to_first_token_seconds", "Arrival to first text piece",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specdec:inter_token_latency_seconds", "Gap between consecutive text pieces of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("specdec:e2e_request_latency_seconds", "Arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("specdec:num_requests_running", "Requests holding a batch slot", registry=r)
        self.waiting = Gauge("specdec:num_requests_waiting", "Requests queued for a slot", registry=r)
        self.prompt_tokens = Counter("specdec:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("specdec:generation_tokens", "Generated tokens", registry=r)
        self.num_drafts = Counter("specdec:spec_decode_num_drafts", "Speculative steps that proposed drafts",
                                  registry=r)
        self.num_draft_tokens = Counter("specdec:spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted = Counter("specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter("specdec:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.steps = Counter("specdec:engine_steps", "Engine steps by kind (prefill: newcomers' prompts; "
                             "decode: one speculative or plain step of the running batch)", ["kind"], registry=r)
        self.step_seconds = Counter("specdec:engine_step_seconds", "Time spent in engine steps by kind", ["kind"],
                                    registry=r)
        self.step_sequences = Counter("specdec:engine_step_sequences", "Sequences in engine steps by kind "
                                      "(divided by steps: the mean batch)", ["kind"], registry=r)

    def record_step(self, kind: str, sequences: int, seconds: float) -> None:
        self.steps.labels(kind).inc()
        self.step_seconds.labels(kind).inc(seconds)
        self.step_sequences.labels(kind).inc(sequences)

    def record_speculation(self, seq: SequenceState) -> None:
        c = seq.counters
        self.generation_tokens.inc(len(seq.generated))
        self.num_drafts.inc(c.drafted_at[0] if c.drafted_at else 0)
        self.num_draft_tokens.inc(c.drafted)
        self.num_accepted.inc(c.accepted)
        for pos, n in enumerate(c.accepted_at):
            self.accepted_per_pos.labels(str(pos)).inc(n)


def speculation_report(seq: SequenceState, spec: SpecChoice, policy: str) -> dict:
    """The per-request `speculative` extension object of a response (`policy`: the server's draft-length policy,
    under which K is the draft length (fixed) or where it starts (heuristic, auto))."""
    m = seq.counters.as_dict()
    return {"method": spec.method, "num_draft_tokens": spec.num_draft_tokens, "draft_policy": policy, "tau": m["tau"],
            "acceptance_rate": m["acceptance_rate"], "acceptance_per_position": m["acceptance_per_position"],
            "draft_tokens": seq.counters.drafted, "accepted_tokens": seq.counters.accepted,
            "target_forwards": m["target_forwards"], "accepted_prediction_tokens": m["accepted_prediction_tokens"],
            "rejected_prediction_tokens": m["rejected_prediction_tokens"]}


class EnginePool:
    """Engines keyed by (method, K), built lazily from one target; idle extra engines are evicted (LRU).

    `drafts` maps a method to what its proposers draft with (api.DraftSource: a draft model loaded once and
    shared, or e.g. a head's weights path); methods not in it get the shipped one. `tree` shapes EAGLE's drafts.
    """

    def __init__(self, generator: Generator, drafts: dict[str, DraftSource], dtype: str, default: SpecChoice,
                 rows: int, base_slots: int, max_engines: int, tree: TreeShape = TreeShape(),
                 prefix_cache: PrefixCache | None = None, prefill_budget: int = 256,
                 learner: Learner = NoLearning(), sample_drafts: str = DEFAULT_SAMPLE_DRAFTS) -> None:
        """prefix_cache: shared by all engines (one target; not given: a disabled one of this pool's own);
        prefill_budget: prompt tokens per prefill step; learner: taps the proposers it learns from (--learn);
        sample_drafts: the EAGLE chains' draft sampling (api.sample_drafts_from) of the engines it builds."""
        self.learner, self.sample_drafts = learner, sample_drafts
        self.gen, self.drafts, self.dtype, self.default, self.tree = generator, drafts, dtype, default, tree
        self.rows, self.base_slots, self.max_engines = rows, base_slots, max_engines
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(0)
        self.prefill_budget = prefill_budget
        self.engines: dict[SpecChoice, Engine] = {}
        self.engines[default] = self._build(default)

    def slots(self, k: int) -> int:
        """Cache length of an engine drafting up to k tokens (capped by the model's context in Generator.engine)."""
        return self.base_slots + scratch_slots(k)

    def _build(self, spec: SpecChoice) -> Engine:
        device = str(self.gen.target.device)
        proposer = self.learner.adopt(spec.method, make_proposer(spec.method, self.gen.target, self.gen.tokenizer,
                                                                 self.drafts.get(spec.method), self.dtype, device,
                                                                 self.tree, self.sample_drafts_of(spec.method)))
        k = max(spec.num_draft_tokens, 1)
        gen = Generator(self.gen.target, self.gen.tokenizer, proposer, self.gen.policy_name, k, self.gen.name)
        return gen.engine(self.rows, self.slots(k), self.prefix_cache, self.prefill_budget)

    def sample_drafts_of(self, method: str) -> str:
        """The server's draft sampling for an engine of `method`: `on` samples the EAGLE chains' drafts and
        leaves every other method's point masses (as `auto` and `off` do)."""
        return serve_sample_drafts(self.sample_drafts, method)

    def route(self, spec: SpecChoice) -> tuple[SpecChoice, bool]:
        """(engine key, speculate flag): method none rides in the default engine with speculation off."""
        if spec.method == "none":
            return self.default, False
        return spec, True

    def get(self, key: SpecChoice) -> Engine:
        """The engine for `key`, built if needed; a full pool first evicts its least recently used idle engine
        (never the default one). Raises PoolFull when every other engine is busy."""
        if key in self.engines:
            eng = self.engines.pop(key)             # re-insert: most recently used last
            self.engines[key] = eng
            return eng
        if len(self.engines) >= self.max_engines:
            idle = [k for k, e in self.engines.items() if k != self.default and not e.busy]
            if not idle:
                raise PoolFull(self.full_message(key))
            del self.engines[idle[0]]
            trim_heap()
        self.engines[key] = self._build(key)
        return self.engines[key]

    def full_message(self, key: SpecChoice) -> str:
        """Why `key` gets no engine: which are loaded, and how to raise the bound."""
        asked = f"speculative method {key.method} with K={key.num_draft_tokens}"
        if self.max_engines == 1:
            ask = "none" if self.default.method == "none" else f"{self.default.method} or none"
            return (f"{asked} is not available: this server runs only its default method {self.default.method} "
                    f"(--max-engines 1); ask for {ask}, or start the server with a larger --max-engines")
        busy = ", ".join(f"{k.method} K={k.num_draft_tokens}" for k in self.engines if k != self.default)
        return (f"{asked} waits for an engine of its own: the pool (--max-engines {self.max_engines}) holds busy "
                f"ones ({busy})")

    def key_of(self, eng: Engine) -> SpecChoice:
        """The (method, K) an engine of this pool serves."""
        return next(k for k, e in self.engines.items() if e is eng)

    def busy(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.busy]

    def reset(self, eng: Engine) -> None:
        """Drop every sequence of an engine (after a failure) by reallocating its caches."""
        eng.allocate(eng.rows, eng.slots)


class Scheduler:
    """The worker thread and its thread-safe inbox."""

    def __init__(self, pool: EnginePool, metrics: ServerMetrics, max_batch: int, max_waiting: int,
                 prefill_threads: int) -> None:
        """prefill_threads: torch threads for steps that prefill (compute-bound GEMMs over whole prompts,
        which a stalled thread slows less than the short decode steps; those keep the process's setting)."""
        self.pool, self.metrics = pool, metrics
        self.learner = pool.learner                  # learns between steps (server/learn.py)
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.prefill_threads = prefill_threads
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: deque[Job] = deque()
        self.running: dict[int, Job] = {}           # id(seq) -> job
        self.outstanding = 0                         # submitted and not yet finished (guarded by lock)
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.steps = 0                               # engine steps taken
        self.peak_running = 0                        # most sequences ever decoded at once
        self.in_caller = False                       # True: the owner calls run(); start() spawns no thread
        self.looping = False                         # run() is in its loop
        self.closed = False                          # run() has ended: submit refuses (guarded by lock)
        self.stop_requested = False                  # set by a signal handler: the loop ends at its next boundary

    # ---- asyncio side --------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull when max_batch + max_waiting jobs are outstanding, Closed once the
        worker loop has ended."""
        with self.lock:
            if self.closed:
                raise Closed("the server is shutting down")
            if self.outstanding >= self.max_batch + self.max_waiting:
                raise QueueFull(f"server busy: {self.outstanding} requests in flight "
                                f"(max batch {self.max_batch} + queue {self.max_waiting}); retry later")
            self.outstanding += 1
        self.inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """Stop a job (client gone); the worker frees its slot at the next step boundary."""
        self.inbox.put(("cancel", job))

    def start(self) -> None:
        """Run the worker loop in a thread of its own, unless the owner runs it (`in_caller`)."""
        if self.thread is None and not self.in_caller:
            self.thread = threading.Thread(target=self.run, name="specdec-scheduler", daemon=True)
            self.thread.start()

    @property
    def alive(self) -> bool:
        return self.looping

    def request_stop(self) -> None:
        """End the loop at its next step boundary. Safe in a signal handler (no lock, nothing raised, so no
        step or bookkeeping is cut in half) and repeatable."""
        self.stop_requested = True

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop after its current step; wait for its thread when it has one of its own."""
        if self.thread is not None or self.in_caller:
            self.inbox.put(("stop", None))
        if self.thread is not None:
            self.thread.join(timeout)
            self.thread = None

    # ---- worker thread -------------------------------------------------------------
    def run(self) -> None:
        """The worker loop, in the calling thread, until `stop`; then every job left fails with 503."""
        self.looping = True
        try:
            with torch.inference_mode():
                trimmed, was_idle = time.monotonic(), False
                while True:
                    idle = not self.pool.busy() and not self.waiting
                    if (idle and not was_idle) or time.monotonic() - trimmed > TRIM_EVERY_SECONDS:
                        trim_heap()
                        trimmed = time.monotonic()
                    was_idle = idle
                    if not self._drain(block=idle and not self.learner.wants_time()) or self.stop_requested:
                        break
                    self._admit()
                    self._step_all()
                    self._gauges()
                    idle = not self.pool.busy() and not self.waiting
                    self._learn(lambda: self.learner.tick(idle))
        finally:
            self.looping = False
            with self.lock:
                self.closed = True                   # later submits raise Closed; earlier ones are in the inbox
            while not self._drain(block=False):      # what reached the inbox before: a stop ends a drain early
                pass
            for job in list(self.waiting) + list(self.running.values()):
                self._fail(job, "the server is shutting down", 503, "server_shutting_down")
            self._learn(lambda: self.learner.close())

    def _learn(self, call: Callable[[], None]) -> None:
        """A learner call at a step boundary; a failure stops learning, never serving (it is logged)."""
        try:
            call()
        except Exception:  # noqa: BLE001 - learning is an extra: the server goes on without it
            log.exception("learning from traffic failed: it stops, serving goes on")
            self.learner = self.pool.learner = NoLearning()

    def _drain(self, block: bool) -> bool:
        """Handle every inbox command (waiting up to IDLE_WAKE_SECONDS for one when idle); False on stop.

        The wait is bounded so that a loop in the main thread sees a stop a signal handler requested: a
        signal that the kernel hands to another thread does not interrupt the main thread's wait on a lock."""
        while True:
            try:
                cmd, job = self.inbox.get(block=block, timeout=IDLE_WAKE_SECONDS if block else None)
            except queue.Empty:
                return True
            block = False
            if cmd == "stop":
                return False
            if cmd == "submit":
                self.waiting.append(job)
            elif cmd == "cancel":
                self._cancel(job)

    def _cancel(self, job: Job) -> None:
        if job.finished:
            return
        if job in self.waiting:
            self.waiting.remove(job)
        elif job.seq is not None and job.engine is not None:
            job.engine.cancel(job.seq)
            self.running.pop(id(job.seq), None)
            self.metrics.record_speculation(job.seq)
        self._close(job)

    def _admit(self) -> None:
        """Move waiting jobs into engines while fewer than max_batch run (the engines prefill their
        prompts in bounded steps between decode steps). A job whose (method, K) finds the engine pool full of busy
        engines keeps waiting, and so do the jobs after it that need an engine other than the default one (first
        come, first served: the busy engines drain, one is dropped, the job gets its own); with --max-engines 1
        no other engine can ever be built, so such a job fails with a 429 at once."""
        deferred: list[Job] = []
        while self.waiting and len(self.running) < self.max_batch:
            job = self.waiting.popleft()
            key, speculate = self.pool.route(job.spec)
            if deferred and key != self.pool.default:
                deferred.append(job)
                continue
            try:
                eng = self.pool.get(key)
                req = job.request
                job.seq = eng.add(replace(req, speculate=speculate))
            except PoolFull as e:
                if self.pool.max_engines == 1:
                    self._fail(job, str(e), 429)
                else:
                    deferred.append(job)
                continue
            except SpecdecError as e:
                self._fail(job, str(e), 400)
                continue
            except Exception as e:  # noqa: BLE001 - e.g. out of memory building an engine: fail the job, not the worker
                log.exception("cannot start generation (method %s, K %d)", key.method, key.num_draft_tokens)
                self._fail(job, f"cannot start generation: {type(e).__name__}: {e}", 500)
                continue
            job.engine = eng
            self.running[id(job.seq)] = job
            self.peak_running = max(self.peak_running, len(self.running))
            self.metrics.prompt_tokens.inc(len(req.prompt))
        self.waiting.extendleft(reversed(deferred))

    def _step_all(self) -> None:
        for eng in self.pool.busy():
            kind, sequences = ("prefill", len(eng.pending)) if eng.prefills_next else ("decode", len(eng.active))
            t0 = time.perf_counter()
            try:
                events = self._step(eng)
            except Exception as e:  # noqa: BLE001 - a failed step must not kill the worker
                key = self.pool.key_of(eng)
                log.exception("generation failed (method %s, K %d): failing its %d request(s)", key.method,
                              key.num_draft_tokens, len(eng.active) + len(eng.pending))
                self._fail_engine(eng, f"generation failed: {type(e).__name__}: {e}")
                continue
            self.steps += 1
            now = time.perf_counter()
            self.metrics.record_step(kind, sequences, now - t0)
            for seq, piece in events:
                job = self.running.get(id(seq))
                if job is not None:
                    self._deliver(job, seq, piece, now)

    def _step(self, eng: Engine) -> list[tuple[SequenceState, str]]:
        """One engine step, with `prefill_threads` torch threads if the step prefills."""
        threads = torch.get_num_threads()
        if not eng.prefills_next or threads == self.prefill_threads:
            return eng.step()
        torch.set_num_threads(self.prefill_threads)
        try:
            return eng.step()
        finally:
            torch.set_num_threads(threads)

    def _deliver(self, job: Job, seq: SequenceState, piece: str, now: float) -> None:
        logprobs = tuple(seq.logprobs[job.sent_logprobs:])        # the committed tokens' (they stay committed)
        job.sent_logprobs = len(seq.logprobs)
        if piece or logprobs:
            first = job.last_emit is None
            if first:
                self.metrics.ttft.observe(now - job.arrived)
            else:
                self.metrics.itl.observe(now - job.last_emit)
            job.last_emit = now
            self._send(job, TextPiece(piece, logprobs, tuple(seq.prompt_logprobs) if first else ()))
        if seq.done:
            del self.running[id(seq)]
            self._gauges()                  # before the client hears it is done: a scrape then sees it gone
            self.metrics.e2e.observe(now - job.arrived)
            self.metrics.record_speculation(seq)
            if job.engine is not None:
                proposer = job.engine.proposer
                self._learn(lambda: self.learner.finished(proposer, seq))
            self._send(job, Done(seq.text, seq.finish_reason, len(seq.request.prompt), len(seq.generated),
                                 speculation_report(seq, job.spec, self.pool.gen.policy_name), tuple(seq.logprobs),
                                 tuple(seq.prompt_logprobs)))
            self._close(job)

    def _fail_engine(self, eng: Engine, message: str) -> None:
        failed = [self.running.pop(key) for key, job in list(self.running.items()) if job.engine is eng]
        self._gauges()
        for job in failed:
            self._fail(job, message, 500)
        self.pool.reset(eng)

    def _fail(self, job: Job, message: str, status: int, code: str | None = None) -> None:
        if job in self.waiting:
            self.waiting.remove(job)
        self._send(job, Failed(message, status, code))
        self._close(job)

    def _close(self, job: Job) -> None:
        if not job.finished:
            job.finished = True
            with self.lock:
                self.outstanding -= 1

    def _send(self, job: Job, event: Event) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, replace(event, choice=job.choice))
        except RuntimeError:            # the event loop is closed: nobody is listening any more
            pass

    def _gauges(self) -> None:
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.waiting))

