"""Where one decoding (or verification) forward's time goes, on this machine.

Prefills a prompt, then runs N forwards of `--rows` tokens each (1: plain decoding; K+1: verifying
a chain of K drafts) through the target and its LM head, as the engine does, and prints per forward:

- the wall time without the profiler (median of the forwards), and under torch.profiler:
- the linear kernels of the layers (int4 `_weight_int4pack_mm_for_cpu`, oneDNN, F.linear),
- the LM head, attention (the native kernel `native.Attend`: rope, cache writes and attention, or `attention.attention` without it),
- the native layer loop (`native.LayerLoop`: every layer's linears, attention and norms in one call, where it runs),
  and everything else,
- the number of profiler events (aten ops) per forward and the most frequent ones.

The profiler adds a few microseconds per op, so its total exceeds the plain wall time; the split
shows where the time goes, the plain figure what a user gets. Without the profiler's bias, the script
also records every kernel call of one forward (the layers' linear kernels, the LM head, the native
attention) with its inputs and replays them alone, back to back: the wall time minus that replay is
the time outside the kernels.

    .venv/bin/python benchmarks/profile_token.py smollm2-135m --dtype q4 --threads 1 --tokens 32
    .venv/bin/python benchmarks/profile_token.py smollm2-135m --dtype q4 --rows 5      # a 4-draft verification
    .venv/bin/python benchmarks/profile_token.py smollm2-135m --dtype q4 --head int4   # force an LM head kernel
    SPECDEC_ISA=avx2 .venv/bin/python benchmarks/profile_token.py smollm2-135m --dtype q4
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable

import specdec  # (applies $SPECDEC_ISA before torch computes)
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from specdec.api import load_model
from specdec.machine import cpu_model, probe
from specdec.models import decoder
from specdec.models.kernels import pack

LINEAR_OPS = ("aten::_weight_int4pack_mm_for_cpu", "mkldnn::_linear_pointwise", "aten::linear", "aten::addmm",
              "aten::mm", "aten::matmul")
LABELS = ("forward", "lm_head", "attention", "layer loop")  # record_function labels this script adds


def labelled(fn: Callable, label: str) -> Callable:
    """fn, its calls marked `label` in the profile."""
    def run(*args, **kw):
        with record_function(label):
            return fn(*args, **kw)
    return run


STEP_PROMPT = "Write a very long story about a dragon and a knight, with many chapters."   # engine steps' prompt


class StandIn:
    """A callable standing in for `fn` (a native layer loop, an LM head), with what the decoder reads of a layer
    loop (its max_rows and dtype, and its `normed` call: the last layers and the final norm) where `fn` has it;
    both calls go through `_run`."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        for name in ("max_rows", "dtype"):
            if hasattr(fn, name):
                setattr(self, name, getattr(fn, name))

    def __call__(self, *args):
        return self._run(self.fn, *args)

    def normed(self, *args):
        return self._run(self.fn.normed, *args)

    def _run(self, fn: Callable, *args):
        raise NotImplementedError


class LabelledLoop(StandIn):
    """A native layer loop whose calls are marked "layer loop" in the profile (the kernels it runs are not
    recorded by the profiler: they bypass the dispatcher)."""

    def _run(self, fn: Callable, *args):
        with record_function("layer loop"):
            return fn(*args)


class Run:
    """A model, a cache holding a prompt, and forwards of `rows` tokens after it."""

    def __init__(self, model, prompt: int, rows: int, tokens: int) -> None:
        self.model, self.rows = model, rows
        self.cache = model.new_cache(1, prompt + rows * (tokens + 4) + 8)
        self.row = torch.tensor([0])
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.vocab_size, (1, prompt), generator=g)
        pos = torch.arange(prompt)[None]
        model.prefill(ids, pos, self.cache, self.row)
        self.cache.commit(self.row, pos, torch.tensor([prompt]))
        self.next = torch.randint(0, model.vocab_size, (1, rows), generator=g)

    @torch.inference_mode()
    def step(self) -> None:
        """One forward of `rows` tokens, the head, the argmax; the first row committed, as a verification whose
        first draft is rejected commits one token: the context grows by one per forward whatever `rows`, so
        the forwards timed, profiled and replayed see about the same keys."""
        at = int(self.cache.lengths[0])
        pos = torch.arange(at, at + self.rows)[None]                          # [1, rows]
        with record_function("forward"):
            hidden = self.model(self.next, pos, self.cache, self.row)         # [1, rows, H]
            logits = self.model.lm_head(hidden)                               # [1, rows, V]
            self.next = torch.cat([self.next[:, 1:], logits[:, -1:].argmax(-1)], 1)
        self.cache.commit(self.row, torch.arange(1)[None], torch.tensor([1]))


