"""`specdec train`: self-distillation data and drafts trained for a target."""
from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from .cli import set_threads, thread_count
from .errors import SpecdecError
from .files import no_empty_dirs_left, writable_dir, writable_file
from .models.registry import DEFAULT_MODEL, MODELS
from .names import did_you_mean
from .train import data_dir, magpie_dir


def _check_target(model: str) -> None:
    if model not in MODELS:
        raise SpecdecError(f"unknown target {model!r} for training; {did_you_mean(model, MODELS)}known models: "
                           f"{', '.join(MODELS)}")


def _check_args(a: argparse.Namespace) -> None:
    """Before any work: sizes and budgets positive (max_rows, mlp_width, head_layers: 0 = the default), the paths
    the command writes writable."""
    for name in ("minutes", "vocab_size", "window", "batch", "lr", "max_seq", "heads", "max_prompts",
                 "max_new_tokens", "shards", "rows", "steps", "report_minutes", "target_temperature"):
        value = getattr(a, name, 1)
        if not (value > 0 and math.isfinite(value)):
            raise SpecdecError(f"--{name.replace('_', '-')} must be > 0 and finite, got {value}")
    for name in ("window", "max_seq"):                  # a window needs positions to draft from and to draft
        if getattr(a, name, 4) < 4:
            raise SpecdecError(f"--{name.replace('_', '-')} must be >= 4, got {getattr(a, name)}")
    if hasattr(a, "window") and hasattr(a, "heads") and a.window < a.heads + 2:
        raise SpecdecError(f"--window {a.window} leaves no position for head {a.heads} (--heads) to learn from; "
                           f"use --window {a.heads + 2} or more")
    if hasattr(a, "window") and hasattr(a, "steps") and a.window < a.steps + 2:
        raise SpecdecError(f"--window {a.window} leaves no position for draft position {a.steps} (--steps); "
                           f"use --window {a.steps + 2} or more")
    if not 0 <= getattr(a, "greedy_fraction", 0) <= 1:
        raise SpecdecError(f"--greedy-fraction must be in [0, 1], got {a.greedy_fraction}")
    if not getattr(a, "prompt_weight", 0) >= 0:
        raise SpecdecError(f"--prompt-weight must be >= 0, got {a.prompt_weight}")
    for name in ("max_rows", "mlp_width", "head_layers"):
        if getattr(a, name, 0) < 0:
            raise SpecdecError(f"--{name.replace('_', '-')} must be >= 0 (0 = the default), got {getattr(a, name)}")
    if getattr(a, "out", None) and Path(a.out).suffix == ".safetensors":     # the trained file: writable, first
        writable_file(Path(a.out), "--out")
    if getattr(a, "features", None):
        writable_dir(Path(a.features), "--features")


def _refuse_overwrite(a: argparse.Namespace) -> None:
    """An existing --out without --overwrite (and no checkpoint to resume) is refused before any work."""
    from .train.features import check_output

    check_output(Path(a.out), a.overwrite)


def _train_dtype(a: argparse.Namespace):
    """The resolved --train-dtype (auto measures this machine once, see train/precision.py)."""
    from .train.precision import train_dtype

    set_threads(a)                                # first: the dtype is measured at this thread count
    return train_dtype(a.train_dtype)


def _threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=thread_count, default=0, help="torch CPU threads (0 = torch's default, all cores)")


def cmd_data(a: argparse.Namespace) -> int:
    from .train.data import generate_data

    _check_target(a.model)
    _check_args(a)
    out = data_dir(a.out, a.model)
    writable_dir(out, "--out")
    set_threads(a)
    out = generate_data(a.model, out, a.max_prompts, a.max_new_tokens, a.batch, a.greedy_fraction, a.seed)
    print(f"data in {out}")
    return 0


def cmd_magpie(a: argparse.Namespace) -> int:
    from .train.magpie import generate_magpie, summary

    _check_target(a.model)
    _check_args(a)
    out = magpie_dir(a.out, a.model)
    writable_dir(out, "--out")
    generate_magpie(a.model, out, a.shards, a.rows, a.batch, a.seed, a.threads)
    print(json.dumps(summary(out), indent=2))
    return 0


