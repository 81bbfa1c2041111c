"""`specdec train eagle`: distil an EAGLE-style head from the target's own features.

Loss per position: soft cross-entropy to the target's next-token distribution
(over the reduced draft vocabulary) + a smooth-L1 feature regression; a second
unrolled step feeds the head its own predicted features (robustness at depth >= 2).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.eagle import EagleHead
from .features import begin, split_heldout, training_set, vocab_subset, windows
from .loop import Checkpoint, train_loop


def head_losses(head: EagleHead, toks, f, lens, w_sub, unroll: int = 2):
    """Soft CE + feature regression for `unroll` autoregressive steps; returns (loss, top-1 agreement per step)."""
    B, W, H = f.shape
    valid = (torch.arange(W - 1)[None] + 1 < lens[:, None]).float()            # target position t+1 exists
    target_f = f[:, 1:]                                                         # f_{t+1}
    with torch.no_grad():
        p = torch.softmax(target_f @ w_sub.T, -1)                               # [B, W-1, V']
        p_arg = p.argmax(-1)
    feats_in = f[:, :-1]
    pos = torch.arange(W - 1).expand(B, W - 1)
    loss, accs = 0.0, []
    for step in range(unroll):
        cache = head.new_cache(B, W)
        pred = head(toks[:, 1:], feats_in, pos, cache, torch.arange(B))         # [B, W-1, H]
        logq = torch.log_softmax(pred @ w_sub.T, -1)
        m = valid.clone()
        if step:
            m[:, :step] = 0                                                     # inputs that are truly predicted
        n = m.sum().clamp(min=1)
        logq = logq.float()
        ce = -(p * logq).sum(-1)
        reg = F.smooth_l1_loss(pred.float(), target_f, reduction="none").mean(-1)
        loss = loss + ((ce + 0.5 * reg) * m).sum() / n * (1.0 if step == 0 else 0.5)
        accs.append(float(((logq.argmax(-1) == p_arg).float() * m).sum() / n))
        feats_in = torch.cat([f[:, :1], pred[:, :-1]], 1)                       # next step sees its own predictions
    return loss, accs


def train_eagle(model: str, data: Path, out: Path, minutes: float, vocab_size: int, window: int, batch: int,
                lr: float, max_seq: int, overwrite: bool, max_rows: int = 0, seed: int = 0,
                train_dtype: torch.dtype = torch.float32) -> dict:
    target, name, rng = begin(model, out, overwrite, seed, data)
    seqs, feats = training_set(target, name, data, max_rows, max_seq, rng)
    train_idx, eval_idx = split_heldout(len(seqs))
    ids = vocab_subset(seqs, vocab_size, target.vocab_size)
    head = EagleHead(target, ids)
    head.train()
    w_sub = head.lm_weight().float().detach()

    def step_fn() -> tuple[torch.Tensor, dict[str, str]]:
        idx = rng.sample(train_idx, min(batch, len(train_idx)))
        loss, accs = head_losses(head, *windows(seqs, feats, idx, window, rng)[:3], w_sub)
        return loss, {"acc1": f"{accs[0]:.2f}", "acc2": f"{accs[1]:.2f}"}

    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    ckpt = Checkpoint(out, head, opt, rng)
    steps, spent_min = train_loop("train eagle", params, opt, lr, minutes, ckpt, step_fn, dtype=train_dtype)
    head.eval()
    with torch.no_grad():
        accs_all = []
        for i in range(0, len(eval_idx), batch):
            toks, f, lens, _ = windows(seqs, feats, eval_idx[i:i + batch], window, random.Random(1))
            accs_all.append(head_losses(head, toks, f, lens, w_sub)[1])
    acc = [sum(a[k] for a in accs_all) / len(accs_all) for k in range(2)]
    report = {"target": name, "sequences": len(seqs), "tokens": sum(len(s) for s in seqs), "steps": steps,
              "minutes": spent_min, "vocab_size": len(ids),
              "heldout_top1_agreement": {"depth1": acc[0], "depth2_unrolled": acc[1]}}
    head.save(out, {"report": json.dumps(report)})
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    ckpt.done()
    return report
