"""How much of a target's output a draft with another tokenizer can propose by token-level intersection.

    .venv/bin/python benchmarks/vocab_coverage.py docs/benchmarks/gemma-draft-smollm2/results.json \
        --draft smollm2-135m

Reads the greedy outputs of `none` in a `specdec bench` results file and prints: the vocabulary overlap;
the share of the target's output tokens that no draft token maps onto (positions where an intersection
draft is always rejected, and where a draft re-tokenizing text could still be right); and the share of the
draft's own tokens for the same text that lie outside the intersection. Small shares mean text
re-tokenization (the greedy-only alternative) has little to gain over the intersection.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from specdec.api import resolve
from specdec.models.tokenizer import Tokenizer
from specdec.proposers.cross_vocab import VocabMap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a greedy `specdec bench` results.json of the target")
    ap.add_argument("--draft", default="smollm2-135m", help="the draft model (registered name or .gguf)")
    ap.add_argument("--system", default="none", help="whose outputs to read")
    a = ap.parse_args()
    results = json.loads(Path(a.results).read_text())
    target_tok = Tokenizer.from_gguf(Path(resolve(results["config"]["model"])[1]))
    draft_tok = Tokenizer.from_gguf(Path(resolve(a.draft)[1]))
    vocab = target_tok.backend.get_vocab_size()
    m = VocabMap(draft_tok, target_tok, vocab)
    reachable = set(m.d2t[m.d2t >= 0].tolist())
    allowed = (m.d2t >= 0).tolist()
    total = unreachable = draft_total = draft_outside = 0
    missing: Counter = Counter()
    for run in results["runs"]:
        if run["system"] != a.system or run["repeat"] != 0:
            continue
        for out in run["tokens"]:
            out = [t for t in out if t not in target_tok.eos_ids]
            total += len(out)
            for t in out:
                if t not in reachable:
                    unreachable += 1
                    missing[target_tok.decode([t])] += 1
            ids = draft_tok.backend.encode(target_tok.decode(out), add_special_tokens=False).ids
            draft_total += len(ids)
            draft_outside += sum(not allowed[i] for i in ids)
    print(m.describe())
    print(f"target output tokens no draft token maps onto: {unreachable}/{total} = {unreachable / max(total, 1):.3f}")
    print(f"draft tokens of the same text outside the intersection: {draft_outside}/{draft_total} = "
          f"{draft_outside / max(draft_total, 1):.3f}")
    print("most frequent unreachable:", ", ".join(f"{t!r} x{n}" for t, n in missing.most_common(10)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