@contextmanager
def no_empty_dirs_of(a: argparse.Namespace) -> Iterator[None]:
    """A run that fails or is interrupted leaves none of the empty folders it made for --out and --features."""
    with ExitStack() as stack:
        for value in (getattr(a, "out", None), getattr(a, "features", None)):
            if value:
                p = Path(value)
                stack.enter_context(no_empty_dirs_left(p.parent if p.suffix == ".safetensors" else p))
        yield


def _done(report: dict, written: list[Path]) -> None:
    """The report as JSON on stdout (status lines go to stderr); where the weights and their reports went on stderr."""
    import sys

    print(json.dumps(report, indent=2))
    for w in written:
        also = [p.name for p in (w.with_suffix(".json"), w.with_suffix(".curve.jsonl")) if p.is_file()]
        print(f"wrote {w}" + (f" (and {', '.join(also)} beside it)" if also else ""), file=sys.stderr)


def cmd_eagle(a: argparse.Namespace) -> int:
    from .train.eagle import train_eagle

    _check_target(a.model)
    _check_args(a)
    _refuse_overwrite(a)
    report = train_eagle(a.model, data_dir(a.data, a.model), Path(a.out), a.minutes, a.vocab_size,
                         a.window, a.batch, a.lr, a.max_seq, a.overwrite, a.max_rows, train_dtype=_train_dtype(a))
    _done(report, [Path(a.out)])
    return 0


def cmd_eagle3(a: argparse.Namespace) -> int:
    from .train.eagle3 import Eagle3Options, train_eagle3
    from .train.features import default_feature_dir

    _check_target(a.model)
    _check_args(a)
    _refuse_overwrite(a)
    set_threads(a)
    if a.init and Path(a.init).is_dir():
        raise SpecdecError(f"--init {a.init} is a folder (an export?); it takes a head file (.safetensors) written by "
                           "`specdec train eagle3` (or shipped)")
    if a.init and not Path(a.init).is_file():
        raise SpecdecError(f"--init: no such head file: {a.init}")
    opts = Eagle3Options(a.minutes, a.vocab_size, a.window, a.batch, a.lr, a.max_seq, a.steps, a.max_rows,
                         train_dtype=_train_dtype(a), report_minutes=a.report_minutes, init=a.init,
                         mlp_width=a.mlp_width, head_layers=a.head_layers, target_temperature=a.target_temperature,
                         prompt_weight=a.prompt_weight)
    data = magpie_dir(a.data, a.model)
    report = train_eagle3(a.model, data, Path(a.out), a.overwrite, opts,
                          Path(a.features) if a.features else default_feature_dir(a.model))
    _done(report, [Path(a.out)])
    return 0


def cmd_exit(a: argparse.Namespace) -> int:
    from .train.exit import exit_paths, train_exit

    _check_target(a.model)
    _check_args(a)
    try:
        layers = [int(x) for x in a.layers.split(",")]
    except ValueError:
        raise SpecdecError(f"--layers takes comma-separated layer counts, got {a.layers!r}") from None
    report = train_exit(a.model, magpie_dir(a.data, a.model), Path(a.out), a.minutes, layers, a.vocab_size,
                        a.batch, a.lr, a.max_seq, a.overwrite, a.max_rows, train_dtype=_train_dtype(a),
                        features=a.features or "")
    paths = exit_paths(Path(a.out), layers)
    _done(report, [paths[n] for n in report])                # the exits this run trained (kept ones are said above)
    return 0


def cmd_medusa(a: argparse.Namespace) -> int:
    from .train.medusa import train_medusa

    _check_target(a.model)
    _check_args(a)
    _refuse_overwrite(a)
    report = train_medusa(a.model, data_dir(a.data, a.model), Path(a.out), a.minutes, a.vocab_size,
                          a.heads, a.window, a.batch, a.lr, a.max_seq, a.max_rows, a.overwrite,
                          train_dtype=_train_dtype(a))
    _done(report, [Path(a.out)])
    return 0


