"""Spec-Bench-style runner: every method (and peer) on every prompt, interleaved, then summarised.

For each repeat and each prompt, every system generates back to back, so machine noise hits all
of them alike. A *system* is anything with ``name``, ``kind`` ("method" or "peer") and
``generate(ids, max_new_tokens, params) -> Generation``: our methods are :class:`MethodSystem`
(one :class:`~specdec.api.Generator` each, all sharing one loaded target), peers live in
:mod:`specdec.bench.peers`.

Multi-turn prompts (MT-Bench) are run turn by turn: the second turn's chat contains the system's
own first answer.

Summary per method x category (and ``overall``):

* ``tokens_per_second``: median over (prompt, repeat) runs;
* ``speedup``: median over (prompt, repeat) of tokens/s(method) / tokens/s(none) from the *same*
  repeat (measured back to back); ``speedup_total`` is the ratio of summed throughputs
  (sum tokens / sum seconds) for reference;
* ``tau``: total new tokens / total target forwards; ``acceptance_rate``: accepted / drafted;
  ``acceptance_per_position``: per draft position, accepted / drafted, pooled over all runs;
* greedy only: ``equal`` - every output equals ``none``'s for the same prompt and repeat.
  A mismatch is a failure (``results["ok"]`` is False).

Peers with ``yardstick = True`` (llama.cpp's plain decoding, high-level and its own decode loop) are one
engine's plain speed measured two ways: ``summary["yardstick"]`` names the faster of them overall (the one
every method is compared with) and counts the runs where they all gave the same tokens.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from ..api import METHODS, Generator, check_draft_source, make_proposer, sample_drafts_from
from ..names import DEFAULT_SAMPLE_DRAFTS, DRAFTLESS, SAMPLE_DRAFTS
from ..engine import Request, scratch_slots
from ..errors import Interrupted, SpecdecError, terminate_as_interrupt
from ..machine import cpu_model
from ..metrics import Counters
from ..names import did_you_mean
from ..models.base import CausalLM
from ..sampling import SamplingParams
from ..tree import TreeShape
from .suites import Prompt

SCHEMA = "specdec-bench/1"
BASELINE = "none"
FALLBACK_DRAFT = "self:10"
WARMUP_TOKENS = 8
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "GOMP_SPINCOUNT",   # what a run's speed hangs on:
              "SPECDEC_ISA", "SPECDEC_NATIVE")                                          # recorded and in its command


# --------------------------------------------------------------------------- method specs


@dataclass(frozen=True)
class MethodSpec:
    """One benchmarked method: ``label`` as given (``draft`` or ``draft=self:8``), the method and its draft."""

    label: str
    method: str
    draft: str | None
    policy: str = ""              # draft-length policy; "" = the run's --draft-policy
    tree: TreeShape = TreeShape()  # EAGLE's draft shape (``eagle:4x16``)
    sample_drafts: str = DEFAULT_SAMPLE_DRAFTS   # the EAGLE chains' draft sampling (``eagle3@sample=on``)


def default_draft(model_name: str) -> str:
    """The draft used by ``draft`` when none is given: ``specdec.api.DEFAULT_DRAFT[model]`` or self:10."""
    from .. import api

    registered = getattr(api, "DEFAULT_DRAFT", None)
    if isinstance(registered, dict) and registered.get(model_name):
        return str(registered[model_name])
    return FALLBACK_DRAFT


def parse_methods(specs: str | Sequence[str], draft_model: str | None) -> list[MethodSpec]:
    """Method specs (comma-separated or a list) -> MethodSpecs, ``none`` first (added if missing).

    ``NAME`` uses ``draft_model`` for the ``draft`` method and no draft otherwise; ``NAME=DRAFT``
    gives a method its own draft (e.g. ``draft=self:8``), so one method can be compared with itself;
    a ``@POLICY`` suffix gives it its own draft-length policy (``ngram@auto`` next to ``ngram``);
    ``NAME:TOPKxBUDGET`` an EAGLE draft tree (``eagle:4x16`` next to the chain ``eagle``); a
    ``@sample=on|off|auto`` suffix the EAGLE chain's draft sampling (``eagle3@sample=off`` next to ``eagle3``,
    which samples as ``specdec.load`` does by default). Suffixes combine: ``eagle3@auto@sample=on``.
    ``lookahead=W,N,G`` gives lookahead its shape (``none,lookahead=2,3,2,ngram``).
    """
    from ..draft_length import POLICIES

    items: list[str] = []
    for s in (specs.split(",") if isinstance(specs, str) else specs):
        s = s.strip()
        if s.isdecimal() and items and items[-1].startswith("lookahead="):
            items[-1] += f",{s}"                  # lookahead's shape W,N,G: its commas do not part methods
        elif s:
            items.append(s)
    if not items:
        raise SpecdecError(f"no methods given; choose from: {', '.join(METHODS)}")
    out: list[MethodSpec] = []
    for item in items:
        body, *settings = item.split("@")
        method, given, draft = body.partition("=")
        method, _, shape = method.partition(":")
        if given and not draft:
            raise SpecdecError(f"{item!r} gives an empty draft; write NAME=DRAFT (e.g. draft=self:8) or NAME")
        if draft and method in DRAFTLESS:
            raise SpecdecError(f"method {method!r} drafts from the context and takes no draft ({item!r})")
        tree = TreeShape.parse(shape) if shape else TreeShape()
        if shape and method not in ("eagle", "eagle3"):
            raise SpecdecError(f"a tree shape ({item!r}) applies to eagle and eagle3 only")
        if method not in METHODS:
            raise SpecdecError(f"unknown method {method!r}; {did_you_mean(method, METHODS)}choose from: "
                               f"{', '.join(METHODS)}")
        policy, sample = "", ""
        for setting in settings:
            key, eq, value = setting.partition("=")
            if (eq and key == "sample" and sample) or (not eq and policy):
                raise SpecdecError(f"{item!r} sets its {'draft sampling' if eq else 'draft policy'} twice")
            if eq and key == "sample" and value in SAMPLE_DRAFTS:
                sample = value
                sample_drafts_from(sample, method, tree)          # `on` where it does not apply fails here
            elif eq:
                raise SpecdecError(f"unknown setting {setting!r} in {item!r}; choose a draft policy "
                                   f"({', '.join(POLICIES)}) or sample={'|'.join(SAMPLE_DRAFTS)}")
            elif setting in POLICIES:
                policy = setting
            else:
                raise SpecdecError(f"unknown draft policy {setting!r} in {item!r}; choose from: {', '.join(POLICIES)}"
                                   f" (or sample={'|'.join(SAMPLE_DRAFTS)})")
        if not draft:
            draft = draft_model if method == "draft" else None
        if draft:
            check_draft_source(method, draft)
        if any(s.label == item for s in out):
            raise SpecdecError(f"method {item!r} is given twice")
        out.append(MethodSpec(item, method, draft or None, policy, tree, sample or DEFAULT_SAMPLE_DRAFTS))
    if not any(s.label == BASELINE for s in out):
        out.insert(0, MethodSpec(BASELINE, BASELINE, None))
    out.sort(key=lambda s: s.label != BASELINE)
    return out


# --------------------------------------------------------------------------- systems


@dataclass
class Generation:
    """One generation: the new tokens (EOS included when it ended them), wall seconds, engine counters."""

    tokens: list[int]
    seconds: float
    counters: Counters | None


class System(Protocol):
    name: str
    kind: str

    def generate(self, ids: list[int], max_new_tokens: int, params: SamplingParams,
                 prediction: str = "") -> Generation: ...

    def forget(self) -> None:
        """Drop what earlier generations taught it (nothing of one run may help a later run of the same prompt)."""
        ...


class MethodSystem:
    """One of our methods: a Generator run through its engine for exactly one prompt."""

    kind = "method"

    def __init__(self, name: str, generator: Generator) -> None:
        self.name, self.generator = name, generator

    def generate(self, ids: list[int], max_new_tokens: int, params: SamplingParams,
                 prediction: str = "") -> Generation:
        """`prediction` (the edit category's) drafts for every method but `none`, the plain baseline."""
        gen = self.generator
        slots = len(ids) + max_new_tokens + scratch_slots(gen.num_draft_tokens)
        predicted = gen.prediction_ids(prediction) if gen.method != "none" else ()
        start = time.perf_counter()
        eng = gen.engine(1, slots)
        seq = eng.add(Request(list(ids), max_new_tokens, params, prediction=predicted))
        with torch.inference_mode():
            while eng.busy:
                eng.step()
        return Generation(list(seq.generated), time.perf_counter() - start, seq.counters)

    def forget(self) -> None:
        self.generator.proposer.forget()


def build_systems(target: CausalLM, tokenizer, specs: Sequence[MethodSpec], dtype: str, device: str,
                  num_draft_tokens: int, draft_policy: str, name: str) -> list[MethodSystem]:
    """One Generator per method spec, all sharing ``target`` (loaded once)."""
    systems = []
    for spec in specs:
        proposer = make_proposer(spec.method, target, tokenizer, spec.draft, dtype, device, spec.tree,
                                 spec.sample_drafts)
        gen = Generator(target, tokenizer, proposer, spec.policy or draft_policy, num_draft_tokens, name)
        systems.append(MethodSystem(spec.label, gen))
    return systems


# --------------------------------------------------------------------------- running


class ChatTokenizer(Protocol):
    eos_ids: frozenset[int]
    has_chat_template: bool

    def encode(self, text: str, chat: bool) -> list[int]: ...
    def encode_chat(self, messages: list[dict]) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


def turn_ids(tokenizer: ChatTokenizer, turns: Sequence[str], answers: Sequence[str]) -> list[int]:
    """Prompt ids for the last of ``turns``, after the earlier turns and their ``answers``."""
    messages: list[dict] = []
    for index, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if index < len(turns) - 1:
            messages.append({"role": "assistant", "content": answers[index]})
    if tokenizer.has_chat_template:
        return tokenizer.encode_chat(messages)
    return tokenizer.encode("\n\n".join(m["content"] for m in messages), False)


def _strip_eos(tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in eos_ids else tokens


def run_prompt(system: System, prompt: Prompt, tokenizer: ChatTokenizer, params: SamplingParams) -> list[Generation]:
    """Every turn of ``prompt`` on ``system``; later turns see the system's own earlier answers."""
    answers: list[str] = []
    out: list[Generation] = []
    for index in range(len(prompt.turns)):
        ids = turn_ids(tokenizer, prompt.turns[: index + 1], answers)
        result = system.generate(ids, prompt.max_new_tokens, params, prompt.prediction)
        answers.append(tokenizer.decode(_strip_eos(result.tokens, tokenizer.eos_ids)))
        out.append(result)
    return out


def _rates(accepted_at: list[int], drafted_at: list[int]) -> list[float]:
    return [a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at)]


def run_record(system: System, prompt: Prompt, repeat: int, turns: list[Generation]) -> dict:
    """The raw record of one (system, prompt, repeat) run, all turns pooled."""
    new_tokens = sum(len(t.tokens) for t in turns)
    seconds = sum(t.seconds for t in turns)
    record = {
        "system": system.name, "kind": system.kind, "prompt_id": prompt.id, "category": prompt.category,
        "repeat": repeat, "tokens": [t.tokens for t in turns], "turn_seconds": [t.seconds for t in turns],
        "new_tokens": new_tokens, "seconds": seconds,
        "tokens_per_second": new_tokens / seconds if seconds > 0 else 0.0,
    }
    counters = [t.counters for t in turns if t.counters is not None]
    if len(counters) != len(turns):
        return record
    total = Counters()
    for c in counters:
        total.merge(c)
    drafted_at, accepted_at = total.own()                  # the method's own drafts; the prediction's apart
    drafted, accepted = sum(drafted_at), sum(accepted_at)
    record.update({
        "target_forwards": total.target_forwards, "drafted": drafted, "accepted": accepted,
        "drafted_at": drafted_at, "accepted_at": accepted_at,
        "accepted_prediction": total.accepted_prediction, "rejected_prediction": total.rejected_prediction,
        "draft_seconds": total.draft_seconds, "target_seconds": total.target_seconds,
        "tau": total.new_tokens / total.target_forwards if total.target_forwards else 0.0,
        "acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_per_position": _rates(accepted_at, drafted_at),
    })
    return record


def sampling_params(base: SamplingParams, repeat: int, prompt_index: int) -> SamplingParams:
    """`base` with the seed of a (prompt, repeat): the same for every system."""
    return replace(base, seed=base.seed + 100_003 * repeat + prompt_index)


def warm_up(systems: Sequence[System], prompts: Sequence[Prompt], tokenizer: ChatTokenizer) -> None:
    """One short untimed generation per system (first-call costs: weight packing, allocator)."""
    if not prompts:
        return
    ids = turn_ids(tokenizer, prompts[0].turns[:1], [])
    for system in systems:
        system.generate(ids, WARMUP_TOKENS, SamplingParams())


class BenchInterrupted(Interrupted):
    """Ctrl-C or SIGTERM during a run: `records` holds the runs of every (repeat, prompt) all systems finished."""

    def __init__(self, records: list[dict]) -> None:
        super().__init__("interrupted")
        self.records = records


def run(systems: Sequence[System], prompts: Sequence[Prompt], tokenizer: ChatTokenizer, repeats: int = 1,
        sampling: SamplingParams = SamplingParams(), progress: bool = True, warmup: bool = True) -> list[dict]:
    """Raw run records: for each repeat, for each prompt, every system back to back, sampling as `sampling` says
    (its seed varied per prompt and repeat). Interrupted (Ctrl-C, SIGTERM): BenchInterrupted with the records of
    the prompts every system finished."""
    from tqdm import tqdm

    if repeats < 1:
        raise SpecdecError(f"repeats must be >= 1, got {repeats}")
    if warmup:
        warm_up(systems, prompts, tokenizer)
    records: list[dict] = []
    total = repeats * len(prompts) * len(systems)
    try:
        with terminate_as_interrupt(), tqdm(total=total, desc="bench", unit="gen", disable=not progress,
                                            file=sys.stderr, dynamic_ncols=True) as bar:
            for repeat in range(repeats):
                for system in systems:
                    system.forget()                  # the warm-up's and earlier repeats' outputs draft nothing
                for index, prompt in enumerate(prompts):
                    params = sampling_params(sampling, repeat, index)
                    for system in systems:
                        bar.set_postfix_str(f"r{repeat + 1} {prompt.id} {system.name}", refresh=False)
                        turns = run_prompt(system, prompt, tokenizer, params)
                        records.append(run_record(system, prompt, repeat, turns))
                        bar.update()
    except KeyboardInterrupt:
        raise BenchInterrupted(records[:len(records) - len(records) % len(systems)]) from None
    return records


# --------------------------------------------------------------------------- summary


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _key(record: dict) -> tuple[str, int]:
    return record["prompt_id"], record["repeat"]


def _ratios(numer: list[dict], denom: list[dict]) -> list[float]:
    """tokens/s(numer) / tokens/s(denom) for each (prompt, repeat) both ran."""
    base = {_key(r): r["tokens_per_second"] for r in denom}
    return [r["tokens_per_second"] / base[_key(r)] for r in numer if base.get(_key(r))]


def _throughput(records: list[dict]) -> float:
    seconds = sum(r["seconds"] for r in records)
    return sum(r["new_tokens"] for r in records) / seconds if seconds > 0 else 0.0


def first_difference(a: list[list[int]], b: list[list[int]]) -> dict | None:
    """Where two multi-turn outputs first differ (turn, token index), or None when equal."""
    if a == b:
        return None
    for turn, (x, y) in enumerate(zip(a, b)):
        if x != y:
            index = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            return {"turn": turn, "index": index, "lengths": [len(x), len(y)]}
    return {"turn": min(len(a), len(b)), "index": 0, "lengths": [len(a), len(b)]}


def mismatches(records: list[dict], baseline: list[dict]) -> list[dict]:
    """Runs whose tokens differ from the baseline's for the same prompt and repeat."""
    base = {_key(r): r for r in baseline}
    out = []
    for r in records:
        ref = base.get(_key(r))
        diff = None if ref is None else first_difference(ref["tokens"], r["tokens"])
        if diff is not None:
            out.append({"system": r["system"], "prompt_id": r["prompt_id"], "repeat": r["repeat"], **diff})
    return out


def _pooled(records: list[dict]) -> dict:
    """tau, acceptance and the share of the time spent drafting, pooled over runs that carry engine counters."""
    counted = [r for r in records if "target_forwards" in r]
    if not counted:
        return {"tau": None, "acceptance_rate": None, "acceptance_per_position": [], "prediction_drafts": 0,
                "prediction_acceptance": None, "draft_share": None}
    timed = [r for r in counted if "draft_seconds" in r]          # results written before it was recorded: none
    seconds = sum(r["seconds"] for r in timed)
    forwards = sum(r["target_forwards"] for r in counted)
    drafted = sum(r["drafted"] for r in counted)
    width = max(len(r["drafted_at"]) for r in counted)
    drafted_at = [sum(r["drafted_at"][i] for r in counted if i < len(r["drafted_at"])) for i in range(width)]
    accepted_at = [sum(r["accepted_at"][i] for r in counted if i < len(r["accepted_at"])) for i in range(width)]
    predicted = sum(r.get("accepted_prediction", 0) + r.get("rejected_prediction", 0) for r in counted)
    return {
        "tau": sum(r["new_tokens"] for r in counted) / forwards if forwards else 0.0,
        "acceptance_rate": sum(r["accepted"] for r in counted) / drafted if drafted else None,
        "acceptance_per_position": _rates(accepted_at, drafted_at),
        "prediction_drafts": predicted,
        "prediction_acceptance": (sum(r.get("accepted_prediction", 0) for r in counted) / predicted
                                  if predicted else None),
        "draft_share": sum(r["draft_seconds"] for r in timed) / seconds if timed and seconds > 0 else None,
    }


def _method_cell(runs: list[dict], base: list[dict], greedy: bool) -> dict:
    wrong = mismatches(runs, base) if greedy else []
    cell = {
        "runs": len(runs),
        "prompts": len({r["prompt_id"] for r in runs}),
        "new_tokens": sum(r["new_tokens"] for r in runs),
        "tokens_per_second": _median([r["tokens_per_second"] for r in runs]),
        "speedup": _median(_ratios(runs, base)),
        "speedup_total": _throughput(runs) / _throughput(base) if _throughput(base) else None,
        **_pooled(runs),
        "equal": (not wrong) if greedy else None,
        "mismatches": len(wrong) if greedy else None,
        "mismatch_ids": sorted({m["prompt_id"] for m in wrong}) if greedy else None,
    }
    return cell


def _peer_cell(runs: list[dict], ours: dict[str, list[dict]], baseline: list[dict]) -> dict:
    differ = mismatches(runs, baseline)
    return {
        "runs": len(runs),
        "tokens_per_second": _median([r["tokens_per_second"] for r in runs]),
        "same_output": len(runs) - len(differ),
        "same_output_fraction": (len(runs) - len(differ)) / len(runs) if runs else None,
        "speedup_of": {name: _median(_ratios(recs, runs)) for name, recs in ours.items()},
    }


def _by(records: list[dict], system: str, category: str | None) -> list[dict]:
    return [r for r in records if r["system"] == system and (category is None or r["category"] == category)]


def nondeterministic(records: list[dict]) -> list[dict]:
    """(system, prompt) pairs whose outputs differ between repeats (greedy should never do that)."""
    first: dict[tuple[str, str], list[list[int]]] = {}
    out = []
    for r in records:
        key = (r["system"], r["prompt_id"])
        if key not in first:
            first[key] = r["tokens"]
        elif r["tokens"] != first[key]:
            out.append({"system": r["system"], "prompt_id": r["prompt_id"], "repeat": r["repeat"]})
    return out


def yardstick_summary(records: list[dict], yardsticks: Sequence[str]) -> dict:
    """The fastest of the ``yardsticks`` peers overall (median tokens/s) and how many (prompt, repeat) runs
    they all answered with the same tokens; {} without yardsticks."""
    if not yardsticks:
        return {}
    speed = {name: _median([r["tokens_per_second"] for r in _by(records, name, None)]) or 0.0 for name in yardsticks}
    outputs: dict[tuple[str, int], list[list[list[int]]]] = {}
    for r in records:
        if r["system"] in yardsticks:
            outputs.setdefault(_key(r), []).append(r["tokens"])
    agree = sum(len(outs) == len(yardsticks) and all(o == outs[0] for o in outs) for outs in outputs.values())
    return {"peers": list(yardsticks), "fastest": max(yardsticks, key=lambda n: speed[n]),
            "tokens_per_second": speed, "same_output": agree, "runs": len(outputs)}


def summarize(records: list[dict], methods: Sequence[str], peers: Sequence[str], categories: Sequence[str],
              greedy: bool, yardsticks: Sequence[str] = ()) -> dict:
    """Per method and per peer, per category and ``overall``: the numbers the report shows."""
    if BASELINE not in methods:
        raise SpecdecError(f"the summary needs the {BASELINE!r} baseline among the methods")
    columns = [*categories, "overall"]
    summary: dict = {"methods": {}, "peers": {}}
    for col in columns:
        cat = None if col == "overall" else col
        base = _by(records, BASELINE, cat)
        for name in methods:
            summary["methods"].setdefault(name, {})[col] = _method_cell(_by(records, name, cat), base, greedy)
        ours = {name: _by(records, name, cat) for name in methods}
        for name in peers:
            summary["peers"].setdefault(name, {})[col] = _peer_cell(_by(records, name, cat), ours, base)
    wrong = mismatches([r for r in records if r["kind"] == "method"], _by(records, BASELINE, None)) if greedy else []
    summary["equality"] = {
        "checked": greedy,
        "failures": len(wrong),
        "failed_ids": sorted({f"{m['system']}:{m['prompt_id']}" for m in wrong}),
        "mismatches": wrong,
        "nondeterministic": nondeterministic(records) if greedy else [],
    }
    summary["yardstick"] = yardstick_summary(records, yardsticks)
    return summary


# --------------------------------------------------------------------------- machine and results


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info(dtype: str) -> dict:
    """CPU, threads, library versions, dtype and date of this run."""
    import transformers

    return {
        "cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "platform": platform.platform(), "dtype": dtype,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "git_commit": _git_commit(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
    }


def prompt_table(prompts: Sequence[Prompt]) -> list[dict]:
    return [{"id": p.id, "category": p.category, "turns": list(p.turns), "max_new_tokens": p.max_new_tokens}
            for p in prompts]


def categories_of(prompts: Sequence[Prompt]) -> list[str]:
    """Categories in first-seen order."""
    return list(dict.fromkeys(p.category for p in prompts))


def benchmark(systems: Sequence[System], prompts: Sequence[Prompt], tokenizer: ChatTokenizer, config: dict,
              machine: dict, command: str, repeats: int = 1, sampling: SamplingParams = SamplingParams(),
              progress: bool = True, warmup: bool = True) -> dict:
    """Run everything and return the full results object (config, machine, prompts, raw runs, summary)."""
    if not prompts:
        raise SpecdecError("no prompts to benchmark")
    methods = [s.name for s in systems if s.kind == "method"]
    peers = [s.name for s in systems if s.kind == "peer"]
    yardsticks = [s.name for s in systems if s.kind == "peer" and getattr(s, "yardstick", False)]
    started = time.perf_counter()
    planned = repeats * len(prompts) * len(systems)
    try:
        records = run(systems, prompts, tokenizer, repeats, sampling, progress, warmup)
    except BenchInterrupted as stop:
        if not stop.records:
            raise Interrupted("no prompt was finished by every system; nothing to report") from None
        records = stop.records
        done = {r["prompt_id"] for r in records}
        prompts = [p for p in prompts if p.id in done]
    greedy = sampling.greedy
    summary = summarize(records, methods, peers, categories_of(prompts), greedy, yardsticks)
    return {
        "schema": SCHEMA,
        "command": command,
        "config": {**config, "repeats": repeats, "temperature": sampling.temperature, "top_k": sampling.top_k,
                   "top_p": sampling.top_p, "seed": sampling.seed, "greedy": greedy,
                   "methods": methods, "peers": peers, "categories": categories_of(prompts),
                   "chat_template": tokenizer.has_chat_template},
        "machine": machine,
        "elapsed_seconds": time.perf_counter() - started,
        "prompts": prompt_table(prompts),
        "peer_descriptions": {s.name: getattr(s, "description", s.name) for s in systems if s.kind == "peer"},
        "summary": summary,
        "runs": records,
        "ok": summary["equality"]["failures"] == 0,
        "interrupted": len(records) < planned,
        "generations": {"ran": len(records), "planned": planned},
    }
