"""Why an EAGLE-3 head's validation agreement exceeds its first-draft acceptance when serving.

Teacher-forced depth-1 agreement of a head on the held-out rows of the training shards, counted three ways:

  train       what training reports: every position of the conversation (system prompt, chat template,
              question and answer), against the target's argmax *within the head's draft vocabulary*;
  answers     answer positions only (what serving drafts), still within the draft vocabulary;
  served      answer positions, against the target's argmax over its whole vocabulary: a token outside
              the draft vocabulary is a miss, as it is when drafting.

The last is what first-draft acceptance measures for greedy drafting on such text. `--by-position` adds the
served agreement per span of positions in the row and per band of the target's top-1 probability, and at the answer positions of each row's last `--window`
tokens the served agreement with the head seeing the whole row against seeing only those tokens (what a training
window shows it). Usage:

    .venv/bin/python benchmarks/head_gap.py [--rows 48] [--max-seq 512] [--head PATH] [--threads 1] [--by-position]
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


SPANS = (0, 64, 128, 192, 256, 384, 512)
CONFIDENCE = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)


@torch.inference_mode()
def by_position(head: Eagle3Head, target, toks: list[int], feats: torch.Tensor, answer: list[int],
                window: int) -> dict[str, tuple[int, int]]:
    """(agreeing, counted) served agreement per span of draft positions ("span N": positions N.. up to the next
    span), per band of the target's own top-1 probability at the drafted token, and over the answer positions of the last `window` tokens with the whole row as context ("whole row")
    or only those tokens ("window only")."""
    H, T = head.cfg.dim, len(toks)
    t, f = torch.tensor(toks)[None], feats[None].float()                       # [1, T], [1, T, F]
    w = target.output if target.output.numel() else target.embed
    full = (f[0, 1:, :H] @ w.float().T).argmax(-1)[:T - 2]                     # [T-2] target's token j + 2
    ok = head.vocab_ids[head.logits(ttt_unroll(head, t, f, 1)[0][0]).float().argmax(-1)][:T - 2] == full
    is_answer = torch.tensor(answer[2:T], dtype=torch.bool)[:T - 2]
    top = torch.softmax(f[0, 1:T - 1, :H] @ w.float().T, -1).max(-1).values    # [T-2] target's top probability
    out: dict[str, tuple[int, int]] = {}
    for lo, hi in zip(CONFIDENCE, CONFIDENCE[1:]):
        m = is_answer & (top >= lo) & (top < hi)
        out[f"target top-1 probability {lo}-{min(hi, 1)}"] = (int(ok[m].sum()), int(m.sum()))
    for lo, hi in zip(SPANS, SPANS[1:] + (T,)):
        m = is_answer[lo:hi]
        out[f"span {lo}"] = (int(ok[lo:hi][m].sum()), int(m.sum()))
    a = T - window
    if a > 0:
        alone = ttt_unroll(head, t[:, a:], f[:, a:], 1)[0][0]                  # [window - 1, H]
        ok_alone = head.vocab_ids[head.logits(alone).float().argmax(-1)][:window - 2] == full[a:]
        m = is_answer[a:]
        out["whole row"] = (int(ok[a:][m].sum()), int(m.sum()))
        out["window only"] = (int(ok_alone[m].sum()), int(m.sum()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=48, help="held-out rows to measure")
    ap.add_argument("--max-seq", type=int, default=512, help="tokens per row")
    ap.add_argument("--head", default=None, help="an EAGLE-3 head (.safetensors; default: the shipped one)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--by-position", action="store_true", help="served agreement per span of positions, and with "
                                                                "the whole row against a training window as context")
    ap.add_argument("--window", type=int, default=128, help="the training window compared with --by-position")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, _, name = load_model("smollm2-135m", a.dtype)
    head = Eagle3Head.load(Path(a.head) if a.head else shipped(name, "eagle3"), target).float().eval()
    rows = [r for r in read_shards(DATA) if r.validation][:a.rows]
    seqs = [r.tokens[:a.max_seq] for r in rows]
    feats = extract_aux(target, seqs, head.feature_layers)
    total: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    per_cat: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    spans: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r, s, f in zip(rows, seqs, feats):
        if a.by_position:
            for key, (k, n) in by_position(head, target, s, f, r.answer_mask, a.window).items():
                spans[key][0] += k
                spans[key][1] += n
        for way, (k, n) in agreement(head, target, s, f, r.answer_mask).items():
            total[way][0] += k
            total[way][1] += n
            per_cat[r.category][way][0] += k
            per_cat[r.category][way][1] += n
    out = {"model": name, "dtype": target.compute, "rows": len(rows),
           "overall": {w: round(k / max(n, 1), 3) for w, (k, n) in total.items()},
           "per_category": {c: {w: round(k / max(n, 1), 3) for w, (k, n) in d.items()} for c, d in sorted(per_cat.items())}}
    if a.by_position:
        out["served_by_position"] = {key: [round(k / max(n, 1), 3), n] for key, (k, n) in spans.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