def split(prof, n: int) -> tuple[dict[str, float], float, collections.Counter]:
    """(ms per forward by part, profiler events per forward, op counts) from the profiled forwards."""
    parts = dict.fromkeys(("linear kernels", "LM head", "attention", "layer loop", "rest"), 0.0)
    ops: collections.Counter = collections.Counter()
    total = 0.0
    for e in prof.events():
        if e.name == "forward":
            total += e.cpu_time_total
            continue
        if e.name in LABELS[1:]:
            parts[{"lm_head": "LM head", "attention": "attention"}.get(e.name, e.name)] += e.cpu_time_total
            continue
        ops[e.name] += 1
        up, inside = e.cpu_parent, False
        while up is not None:
            if up.name in LABELS[1:] or up.name in LINEAR_OPS:
                inside = True
                break
            up = up.cpu_parent
        if e.name in LINEAR_OPS and not inside:
            parts["linear kernels"] += e.cpu_time_total
    parts["rest"] = total - sum(parts.values())
    return {k: v / 1000 / n for k, v in parts.items()}, ops.total() / n, ops


class Recorder:
    """Kernel calls of one forward with copies of their inputs, to replay them alone."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[tuple[str, Callable, tuple]] = []

    def wrap(self, fn: Callable, kind: str) -> Callable:
        def run(*args):
            if self.on:
                self.calls.append((kind, fn, tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in args)))
            return fn(*args)
        return run

    def kernel(self, k, kind: str):
        """A Kernel (linear layer) whose calls are recorded under `kind`; it keeps the kernel's attributes."""
        rec = self

        class Recorded:
            dtype, check, pair = k.dtype, k.check, k.pair

            def __call__(self, x):
                return rec.wrap(k, kind)(x)
        return Recorded()

    @torch.inference_mode()
    def replay(self, repeats: int) -> tuple[float, dict[str, float]]:
        """Median seconds of the recorded calls run back to back, and of each kind's calls within them."""
        times, by_kind = [], {kind: [] for kind, _, _ in self.calls}
        for _ in range(repeats):
            parts = dict.fromkeys(by_kind, 0.0)
            t = time.perf_counter()
            for kind, fn, args in self.calls:
                t0 = time.perf_counter()
                fn(*args)
                parts[kind] += time.perf_counter() - t0
            times.append(time.perf_counter() - t)
            for kind, sec in parts.items():
                by_kind[kind].append(sec)
        return statistics.median(times), {kind: statistics.median(v) for kind, v in by_kind.items()}


def kernel_replay(model, run: "Run", repeats: int) -> tuple[float, dict[str, float], int]:
    """(median seconds of one forward's kernels replayed alone, of each kind's (a linear's name, "attention"),
    kernel calls per forward). The forward recorded runs its layers from Python (the native layer loop calls the
    same kernels in the same order)."""
    rec = Recorder()
    loop, model.loop = model.loop, None
    tables = [model.packed] + [layer.packed for layer in model.layers]
    saved = [dict(t) for t in tables]
    attend = decoder.native.Attend.__call__
    for t in tables:
        for name, k in list(t.items()):
            t[name] = rec.kernel(k, name)
    decoder.native.Attend.__call__ = rec.wrap(attend, "attention")
    rec.on = True
    run.step()
    rec.on = False
    for t, s in zip(tables, saved):
        t.clear()
        t.update(s)
    decoder.native.Attend.__call__ = attend
    model.loop = loop
    return (*rec.replay(repeats), len(rec.calls))


