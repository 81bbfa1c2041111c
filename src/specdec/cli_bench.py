"""`specdec bench`: the Spec-Bench-style benchmark (suites x methods x peers -> report)."""
from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .bench.suites import CATEGORIES, SUITES, Prompt, load_suite
from .errors import SpecdecError
from .files import no_empty_dirs_left, writable_dir
from .models.registry import DEFAULT_MODEL, MODELS, resolve
from .names import BENCH_FALLBACK_DRAFT, MAX_DRAFT_TOKENS, METHODS, PEERS, POLICIES

if TYPE_CHECKING:
    from .models.base import CausalLM
    from .models.tokenizer import Tokenizer
    from .sampling import SamplingParams

DEFAULT_METHODS = "none,suffix,ngram,draft,eagle,eagle3,medusa,hybrid"   # suffix: the default method


def register(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> None:
    """Add the `bench` subcommand."""
    p = sub.add_parser("bench", help="benchmark methods (and peers) on the prompt suites; writes a report",
                       formatter_class=fmt)
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"registered name ({', '.join(MODELS)}) or a .gguf path")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated methods ({', '.join(METHODS)}); NAME=DRAFT gives one its own draft, "
                        "lookahead=W,N,G its shape, NAME@POLICY its own draft-length policy (e.g. ngram@auto), "
                        "eagle:TOPKxBUDGET a dynamic "
                        "draft tree (e.g. eagle:4x16; plain eagle drafts a chain), NAME@sample=on|off|auto the "
                        "--sample-drafts setting of an eagle or eagle3 chain (e.g. eagle3@sample=off next to eagle3, "
                        "which has generate's default, auto; suffixes combine: eagle3@auto@sample=on); 'none' is "
                        "always run (the baseline)")
    p.add_argument("--suite", default="mini", choices=SUITES, help="prompt suite")
    p.add_argument("--categories", default=None,
                   help=f"comma-separated subset of: {', '.join(CATEGORIES)} (default: all)")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per category (default: all)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs must equal none's)")
    from .cli import add_dtype_arg, int_in, number_in, one_of, thread_count

    p.add_argument("--top-p", type=number_in(0.0, 1.0), default=1.0,
                   help="with --temperature: nucleus sampling, keep the most likely tokens up to this mass (default: 1, off)")
    p.add_argument("--top-k", type=int_in(0), default=0,
                   help="with --temperature: keep the K most likely tokens (default: 0, off)")
    p.add_argument("--repeats", type=int, default=1, help="timed repeats of every (prompt, method)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")

    add_dtype_arg(p)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--draft-model", default=None,
                   help="draft of the 'draft' method: name, .gguf path or self:N (default: the model's registered "
                        f"draft, else {BENCH_FALLBACK_DRAFT})")
    p.add_argument("--num-draft-tokens", type=int_in(1, MAX_DRAFT_TOKENS), default=4, help="drafts per step, K")
    p.add_argument("--draft-policy", default="fixed", type=one_of("draft policy", POLICIES), choices=POLICIES,
                   help="draft length policy")
    p.add_argument("--threads", type=thread_count, default=0,
                   help="CPU threads of our methods and of every peer (llama.cpp: decoding and prefill alike); "
                        "0 = torch's default")
    p.add_argument("--peers", default="auto", help=f"comma-separated peers to run side by side: {', '.join(PEERS)}; "
                                                   "auto: llamacpp when llama-cpp-python is installed (none otherwise); "
                                                   "'' for none")
    p.add_argument("--out", default=None, help="output directory; a report already there is replaced, other "
                                               "files stay (default: a new one per run, ./runs/bench/SUITE-UTCTIME)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    p.set_defaults(func=cmd_bench)


def parse_categories(text: str | None) -> list[str] | None:
    """Comma-separated categories -> validated list (None: all)."""
    if text is None:
        return None
    items = [c.strip() for c in text.split(",") if c.strip()]
    if not items:
        raise SpecdecError(f"no categories given; valid categories: {', '.join(CATEGORIES)}")
    for i, item in enumerate(items):
        if item not in CATEGORIES:
            raise SpecdecError(f"unknown benchmark category {item!r}; valid categories: {', '.join(CATEGORIES)}")
        if item in items[:i]:
            raise SpecdecError(f"--categories names {item!r} twice")
    return items


def limit_prompts(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """At most ``limit`` prompts per category, in order."""
    if limit is None:
        return prompts
    seen: dict[str, int] = {}
    out = []
    for prompt in prompts:
        seen[prompt.category] = seen.get(prompt.category, 0) + 1
        if seen[prompt.category] <= limit:
            out.append(prompt)
    return out


def load_model(model: str, dtype: str, device: str) -> tuple[CausalLM, Tokenizer, str]:
    """api.load_model, imported (with torch) when the benchmark runs."""
    from .api import load_model

    return load_model(model, dtype, device)


def _check_numbers(a: argparse.Namespace) -> None:
    from .draft_length import make_policy

    if a.repeats < 1:
        raise SpecdecError(f"--repeats must be >= 1, got {a.repeats}")
    if a.limit is not None and a.limit < 1:
        raise SpecdecError(f"--limit must be >= 1, got {a.limit}")
    if not 0 <= a.temperature < math.inf:
        raise SpecdecError(f"--temperature must be a finite number >= 0, got {a.temperature}")
    make_policy(a.draft_policy, a.num_draft_tokens)


def sampling_of(a: argparse.Namespace) -> "SamplingParams":
    """The run's sampling (its seed varied per prompt and repeat by the runner)."""
    from .sampling import SamplingParams

    return SamplingParams(a.temperature, a.top_k, a.top_p, a.seed)


def command_line(a: argparse.Namespace) -> str:
    """The command as typed when run as `specdec` (with any thread environment variables in front), else an
    equivalent one with every setting."""
    from .bench import runner

    env = [f"{k}={os.environ[k]}" for k in runner.THREAD_ENV if k in os.environ]
    if sys.argv and Path(sys.argv[0]).name == "specdec" and len(sys.argv) > 1 and sys.argv[1] == "bench":
        return " ".join([*env, shlex.join(["specdec", *sys.argv[1:]])])
    parts = ["specdec", "bench", "--model", a.model, "--methods", a.methods, "--suite", a.suite,
             "--temperature", str(a.temperature), "--top-p", str(a.top_p), "--top-k", str(a.top_k),
             "--repeats", str(a.repeats), "--seed", str(a.seed),
             "--dtype", a.dtype, "--num-draft-tokens", str(a.num_draft_tokens), "--draft-policy", a.draft_policy]
    for flag, value in (("--categories", a.categories), ("--limit", a.limit), ("--draft-model", a.draft_model),
                        ("--threads", a.threads or None), ("--peers", None if a.peers == "auto" else a.peers),
                        ("--device", None if a.device == "cpu" else a.device), ("--out", a.out)):
        if value is not None:
            parts += [flag, str(value)]
    return " ".join([*env, shlex.join(parts)])


def _pad_id(tokenizer) -> int:
    pad = getattr(getattr(tokenizer, "hf", None), "pad_token_id", None)
    return int(pad) if pad is not None else min(tokenizer.eos_ids, default=0)


def _shown_bases() -> tuple[tuple[Path, str], ...]:
    """The absolute folders a report names by a short prefix: the package, then the working directory."""
    return (Path(__file__).resolve().parent, "specdec"), (Path.cwd().resolve(), ".")


def shown(path: str | None) -> str | None:
    """A draft path as a report shows it: relative to the package or the working directory, never absolute."""
    if path is None or not Path(path).is_absolute():
        return path
    p = Path(path).resolve()
    for base, prefix in _shown_bases():
        if p.is_relative_to(base):
            return f"{prefix}/{p.relative_to(base)}"
    return p.name


def shown_paths(text: str) -> str:
    """`text` (e.g. a peer's note quoting an error) with the package's and the working directory's absolute
    paths shown as `shown` shows paths."""
    for base, prefix in _shown_bases():
        text = text.replace(str(base), prefix)
    return text


def default_peers() -> str:
    """The fastest plain CPU engine, when it is installed: llama.cpp."""
    import importlib.util

    return "llamacpp" if importlib.util.find_spec("llama_cpp") is not None else ""


def default_out(suite: str) -> Path:
    """A new folder for a run's report: runs/bench/SUITE-YYYYMMDDTHHMMSSZ (UTC), under the working directory."""
    import datetime

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path("runs") / "bench" / f"{suite}-{stamp}"


def cmd_bench(a: argparse.Namespace) -> int:
    """Validate, load the target once, run methods (and peers) interleaved, write the report."""
    from .api import check_shipped
    from .bench import runner
    from .bench.peers import parse_peers
    from .bench.report import report_files

    _check_numbers(a)
    categories = parse_categories(a.categories)
    resolve(a.model)                                                # fail fast, before any loading
    for spec in runner.parse_methods(a.methods, a.draft_model):
        if spec.draft is None and spec.method != "draft":           # `draft` falls back to default_draft
            check_shipped(a.model, spec.method, f"--methods ...,{spec.method}=FILE")
    if a.out is not None and not a.out.strip():
        raise SpecdecError("--out is empty; give a folder (or leave --out out for a new one per run)")
    auto = default_peers() if a.temperature == 0 else ""          # peers run greedy only
    peer_names = parse_peers(auto if a.peers == "auto" else a.peers)
    if peer_names and a.temperature != 0:
        raise SpecdecError("--peers runs greedy only; use --temperature 0")
    out = Path(a.out) if a.out else default_out(a.suite)
    with no_empty_dirs_left(out):
        writable_dir(out, "--out")                                 # after the options' checks, before the run
        for f in report_files(out):                                # what the run will replace must be replaceable
            try:
                if f.exists():
                    open(f, "r+b").close()                         # opened for writing, left as it is
            except OSError as e:
                raise SpecdecError(f"--out {out}: cannot replace {f.name} ({e.strerror or e})") from None
        if (out / "results.json").exists():
            print(f"specdec: the report in {out} will be replaced by this run's", file=sys.stderr)
        return _bench(a, out, categories, peer_names)


def _bench(a: argparse.Namespace, out: Path, categories: list[str], peer_names: list[str]) -> int:
    """cmd_bench after the checks: load, run, write the report into `out` (an interrupted run: the prompts
    every system finished, exit 130)."""
    from .api import runtime_info
    from .bench import report, runner
    from .bench.peers import build_peers

    prompts = limit_prompts(load_suite(a.suite, categories), a.limit)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)                           # peers read torch's thread count
    target, tokenizer, name = load_model(a.model, a.dtype, a.device)
    draft = a.draft_model or runner.default_draft(name)
    specs = runner.parse_methods(a.methods, draft)
    systems: list = runner.build_systems(target, tokenizer, specs, a.dtype, a.device, a.num_draft_tokens,
                                         a.draft_policy, name)
    peer_draft = next((s.draft for s in specs if s.method == "draft"), draft)
    peers, notes = (build_peers(peer_names, resolve(a.model)[1], peer_draft, a.num_draft_tokens,
                                  tokenizer.eos_ids, _pad_id(tokenizer))
                    if peer_names else ([], []))
    notes = [shown_paths(n) for n in notes]
    ran_draft = (any(s.method in ("draft", "staged") for s in specs)
                 or any(p.name == "transformers-assisted" for p in peers))
    shown_draft = peer_draft if ran_draft else None                # a report names a draft only where one ran
    runtime = runtime_info(target)
    config = {"model": name, "dtype": runtime["dtype"], "runtime": runtime, "device": a.device, "suite": a.suite, "limit": a.limit,
              "num_draft_tokens": a.num_draft_tokens, "draft_policy": a.draft_policy, "draft_model": shown(shown_draft),
              "method_specs": [{"label": s.label, "method": s.method, "draft": shown(s.draft),
                                "policy": s.policy or a.draft_policy, "tree": str(s.tree),
                                "sample_drafts": s.sample_drafts} for s in specs],
              "peer_notes": notes}
    results = runner.benchmark([*systems, *peers], prompts, tokenizer, config, runner.machine_info(runtime["dtype"]),
                               command_line(a), a.repeats, sampling_of(a), a.progress)
    paths = report.write_report(results, out)
    print(report.summary_table(results))
    print(f"report: {', '.join(str(p) for p in paths)}", file=sys.stderr)
    if results.get("interrupted"):
        g = results["generations"]
        print(f"specdec: interrupted: the report covers the {len(results['prompts'])} prompts every system "
              f"finished ({g['ran']} of {g['planned']} generations)", file=sys.stderr)
        return 130
    eq = results["summary"]["equality"]
    if not results["ok"]:
        print(f"specdec: error: {eq['failures']} greedy outputs differ from 'none' ({', '.join(eq['failed_ids'])}); "
              f"see {paths[1]}", file=sys.stderr)
        return 1
    if eq.get("checked"):
        print("equality: every method's greedy output is token-identical to plain decoding's ('none')", file=sys.stderr)
    return 0
