"""Where a speculative generation's time goes: the prompt's prefill, target forwards, drafting, the rest.

For every first turn of the mini suite (the edit category left out: its predictions draft for every method),
each method generates greedily after a warm-up; the prefill is timed apart (the best of two one-token
generations), so the decode phase, the part speculation can speed up, is measured on its own. Per method,
summed over prompts: wall time, prefill, decode time, speedup over `none` overall and in the decode phase,
target forwards, tau, the target's ms per decode forward (verification rows included), drafting seconds and
the time outside both, and whether every output equals `none`'s. Methods are `NAME:K:POLICY` (a fixed K or
`auto`), as in `specdec bench`'s specs otherwise (`eagle3:2x8` is not accepted here: trees have their own
script, `forward_cost.py`).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_phase.py --threads 1 \
        --methods eagle3:1:fixed,eagle3:2:fixed,eagle3:4:fixed,eagle3:4:auto,suffix:4:auto
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
import torch

from specdec.api import load_model
from specdec.bench import runner, suites
from specdec.machine import cpu_model
from specdec.sampling import SamplingParams


@dataclass
class Row:
    prefill: float          # seconds, the best of two one-token generations
    wall: float             # seconds, the whole generation
    tokens: list[int]
    forwards: int
    target_seconds: float
    draft_seconds: float


def parse(spec: str) -> tuple[str, int, str]:
    method, k, policy = spec.split(":")
    if policy not in ("fixed", "auto"):
        raise SystemExit(f"{spec!r}: the policy is fixed or auto")
    return method, int(k), policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", default="eagle3:1:fixed,eagle3:2:fixed,eagle3:4:fixed,eagle3:4:auto,suffix:4:auto",
                    help="comma-separated NAME:K:POLICY; `none` is measured first in any case")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, tok, name = load_model(a.model, "auto", "cpu")
    configs = [("none", 4, "fixed")] + [parse(s) for s in a.methods.split(",") if s.strip()]
    systems = []
    for method, k, policy in configs:
        spec = runner.parse_methods(method, None)[-1]
        systems.append((f"{method} K={k} {policy}",
                        runner.build_systems(target, tok, [spec], "auto", "cpu", k, policy, name)[0]))
    prompts = [p for p in suites.load_suite("mini") if p.category != "edit"]
    params = SamplingParams(0.0, 0, 1.0, 0)
    rows: dict[str, list[Row]] = {label: [] for label, _ in systems}
    for p in prompts:
        ids = runner.turn_ids(tok, p.turns[:1], [])
        for label, s in systems:
            s.forget()
            s.generate(ids, 2, params)                                         # warm-up
            prefill = min(s.generate(ids, 1, params).seconds for _ in range(2))
            s.forget()
            g = s.generate(ids, p.max_new_tokens, params)
            c = g.counters
            rows[label].append(Row(prefill, g.seconds, g.tokens, c.target_forwards, c.target_seconds,
                                   c.draft_seconds))
    print(f"{name} q4, {a.threads} thread(s), {cpu_model()}, torch {torch.__version__} kernels "
          f"{torch.backends.cpu.get_cpu_capability()}; {len(prompts)} first turns of the mini suite, greedy")
    print("| method | equal to none | wall s | prefill s | decode s | speedup | decode speedup | forwards | tau | "
          "target ms per decode forward | drafting s | other s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = rows[systems[0][0]]
    base_wall, base_pre = sum(r.wall for r in base), sum(r.prefill for r in base)
    for label, rs in rows.items():
        wall, pre = sum(r.wall for r in rs), sum(r.prefill for r in rs)
        fwd, tgt, dr = sum(r.forwards for r in rs), sum(r.target_seconds for r in rs), sum(r.draft_seconds for r in rs)
        same = sum(r.tokens == b.tokens for r, b in zip(rs, base))
        new = sum(len(r.tokens) for r in rs)
        decode_fwd = fwd - len(rs)                               # each generation's first forward is its prefill
        print(f"| {label} | {same}/{len(rs)} | {wall:.2f} | {pre:.2f} | {wall - pre:.2f} | {base_wall / wall:.3f} | "
              f"{(base_wall - base_pre) / (wall - pre):.3f} | {fwd} | {new / fwd:.2f} | "
              f"{1000 * (tgt - pre) / decode_fwd:.2f} | {dr:.2f} | {wall - tgt - dr:.2f} |")


if __name__ == "__main__":
    main()
