"""`specdec train eagle`: distil an EAGLE-style head from the target's own features.

Loss per position: soft cross-entropy to the target's next-token distribution
(over the reduced draft vocabulary) + a smooth-L1 feature regression; a second
unrolled step feeds the head its own predicted features (robustness at depth >= 2).
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..models.eagle import EagleHead
from .features import begin, training_set, vocab_subset


def _windows(seqs, feats, idx, window, rng):
    """A batch of aligned windows: tokens [B, W], features [B, W, H] (right-padded) and lengths."""
    B = len(idx)
    W = min(window, max(len(seqs[i]) for i in idx))
    toks = torch.zeros(B, W, dtype=torch.long)
    f = torch.zeros(B, W, feats[idx[0]].shape[-1])
    lens = torch.zeros(B, dtype=torch.long)
    for r, i in enumerate(idx):
        n = len(seqs[i])
        start = rng.randrange(0, max(1, n - W + 1))
        m = min(W, n - start)
        toks[r, :m] = torch.tensor(seqs[i][start:start + m])
        f[r, :m] = feats[i][start:start + m].float()
        lens[r] = m
    return toks, f, lens


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
                lr: float, max_seq: int, overwrite: bool, max_rows: int = 0, seed: int = 0) -> dict:
    target, name, rng = begin(model, out, overwrite, seed)
    seqs, feats = training_set(target, data, max_rows, max_seq, rng)
    n_eval = max(8, len(seqs) // 20)
    ids = vocab_subset(seqs, vocab_size, target.vocab_size)
    head = EagleHead(target, ids)
    head.train()
    w_sub = head.lm_weight().float().detach()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    ckpt = out.with_suffix(".ckpt")
    step0 = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step0 = state["step"]
    train_idx, eval_idx = list(range(n_eval, len(seqs))), list(range(n_eval))
    t_end = time.time() + minutes * 60
    t0 = time.time()
    bar = tqdm(desc="train eagle", unit="step")
    step = step0
    while time.time() < t_end:
        idx = rng.sample(train_idx, min(batch, len(train_idx)))
        toks, f, lens = _windows(seqs, feats, idx, window, rng)
        frac = min(1.0, (time.time() - t0) / (minutes * 60))
        for g in opt.param_groups:
            g["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        with torch.autocast("cpu", dtype=torch.bfloat16):          # AVX-512 bf16 matmuls; master weights fp32
            loss, accs = head_losses(head, toks, f, lens, w_sub)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc1=f"{accs[0]:.2f}", acc2=f"{accs[1]:.2f}")
        if step % 200 == 0:
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
    bar.close()
    head.eval()
    with torch.no_grad():
        accs_all = []
        for i in range(0, len(eval_idx), batch):
            toks, f, lens = _windows(seqs, feats, eval_idx[i:i + batch], window, random.Random(1))
            accs_all.append(head_losses(head, toks, f, lens, w_sub)[1])
    acc = [sum(a[k] for a in accs_all) / len(accs_all) for k in range(2)]
    report = {"target": name, "sequences": len(seqs), "tokens": sum(len(s) for s in seqs), "steps": step,
              "minutes": (time.time() - t0) / 60, "vocab_size": len(ids),
              "heldout_top1_agreement": {"depth1": acc[0], "depth2_unrolled": acc[1]}}
    out.parent.mkdir(parents=True, exist_ok=True)
    head.save(out, {"report": json.dumps(report)})
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    ckpt.unlink(missing_ok=True)
    return report