def cmd_draft(a: argparse.Namespace) -> int:
    from .train.draft import train_draft

    _check_target(a.model)
    _check_args(a)
    _refuse_overwrite(a)
    try:
        layers = [int(x) for x in a.layers.split(",")] if a.layers else []         # []: the first and the last
    except ValueError:
        raise SpecdecError(f"--layers takes comma-separated layer numbers, got {a.layers!r}") from None
    report = train_draft(a.model, data_dir(a.data, a.model), Path(a.out), a.minutes, layers,
                         a.vocab_size, a.window, a.batch, a.lr, a.max_seq, a.max_rows, a.overwrite,
                         train_dtype=_train_dtype(a))
    _done(report, [Path(a.out)])
    return 0


def _dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train-dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="compute dtype of training: auto = "
                   "bfloat16 autocast where this CPU runs it faster than float32 (timed once per machine)")


def register(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> None:
    """`specdec train KIND`: one parser per kind, declared in a row (long, but a flat table of options)."""
    p = sub.add_parser("train", help="train drafts for a target (data, magpie, draft, eagle, eagle3, exit, medusa)", formatter_class=fmt)
    tsub = p.add_subparsers(dest="kind", required=True, metavar="KIND")
    p.subparsers = tsub.choices                   # an unknown option is named by its kind's parser (cli.run)

    d = tsub.add_parser("data", help="the target's own generations for training prompts (resumable shards)",
                        formatter_class=fmt)
    d.add_argument("--model", default=DEFAULT_MODEL, help="target whose generations to record")
    d.add_argument("--out", default=None, help="directory (default runs/data/MODEL)")
    d.add_argument("--max-prompts", type=int, default=6144, help="training prompts to answer")
    d.add_argument("--max-new-tokens", type=int, default=128, help="answer length cap")
    d.add_argument("--batch", type=int, default=32, help="prompts decoded together")
    d.add_argument("--greedy-fraction", type=float, default=0.75, help="share of batches decoded greedily")
    d.add_argument("--seed", type=int, default=0, help="prompt order and sampling seed")
    _threads_option(d)
    d.set_defaults(func=cmd_data)

    g = tsub.add_parser("magpie", help="self-generated conversations (the target writes questions and answers), "
                        "appended as compressed token-id shards", formatter_class=fmt)
    g.add_argument("--model", default=DEFAULT_MODEL, help="instruct target that writes the data")
    g.add_argument("--out", default=None, help="shard directory, new shards appended (default: data/MODEL "
                                                "of the specdec source tree, else ./data/MODEL)")
    g.add_argument("--shards", type=int, default=4, help="shards to add")
    g.add_argument("--rows", type=int, default=256, help="conversations per shard")
    g.add_argument("--batch", type=int, default=16, help="conversations decoded together")
    _threads_option(g)
    g.add_argument("--seed", type=int, default=0, help="seed (each shard derives its own from it and its number)")
    g.set_defaults(func=cmd_magpie)

    e = tsub.add_parser("eagle", help="an EAGLE-style head on the target's features", formatter_class=fmt)
    e.add_argument("--model", default=DEFAULT_MODEL, help="target to train for")
    e.add_argument("--data", default=None, help="data directory (default runs/data/MODEL)")
    e.add_argument("--out", required=True, help="output .safetensors (a .json report lands beside it; "
                                                "a .ckpt beside it resumes an interrupted run)")
    e.add_argument("--minutes", type=float, default=40.0, help="training time budget (after feature extraction)")
    e.add_argument("--vocab-size", type=int, default=8192, help="reduced draft vocabulary (most frequent tokens)")
    e.add_argument("--window", type=int, default=128, help="tokens per training window")
    e.add_argument("--batch", type=int, default=8, help="windows per step")
    e.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (cosine to 10%%)")
    e.add_argument("--max-seq", type=int, default=384, help="keep the last N tokens of each example")
    e.add_argument("--max-rows", type=int, default=0, help="use at most N examples (0 = all)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing output file and start "
                   "afresh (an interrupted run's checkpoint beside it is discarded)")
    _dtype_option(e)
    _threads_option(e)
    e.set_defaults(func=cmd_eagle)

    e3 = tsub.add_parser("eagle3", help="an EAGLE-3 head (fused low/mid/high features, training-time test) "
                         "on self-generated conversations", formatter_class=fmt)
    e3.add_argument("--model", default=DEFAULT_MODEL, help="target to train for")
    e3.add_argument("--data", default=None, help="magpie shard directory (default: the shipped "
                                                "data/MODEL of the specdec source tree, else ./data/MODEL)")
    e3.add_argument("--out", required=True, help="output .safetensors (a .json report lands beside it; "
                                                 "a .ckpt beside it resumes an interrupted run)")
    e3.add_argument("--minutes", type=float, default=40.0, help="wall-time budget, feature extraction and "
                    "validation included (the last step and the final validation may end past it)")
    e3.add_argument("--steps", type=int, default=4, help="training-time-test steps (draft positions unrolled)")
    e3.add_argument("--vocab-size", type=int, default=8192, help="reduced draft vocabulary (most frequent tokens)")
    e3.add_argument("--window", type=int, default=128, help="tokens per training window")
    e3.add_argument("--batch", type=int, default=8, help="windows per step")
    e3.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (cosine to 10%%)")
    e3.add_argument("--max-seq", type=int, default=640, help="keep the first N tokens of each conversation")
    e3.add_argument("--max-rows", type=int, default=0, help="use at most N conversations (0 = all)")
    e3.add_argument("--overwrite", action="store_true", help="replace an existing output file and start afresh "
                    "(an interrupted run's checkpoint beside it is discarded)")
    e3.add_argument("--features", default=None, help="feature cache directory, one file per data shard "
                    "(default: $SPECDEC_CACHE/features/MODEL)")
    e3.add_argument("--report-minutes", type=float, default=10.0, help="validation on a fixed sample every N "
                    "minutes, appended to OUT.curve.jsonl (the learning curve)")
    e3.add_argument("--init", default="", metavar="HEAD", help="continue from this EAGLE-3 head's weights, "
                    "configuration and draft vocabulary (e.g. the shipped one; a fresh optimiser) instead of a new "
                    "head (default: a new head; --vocab-size is then the file's)")
    e3.add_argument("--mlp-width", type=int, default=0, metavar="N", help="the head's MLP width (default: the "
                    "target's, or --init's); wider than --init's head: widened computing the same function at first")
    e3.add_argument("--head-layers", type=int, default=0, metavar="N", help="the head's decoder layers (default: 1, "
                    "EAGLE-3's, or --init's); more than --init's: deepened, the new layers starting as identities "
                    "(a deeper head drafts more slowly; vLLM and SGLang load one-layer heads only)")
    e3.add_argument("--target-temperature", type=float, default=1.0, metavar="T", help="learn the target's "
                    "distribution at temperature T: 1 its own (what sampled drafts meet), below 1 sharpened toward "
                    "its argmax (what greedy drafting is judged on)")
    e3.add_argument("--prompt-weight", type=float, default=1.0, metavar="W", help="loss weight of the draft "
                    "positions inside prompts (system prompt, template, question), which drafting never meets; "
                    "answer positions weigh 1")
    _threads_option(e3)
    _dtype_option(e3)
    e3.set_defaults(func=cmd_eagle3)

    x = tsub.add_parser("exit", help="the exit of a self-speculative draft (the target's first N layers; "
                        "method self)", formatter_class=fmt)
    x.add_argument("--model", default=DEFAULT_MODEL, help="target to train for")
    x.add_argument("--data", default=None, help="magpie shard directory (default: the shipped "
                                                "data/MODEL of the specdec source tree, else ./data/MODEL)")
    x.add_argument("--out", required=True, help="output .safetensors (a .json report lands beside it; "
                                                "a .ckpt beside it resumes an interrupted run)")
    x.add_argument("--layers", required=True, help="N, the target layers the draft runs; several (e.g. 6,12) "
                                                   "train one exit each, written as OUT-N.safetensors")
    x.add_argument("--minutes", type=float, default=5.0, help="training time per exit (after feature extraction)")
    x.add_argument("--vocab-size", type=int, default=8192, help="reduced draft vocabulary (most frequent tokens)")
    x.add_argument("--batch", type=int, default=1024, help="positions per step")
    x.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (cosine to 10%%)")
    x.add_argument("--max-seq", type=int, default=640, help="keep the first N tokens of each conversation")
    x.add_argument("--max-rows", type=int, default=0, help="use at most N conversations (0 = all)")
    x.add_argument("--overwrite", action="store_true", help="replace existing output files (without it, a re-run "
                                                              "keeps the exits already written and trains the rest)")
    x.add_argument("--features", default=None, help="feature cache directory (default: $SPECDEC_CACHE/features/MODEL); "
                                                    "about 1 MB per conversation and layer count")
    _dtype_option(x)
    _threads_option(x)
    x.set_defaults(func=cmd_exit)

    m = tsub.add_parser("medusa", help="Medusa heads (one per future position)", formatter_class=fmt)
    m.add_argument("--model", default=DEFAULT_MODEL, help="target to train for")
    m.add_argument("--data", default=None, help="data directory (default runs/data/MODEL)")
    m.add_argument("--out", required=True, help="output .safetensors (a .json report lands beside it; "
                                                "a .ckpt beside it resumes an interrupted run)")
    m.add_argument("--minutes", type=float, default=10.0, help="training time budget (after feature extraction)")
    m.add_argument("--heads", type=int, default=4, help="future positions predicted (one head each)")
    m.add_argument("--vocab-size", type=int, default=8192, help="reduced draft vocabulary (most frequent tokens)")
    m.add_argument("--window", type=int, default=128, help="tokens per training window")
    m.add_argument("--batch", type=int, default=8, help="windows per step")
    m.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (cosine to 10%%)")
    m.add_argument("--max-seq", type=int, default=384, help="keep the last N tokens of each example")
    m.add_argument("--max-rows", type=int, default=0, help="use at most N examples (0 = all)")
    m.add_argument("--overwrite", action="store_true", help="replace an existing output file and start "
                   "afresh (an interrupted run's checkpoint beside it is discarded)")
    _dtype_option(m)
    _threads_option(m)
    m.set_defaults(func=cmd_medusa)

    r = tsub.add_parser("draft", help="a small draft model distilled from the target (KL to its outputs)",
                        formatter_class=fmt)
    r.add_argument("--model", default=DEFAULT_MODEL, help="target to train for")
    r.add_argument("--data", default=None, help="data directory (default runs/data/MODEL)")
    r.add_argument("--out", required=True, help="output .safetensors (a .json report lands beside it; "
                                                "a .ckpt beside it resumes an interrupted run)")
    r.add_argument("--minutes", type=float, default=40.0, help="training time budget (after feature extraction)")
    r.add_argument("--layers", default="", help="target layers the draft starts from (default: the first and the "
                                                "last, e.g. 0,29 for smollm2-135m)")
    r.add_argument("--vocab-size", type=int, default=8192, help="reduced draft vocabulary (most frequent tokens)")
    r.add_argument("--window", type=int, default=128, help="tokens per training window")
    r.add_argument("--batch", type=int, default=8, help="windows per step")
    r.add_argument("--lr", type=float, default=3e-4, help="peak AdamW learning rate (cosine to 10%%)")
    r.add_argument("--max-seq", type=int, default=256, help="keep the last N tokens of each example")
    r.add_argument("--max-rows", type=int, default=0, help="use at most N examples (0 = all)")
    r.add_argument("--overwrite", action="store_true", help="replace an existing output file and start "
                   "afresh (an interrupted run's checkpoint beside it is discarded)")
    _dtype_option(r)
    _threads_option(r)
    r.set_defaults(func=cmd_draft)