class Timed(StandIn):
    """`fn`, its calls' wall time added up in `seconds`."""

    seconds = 0.0

    def _run(self, fn: Callable, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t


def engine_step(model: str, dtype: str, tokens: int, python_layers: bool) -> tuple[float, float, float]:
    """Per decoding step of the engine itself (`none`, greedy, through `specdec.load`): the wall time, the time in
    the layer loop and in the LM head (seconds). A generation of one token (the prompt's prefill and its first
    token) is subtracted from one of 1 + `tokens`, twice, so the prefill does not count."""
    gen = specdec.load(model, method="none", dtype=dtype, draft_policy="fixed")
    target = gen.target
    if python_layers:
        target.loop = None
    prompt = STEP_PROMPT
    gen.generate(prompt, max_new_tokens=8)                                     # warm-up
    loop = target.loop = Timed(target.loop) if target.loop is not None else None
    heads = target.lm_head, target.lm_head_top = Timed(target.lm_head), Timed(target.lm_head_top)  # the greedy
    per = []                                                                    # tokens' argmax in the head's call
    for _ in range(2):
        runs = []
        for n in (1, 1 + tokens):
            before = (loop.seconds if loop else 0.0, sum(h.seconds for h in heads))
            t = time.perf_counter()
            gen.generate(prompt, max_new_tokens=n)
            runs.append((time.perf_counter() - t, (loop.seconds if loop else 0.0) - before[0],
                         sum(h.seconds for h in heads) - before[1], len(gen.last_result.tokens)))
        (w0, l0, h0, n0), (w1, l1, h1, n1) = runs
        per.append(((w1 - w0) / (n1 - n0), (l1 - l0) / (n1 - n0), (h1 - h0) / (n1 - n0)))
    return tuple(statistics.mean(v) for v in zip(*per))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--tokens", type=int, default=32, help="forwards timed (and as many profiled)")
    ap.add_argument("--rows", type=int, default=1, help="tokens per forward (K+1 to verify K drafts)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens before the first forward")
    ap.add_argument("--top", type=int, default=12, help="most frequent ops to list")
    ap.add_argument("--head", choices=("chosen", "dense", "int4"), default="chosen",
                    help="the LM head kernel: the one chosen on this machine, or force one of the candidates")
    ap.add_argument("--step-tokens", type=int, default=128,
                    help="tokens of the engine's own decoding (`none`, greedy) timed per step (0: skip)")
    ap.add_argument("--python-layers", action="store_true",
                    help="run the layers from Python even where the native layer loop is available")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, _, _ = load_model(a.model, a.dtype)
    m = probe()
    if a.head == "dense":
        model.packed["lm_head"] = pack(model.output if model.output.numel() else model.embed)
    elif a.head == "int4":
        model.packed["lm_head"] = model.head_kernels["int4"]
    if a.python_layers:
        model.loop = None
    run = Run(model, a.prompt, a.rows, 4 * a.tokens + 8)
    for _ in range(4):
        run.step()                                                            # warm-up
    times = []
    for _ in range(a.tokens):
        t = time.perf_counter()
        run.step()
        times.append(time.perf_counter() - t)
    replayed, by_kind, n_calls = kernel_replay(model, run, a.tokens)                  # mid-run: the keys of a typical forward
    decoder.attention = labelled(decoder.attention, "attention")
    decoder.native.Attend.__call__ = labelled(decoder.native.Attend.__call__, "attention")
    model.lm_head = labelled(model.lm_head, "lm_head")
    if model.loop is not None:
        model.loop = LabelledLoop(model.loop)                    # its kernels run unseen by the profiler
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.tokens):
            run.step()
    for _ in range(a.tokens):                                                 # timed again: noise hits both halves
        t = time.perf_counter()
        run.step()
        times.append(time.perf_counter() - t)
    parts, n_ops, ops = split(prof, a.tokens)

    head = model.packed["lm_head"]
    print(f"{a.model} {model.compute} (LM head: {type(head).__name__} {str(head.dtype).removeprefix('torch.')}), "
          f"{a.threads} thread(s), layers run {'from Python' if model.loop is None else 'by the native loop'}, "
          f"{a.rows} row(s) per forward, {a.tokens} forwards after {a.prompt} prompt tokens")
    print(f"CPU: {cpu_model()}, torch {torch.__version__} kernels {m.torch_capability}"
          f"{', ISA limit ' + m.isa_limit if m.isa_limit else ''}")
    wall = statistics.median(times) * 1000
    print(f"wall time per forward (no profiler): median {wall:.2f} ms, fastest {min(times) * 1000:.2f} ms "
          f"({1000 / wall * a.rows:.1f} rows/s at the median)")
    outside = wall - replayed * 1000
    where = (f"outside them {outside:.2f} ms = {100 * outside / wall:.1f}% of the forward" if outside > 0 else
             "nothing measurable outside them (each replayed call pays its own Python entry)")
    print(f"kernels replayed alone ({n_calls} calls: linears, LM head, attention): {replayed * 1000:.2f} ms; {where}")
    print("  replayed, by kind: " + ", ".join(f"{kind} {sec * 1000:.2f} ms" for kind, sec in by_kind.items()))
    profiled = sum(parts.values())
    print(f"under the profiler: {profiled:.2f} ms per forward")
    for k, v in parts.items():
        print(f"  {k:<15} {v:7.2f} ms  {100 * v / profiled:5.1f}%")
    print(f"profiler events per forward: {n_ops:.0f}; most frequent:")
    for name, c in ops.most_common(a.top):
        print(f"  {c / a.tokens:7.1f}  {name}")
    if a.step_tokens > 0:
        wall, loop, head = (1000 * v for v in engine_step(a.model, a.dtype, a.step_tokens, a.python_layers))
        kernels = loop + head
        print(f"a decoding step of the engine (`none`, greedy, {a.step_tokens} tokens after the README's prompt, "
              f"prefill subtracted): {wall:.2f} ms per token; "
              + (f"layer loop {loop:.2f} ms, LM head {head:.2f} ms, the rest (the engine's Python and ATen calls, the "
                 f"forward's set-up) {wall - kernels:.2f} ms = {100 * (wall - kernels) / wall:.1f}% of the step"
                 if loop else f"LM head {head:.2f} ms (the layers run from Python: not split further)"))


if __name__ == "__main__":
    main()
