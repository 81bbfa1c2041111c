"""What each statement of the engine's step and the model's forward costs in place, between two weight streams.

A statement that takes 5 us in a loop of its own can take 50-200 us in a decoding step, right after a forward
has streamed the weights through the caches; microbenchmarks do not see that. This script times every top-level
statement of the named methods where they run: it recompiles each method with a `perf_counter` stamp after its
statements (a statement that returns is not timed; the stamps add about a microsecond each), runs `none` greedily
(batch 1) through `specdec.load`, and prints the median per step of every statement above `--min-us`.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/step_lines.py --threads 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_lines.py --threads 1 --methods decoder.Transformer._forward
"""
from __future__ import annotations

import argparse
import ast
import collections
import importlib
import inspect
import statistics
import textwrap
import time

import specdec  # (applies $SPECDEC_ISA before torch computes)
import torch

from profile_token import STEP_PROMPT
from specdec.machine import cpu_model

METHODS = ("engine.Engine._speculate", "engine.Engine._score", "engine.Engine._commit", "engine.Engine._record",
           "models.decoder.Transformer._forward")
SECONDS: dict[str, list[float]] = collections.defaultdict(list)


def stamped(owner: type, name: str) -> None:
    """Replace owner.name by a copy with a stamp after each top-level statement of its body."""
    fn = getattr(owner, name)
    source = textwrap.dedent(inspect.getsource(fn))
    first_line = fn.__code__.co_firstlineno
    tree = ast.parse(source)
    func = tree.body[0]
    body = func.body
    docstring = body[:1] if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else []
    new = [*docstring, *ast.parse("_t0 = _perf_counter()").body]
    for st in body[len(docstring):]:
        new.append(st)
        if isinstance(st, ast.Return):
            continue
        label = f"{owner.__name__}.{name}:{first_line + st.lineno - 1}: {ast.get_source_segment(source, st).splitlines()[0][:60]}"
        new += ast.parse(f"_t1 = _perf_counter(); _SECONDS[{label!r}].append(_t1 - _t0); _t0 = _t1").body
    func.body = new
    func.decorator_list = []
    ast.fix_missing_locations(tree)
    scope = dict(fn.__globals__, _perf_counter=time.perf_counter, _SECONDS=SECONDS)
    exec(compile(tree, inspect.getsourcefile(fn), "exec"), scope)
    setattr(owner, name, scope[func.name])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--tokens", type=int, default=200, help="decoding steps timed (default: 200)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="module.Class.method names under specdec, comma-separated (default: the engine's step and the forward)")
    ap.add_argument("--min-us", type=float, default=4.0, help="statements below this median are not printed (default: 4)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = specdec.load(args.model, method="none", dtype=args.dtype, draft_policy="fixed")
    for spec in args.methods.split(","):
        module, cls, name = spec.rsplit(".", 2)
        stamped(getattr(importlib.import_module(f"specdec.{module}"), cls), name)
    prompt = STEP_PROMPT
    gen.generate(prompt, max_new_tokens=8)                                     # warm-up
    SECONDS.clear()
    gen.generate(prompt, max_new_tokens=args.tokens + 1)
    print(f"{args.model}, {args.threads} thread(s), {cpu_model()}, torch {torch.__version__} kernels "
          f"{torch.backends.cpu.get_cpu_capability()}: median per call over {args.tokens} steps")
    for label, times in SECONDS.items():
        median = statistics.median(times[3:]) * 1e6 if len(times) > 5 else 0.0
        if median >= args.min_us:
            print(f"{median:9.1f} us  x{len(times):<5d} {label}")


if __name__ == "__main__":
    main()
