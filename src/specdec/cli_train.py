"""`specdec train`: self-distillation data and drafts trained for a target."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .errors import SpecdecError
from .models.registry import DEFAULT_MODEL, MODELS


def _check_target(model: str) -> None:
    if model not in MODELS:
        raise SpecdecError(f"unknown target {model!r} for training; known models: {', '.join(MODELS)}")


def cmd_data(a: argparse.Namespace) -> int:
    from .train.data import generate_data

    _check_target(a.model)
    out = generate_data(a.model, Path(a.out or f"runs/data/{a.model}"), a.max_prompts, a.max_new_tokens, a.batch,
                        a.greedy_fraction, a.seed)
    print(f"data in {out}")
    return 0


def cmd_eagle(a: argparse.Namespace) -> int:
    from .train.eagle import train_eagle

    _check_target(a.model)
    report = train_eagle(a.model, Path(a.data or f"runs/data/{a.model}"), Path(a.out), a.minutes, a.vocab_size,
                         a.window, a.batch, a.lr, a.max_seq, a.overwrite, a.max_rows)
    print(json.dumps(report, indent=2))
    return 0


def cmd_medusa(a: argparse.Namespace) -> int:
    from .train.medusa import train_medusa

    _check_target(a.model)
    report = train_medusa(a.model, Path(a.data or f"runs/data/{a.model}"), Path(a.out), a.minutes, a.vocab_size,
                          a.heads, a.window, a.batch, a.lr, a.max_seq, a.max_rows, a.overwrite)
    print(json.dumps(report, indent=2))
    return 0


def cmd_unavailable(a: argparse.Namespace) -> int:
    raise SpecdecError(f"`specdec train {a.kind}` is not implemented yet; `specdec train eagle` is")


def register(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> None:
    p = sub.add_parser("train", help="train drafts for a target (data, eagle)", formatter_class=fmt)
    tsub = p.add_subparsers(dest="kind", required=True, metavar="KIND")

    d = tsub.add_parser("data", help="the target's own generations for training prompts (resumable shards)",
                        formatter_class=fmt)
    d.add_argument("--model", default=DEFAULT_MODEL)
    d.add_argument("--out", default=None, help="directory (default runs/data/MODEL)")
    d.add_argument("--max-prompts", type=int, default=6144)
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--batch", type=int, default=32)
    d.add_argument("--greedy-fraction", type=float, default=0.75, help="share of batches decoded greedily")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_data)

    e = tsub.add_parser("eagle", help="an EAGLE-style head on the target's features", formatter_class=fmt)
    e.add_argument("--model", default=DEFAULT_MODEL)
    e.add_argument("--data", default=None, help="data directory (default runs/data/MODEL)")
    e.add_argument("--out", required=True, help="output .safetensors (a .json report lands beside it)")
    e.add_argument("--minutes", type=float, default=40.0, help="training time budget (after feature extraction)")
    e.add_argument("--vocab-size", type=int, default=8192, help="reduced draft vocabulary (most frequent tokens)")
    e.add_argument("--window", type=int, default=128)
    e.add_argument("--batch", type=int, default=8)
    e.add_argument("--lr", type=float, default=1e-3)
    e.add_argument("--max-seq", type=int, default=384, help="keep the last N tokens of each example")
    e.add_argument("--max-rows", type=int, default=0, help="use at most N examples (0 = all)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    e.set_defaults(func=cmd_eagle)

    m = tsub.add_parser("medusa", help="Medusa heads (one per future position)", formatter_class=fmt)
    m.add_argument("--model", default=DEFAULT_MODEL)
    m.add_argument("--data", default=None, help="data directory (default runs/data/MODEL)")
    m.add_argument("--out", required=True, help="output .safetensors")
    m.add_argument("--minutes", type=float, default=10.0)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--vocab-size", type=int, default=8192)
    m.add_argument("--window", type=int, default=128)
    m.add_argument("--batch", type=int, default=8)
    m.add_argument("--lr", type=float, default=1e-3)
    m.add_argument("--max-seq", type=int, default=384)
    m.add_argument("--max-rows", type=int, default=0)
    m.add_argument("--overwrite", action="store_true")
    m.set_defaults(func=cmd_medusa)

    for kind in ("draft",):
        u = tsub.add_parser(kind, help=f"{kind} (not implemented yet)", formatter_class=fmt)
        u.set_defaults(func=cmd_unavailable)
