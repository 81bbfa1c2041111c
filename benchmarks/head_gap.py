"""Why an EAGLE-3 head's validation agreement exceeds its first-draft acceptance when serving.

Teacher-forced depth-1 agreement of a head on the held-out rows of the training shards, counted three ways:

  train       what training reports: every position of the conversation (system prompt, chat template,
              question and answer), against the target's argmax *within the head's draft vocabulary*;
  answers     answer positions only (what serving drafts), still within the draft vocabulary;
  served      answer positions, against the target's argmax over its whole vocabulary: a token outside
              the draft vocabulary is a miss, as it is when drafting.

The last is what first-draft acceptance measures for greedy drafting on such text. Usage:

    .venv/bin/python benchmarks/head_gap.py [--rows 48] [--max-seq 512] [--head PATH] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from specdec.api import load_model, shipped
from specdec.models.eagle3 import Eagle3Head
from specdec.train.eagle3 import extract_aux, ttt_unroll
from specdec.train.magpie import read_shards

DATA = Path(__file__).resolve().parents[1] / "data" / "smollm2-135m"


@torch.inference_mode()
def agreement(head: Eagle3Head, target, toks: list[int], feats: torch.Tensor, answer: list[int]) -> dict[str, tuple[int, int]]:
    """(agreeing, counted) per way of counting, for one sequence; position j's draft is token j + 2."""
    H = head.cfg.dim
    t = torch.tensor(toks)[None]                                                # [1, T]
    f = feats[None].float()                                                     # [1, T, F]
    h = ttt_unroll(head, t, f, 1)[0][0]                                         # [T-1, H] step 0 (teacher-forced)
    ids = head.vocab_ids
    draft = ids[head.logits(h).float().argmax(-1)]                              # [T-1] the head's draft for j + 2
    final = f[0, 1:, :H]                                                        # [T-1, H] target state at j + 1
    w = target.output if target.output.numel() else target.embed
    full = (final @ w.float().T).argmax(-1)                                     # [T-1] target's argmax, whole vocab
    within = ids[(final @ w[ids].float().T).argmax(-1)]                         # [T-1] ... within the draft vocab
    n = len(toks) - 2                                                           # positions with a next token
    is_answer = torch.tensor(answer[2:len(toks)], dtype=torch.bool)[:n]
    draft, full, within = draft[:n], full[:n], within[:n]
    return {"train": (int((draft == within).sum()), n),
            "answers": (int((draft == within)[is_answer].sum()), int(is_answer.sum())),
            "served": (int((draft == full)[is_answer].sum()), int(is_answer.sum())),
            "in_vocab": (int(torch.isin(full[is_answer], ids).sum()), int(is_answer.sum()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=48, help="held-out rows to measure")
    ap.add_argument("--max-seq", type=int, default=512, help="tokens per row")
    ap.add_argument("--head", default=None, help="an EAGLE-3 head (.safetensors; default: the shipped one)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, _, name = load_model("smollm2-135m", a.dtype)
    head = Eagle3Head.load(Path(a.head) if a.head else shipped(name, "eagle3"), target).float().eval()
    rows = [r for r in read_shards(DATA) if r.validation][:a.rows]
    seqs = [r.tokens[:a.max_seq] for r in rows]
    feats = extract_aux(target, seqs, head.feature_layers)
    total: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    per_cat: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r, s, f in zip(rows, seqs, feats):
        for way, (k, n) in agreement(head, target, s, f, r.answer_mask).items():
            total[way][0] += k
            total[way][1] += n
            per_cat[r.category][way][0] += k
            per_cat[r.category][way][1] += n
    out = {"model": name, "dtype": target.compute, "rows": len(rows),
           "overall": {w: round(k / max(n, 1), 3) for w, (k, n) in total.items()},
           "per_category": {c: {w: round(k / max(n, 1), 3) for w, (k, n) in d.items()} for c, d in sorted(per_cat.items())}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
