"""`specdec train medusa`: Medusa heads distilled from the target's features (soft targets)."""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..models.medusa import MedusaHeads
from .data import read_data
from .features import begin, extract, vocab_subset


def medusa_loss(heads: MedusaHeads, f: torch.Tensor, w_sub: torch.Tensor, decay: float = 0.8):
    """f [N, T, H] features of a window; head k at t learns the target's distribution at t+k. -> (loss, acc per head)."""
    K = heads.n_heads
    with torch.no_grad():
        p = torch.softmax(f @ w_sub.T, -1)                                      # [N, T, V'] target at each t
    logq = torch.log_softmax(heads.logits(f, w_sub), -1)                       # [N, T, K, V']
    loss, accs = 0.0, []
    for k in range(K):
        tgt = p[:, k + 1:]                                                      # distribution of x_{t+k+2}
        lq = logq[:, : f.shape[1] - k - 1, k]
        loss = loss + decay ** k * -(tgt * lq).sum(-1).mean()
        accs.append(float((lq.argmax(-1) == tgt.argmax(-1)).float().mean()))
    return loss, accs


def train_medusa(model: str, data: Path, out: Path, minutes: float, vocab_size: int, n_heads: int, window: int,
                 batch: int, lr: float, max_seq: int, max_rows: int, overwrite: bool, seed: int = 0) -> dict:
    target, name, rng = begin(model, out, overwrite, seed)
    rows = read_data(data)
    rows = rows[:max_rows] if max_rows > 0 else rows
    seqs = [r["tokens"][-max_seq:] for r in rows]
    random.Random(seed).shuffle(seqs)                                           # the same order as train eagle
    cache_file = data / f"features-{len(seqs)}-{max_seq}.pt"
    feats = torch.load(cache_file, weights_only=True) if cache_file.exists() else extract(target, seqs)
    if not cache_file.exists():
        torch.save(feats, cache_file)
    heads = MedusaHeads(target, vocab_subset(seqs, vocab_size, target.vocab_size), n_heads)
    w_sub = heads.lm_weight().float().detach()
    n_eval = max(8, len(seqs) // 20)
    usable = [i for i in range(n_eval, len(seqs)) if len(seqs[i]) > window // 2]
    opt = torch.optim.AdamW([heads.w, heads.b], lr=lr)
    t0 = time.time()
    bar = tqdm(desc="train medusa", unit="step")
    step = 0
    while time.time() - t0 < minutes * 60:
        idx = rng.sample(usable, min(batch, len(usable)))
        W = min(window, min(len(seqs[i]) for i in idx))
        f = torch.stack([feats[i][(s := rng.randrange(0, len(seqs[i]) - W + 1)):s + W].float() for i in idx])
        frac = (time.time() - t0) / (minutes * 60)
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, accs = medusa_loss(heads, f, w_sub)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc=" ".join(f"{a:.2f}" for a in accs))
    bar.close()
    with torch.no_grad():
        ev = [medusa_loss(heads, feats[i].float()[None], w_sub)[1] for i in range(n_eval) if len(seqs[i]) > n_heads + 2]
    acc = [sum(e[k] for e in ev) / len(ev) for k in range(n_heads)]
    report = {"target": name, "sequences": len(seqs), "steps": step, "minutes": (time.time() - t0) / 60,
              "vocab_size": int(heads.vocab_ids.numel()), "heldout_top1_agreement_per_head": acc}
    heads.save(out, {"report": json.dumps(report)})
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    return report
