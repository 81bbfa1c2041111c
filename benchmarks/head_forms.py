"""The EAGLE-3 head's linears in the forms chosen on this machine against all 8-bit, side by side in one run.

Beside a 4-bit target each linear of the head runs prepacked, as Q8_0 codes or as Q4_1 codes, whichever is
fastest here (`eagle3.draft_kernel`, timed at the first start). This script benchmarks, on a suite's prompts,
`none` and each of `--methods` twice: with the head as loaded (the chosen forms) and as `METHOD, 8-bit head`
(every linear re-prepared as Q8_0 codes, `eagle3.eight_bit_kernel`), all systems interleaved per prompt as
`specdec bench` runs them, and writes the same report (speedup over `none`, tau, acceptance per position,
output equality).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/head_forms.py --threads 1 --out runs/bench/head-forms
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
import torch

from specdec.api import load_model, runtime_info
from specdec.bench import report, runner
from specdec.bench.suites import load_suite
from specdec.models.eagle3 import Eagle3Head, eight_bit_kernel


def head_of(system: runner.MethodSystem) -> Eagle3Head:
    """The EAGLE-3 head a method's proposer drafts with (eagle3's own, hybrid's for its EAGLE rows)."""
    head = system.generator.proposer.head
    if not isinstance(head, Eagle3Head):
        raise SystemExit(f"{system.name} does not draft with an EAGLE-3 head")
    return head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="target (default: %(default)s)")
    ap.add_argument("--methods", default="eagle3,hybrid", help="methods drafting with the EAGLE-3 head (default: %(default)s)")
    ap.add_argument("--suite", default="mini", help="prompt suite (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=0, help="prompts per category, 0: all (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every prompt (default: %(default)s)")
    ap.add_argument("--out", default="runs/bench/head-forms", help="report folder (default: %(default)s)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    prompts = load_suite(a.suite, None)
    if a.limit:
        prompts = [p for c in dict.fromkeys(p.category for p in prompts)
                   for p in [q for q in prompts if q.category == c][:a.limit]]
    target, tokenizer, name = load_model(a.model, "q4")
    methods = [m for m in a.methods.split(",") if m]
    specs = runner.parse_methods(methods + [f"{m}=shipped" for m in methods], None)
    specs = [s if s.draft != "shipped" else runner.MethodSpec(f"{s.method}, 8-bit head", s.method, None) for s in specs]
    systems = runner.build_systems(target, tokenizer, specs, "q4", "cpu", 4, "fixed", name)
    for s in systems:
        if s.name.endswith(", 8-bit head"):
            head_of(s).prepare(target.dtype, eight_bit_kernel)
        elif s.name != "none":
            print(f"{s.name}: " + ", ".join(f"{n} {k.label}" for n, k in head_of(s).packed.items()), file=sys.stderr)
    runtime = runtime_info(target)
    config = {"model": name, "dtype": runtime["dtype"], "runtime": runtime, "device": "cpu", "suite": a.suite,
              "limit": a.limit, "num_draft_tokens": 4, "draft_policy": "fixed", "draft_model": "",
              "method_specs": [{"label": s.label, "method": s.method, "draft": "", "policy": "fixed",
                                "tree": str(s.tree), "sample_drafts": s.sample_drafts} for s in specs],
              "peer_notes": []}
    command = "OMP_NUM_THREADS={0} .venv/bin/python benchmarks/head_forms.py {1}".format(a.threads, " ".join(sys.argv[1:]))
    results = runner.benchmark(systems, prompts, tokenizer, config, runner.machine_info(runtime["dtype"]), command,
                               a.repeats)
    paths = report.write_report(results, Path(a.out))
    print(report.summary_table(results))
    print(f"report: {', '.join(str(p) for p in paths)}", file=sys.stderr)
    sys.exit(0 if results["ok"] else 1)


if __name__ == "__main__":
    main()
