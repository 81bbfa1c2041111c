"""Variants of the EAGLE-3 head's drafting against the shipped set-up, side by side in one run.

Beside a 4-bit target each linear of the head runs prepacked, as Q8_0 codes or as Q4_1 codes, whichever is
fastest here (`eagle3.draft_kernel`, timed at the first start), and a chain stops below a cumulative head
confidence (`api.EAGLE_CHAIN_MIN_CONFIDENCE`). This script benchmarks, on a suite's prompts, `none` and each of
`--methods` as loaded, and once more per variant of `--variants`:
  `q8`     every linear re-prepared as Q8_0 codes (`eagle3.eight_bit_kernel`): "METHOD, 8-bit head";
  `cut=C`  chains cut below cumulative confidence C (0: never cut): "METHOD, cut C";
all systems interleaved per prompt as `specdec bench` runs them, and writes the same report (speedup over
`none`, tau, acceptance per position, output equality).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/head_variants.py --threads 1 --variants q8 --out runs/bench/head-forms
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/head_variants.py --threads 1 --variants cut=0.2,cut=0.15
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/head_variants.py --threads 1 --methods eagle3 --variants cut=0 \
        --num-draft-tokens 1 --temperature 1.0 --limit 2        # sampled drafts, one per step, never cut
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
import torch

from specdec.api import load_model, runtime_info
from specdec.bench import report, runner
from specdec.bench.suites import load_suite
from specdec.cli_bench import limit_prompts
from specdec.models.eagle3 import Eagle3Head, eight_bit_kernel
from specdec.proposers.eagle import EagleProposer


def head_of(system: runner.MethodSystem) -> Eagle3Head:
    """The EAGLE-3 head a method's proposer drafts with (eagle3's own, hybrid's for its EAGLE rows)."""
    head = system.generator.proposer.head
    if not isinstance(head, Eagle3Head):
        raise SystemExit(f"{system.name} does not draft with an EAGLE-3 head")
    return head


def chain_of(system: runner.MethodSystem) -> EagleProposer:
    """The EAGLE proposer whose chains a method drafts (eagle3 itself, hybrid's inner one)."""
    proposer = system.generator.proposer
    return proposer if isinstance(proposer, EagleProposer) else proposer.eagle


def label(method: str, variant: str) -> str:
    """The report's name of a method under a variant ("q8" or "cut=C")."""
    if variant == "q8":
        return f"{method}, 8-bit head"
    if variant.startswith("cut=") and 0 <= float(variant[4:]) < 1:
        return f"{method}, cut {float(variant[4:])}"
    raise SystemExit(f"unknown variant {variant!r}: q8 or cut=C with 0 <= C < 1")


def apply(system: runner.MethodSystem, variant: str, dtype: torch.dtype) -> None:
    """Re-prepare a system's head or re-set its chain cut for `variant`."""
    if variant == "q8":
        head_of(system).prepare(dtype, eight_bit_kernel)
    else:
        cut = float(variant[4:])
        chain_of(system).log_min_confidence = math.log(cut) if cut > 0 else -math.inf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="target (default: %(default)s)")
    ap.add_argument("--methods", default="eagle3,hybrid", help="methods drafting with the EAGLE-3 head (default: %(default)s)")
    ap.add_argument("--variants", default="q8", help="comma-separated: q8, cut=C (default: %(default)s)")
    ap.add_argument("--suite", default="mini", help="prompt suite (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=0, help="prompts per category, 0: all (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every prompt (default: %(default)s)")
    ap.add_argument("--num-draft-tokens", type=int, default=4, help="draft length K, fixed (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; above 0 the heads "
                                                                    "sample their drafts (default: %(default)s)")
    ap.add_argument("--out", default="runs/bench/head-variants", help="report folder (default: %(default)s)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    prompts = limit_prompts(load_suite(a.suite, None), a.limit or None)
    target, tokenizer, name = load_model(a.model, "q4")
    methods = [m for m in a.methods.split(",") if m]
    variants = [v for v in a.variants.split(",") if v]
    base = runner.parse_methods(methods, None)                          # none first
    pairs = [(v, m) for v in variants for m in methods]
    specs = base + [runner.MethodSpec(label(m, v), m, None) for v, m in pairs]
    systems = runner.build_systems(target, tokenizer, specs, "q4", "cpu", a.num_draft_tokens, "fixed", name)
    for s, (v, _) in zip(systems[len(base):], pairs):
        apply(s, v, target.dtype)
    for s in systems[1:len(base)]:
        print(f"{s.name}: " + ", ".join(f"{n} {k.label}" for n, k in head_of(s).packed.items()), file=sys.stderr)
    runtime = runtime_info(target)
    config = {"model": name, "dtype": runtime["dtype"], "runtime": runtime, "device": "cpu", "suite": a.suite,
              "limit": a.limit, "num_draft_tokens": a.num_draft_tokens, "draft_policy": "fixed", "draft_model": "",
              "method_specs": [{"label": s.label, "method": s.method, "draft": "", "policy": "fixed",
                                "tree": str(s.tree), "sample_drafts": s.sample_drafts} for s in specs],
              "peer_notes": []}
    command = "OMP_NUM_THREADS={0} .venv/bin/python benchmarks/head_variants.py {1}".format(a.threads, " ".join(sys.argv[1:]))
    results = runner.benchmark(systems, prompts, tokenizer, config, runner.machine_info(runtime["dtype"]), command,
                               a.repeats, runner.SamplingParams(a.temperature))
    paths = report.write_report(results, Path(a.out))
    print(report.summary_table(results))
    print(f"report: {', '.join(str(p) for p in paths)}", file=sys.stderr)
    sys.exit(0 if results["ok"] else 1)


if __name__ == "__main__":
    main()
