"""`specdec export`: trained heads in the layouts vLLM and SGLang load."""
from __future__ import annotations

import argparse
from pathlib import Path

from .errors import SpecdecError
from .files import no_empty_dirs_left
from .models.registry import DEFAULT_MODEL
from .names import EXPORT_FORMATS


def _target(model: str):
    from .api import load_model
    from .models.decoder import Transformer

    target, _, _ = load_model(model, "float32")
    if not isinstance(target, Transformer):
        raise SpecdecError("export needs a lean GGUF target")
    return target


def cmd_export(a: argparse.Namespace) -> int:
    from .api import has_shipped, shipped, train_hint
    from .export import check_out, export_eagle3, export_medusa
    from .models.registry import resolve

    if a.kind == "medusa" and a.format != "vllm":               # what needs no model is checked before loading one
        raise SpecdecError(f"Medusa heads export to vllm only, not {a.format!r}")
    name = resolve(a.model)[0]
    if not a.weights and not has_shipped(name, a.kind):
        raise SpecdecError(f"no shipped {a.kind} weights for {name!r}; {train_hint(name, a.kind, '')}; then export "
                           "that file with --weights FILE")
    if a.weights and not Path(a.weights).is_file():
        raise SpecdecError(f"--weights {a.weights}: " + ("a folder, not a weights file" if Path(a.weights).is_dir()
                                                         else "weights not found"))
    if not a.out_dir.strip():                                    # an unset "$OUT": not the working directory
        raise SpecdecError("the output directory is empty: name a directory for the export")
    out_dir = Path(a.out_dir)
    with no_empty_dirs_left(out_dir):                           # a failed export leaves no directory it made
        check_out(out_dir, a.overwrite)
        target = _target(a.model)
        weights = Path(a.weights) if a.weights else shipped(name, a.kind)
        if a.kind == "eagle3":
            from .models.eagle3 import Eagle3Head

            out = export_eagle3(Eagle3Head.load(weights, target), a.format, out_dir, a.overwrite)
        else:
            from .models.medusa import MedusaHeads

            out = export_medusa(MedusaHeads.load(weights, target), a.format, out_dir, a.overwrite)
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'} ({a.format} layout)")
    return 0


def register(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> None:
    p = sub.add_parser("export", help="write a head in the layout vLLM / SGLang load (config.json + "
                                      "model.safetensors)", formatter_class=fmt)
    p.add_argument("kind", choices=("eagle3", "medusa"), help="which head")
    p.add_argument("out_dir", help="output directory")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="vllm", help="target engine (medusa: vllm only)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the target the head was trained for")
    p.add_argument("--weights", default=None, help="head weights, .safetensors (default: the one shipped)")
    p.add_argument("--overwrite", action="store_true", help="replace existing files in out_dir")
    p.set_defaults(func=cmd_export)
