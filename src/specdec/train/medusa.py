"""`specdec train medusa`: Medusa heads distilled from the target's features (soft targets)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import SpecdecError
from ..models.medusa import MedusaHeads
from .features import begin, split_heldout, training_set, vocab_subset
from .loop import Checkpoint, train_loop


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
                 batch: int, lr: float, max_seq: int, max_rows: int, overwrite: bool, seed: int = 0,
                 train_dtype: torch.dtype = torch.float32) -> dict:
    target, name, rng = begin(model, out, overwrite, seed, data)
    seqs, feats = training_set(target, name, data, max_rows, max_seq, rng)        # the same order as train eagle
    heads = MedusaHeads(target, vocab_subset(seqs, vocab_size, target.vocab_size), n_heads)
    w_sub = heads.lm_weight().float().detach()
    train_idx, eval_idx = split_heldout(len(seqs))
    shortest = max(window // 2, n_heads + 1)                   # every head has positions to learn in a window
    usable = [i for i in train_idx if len(seqs[i]) > shortest]
    if not usable or not [i for i in eval_idx if len(seqs[i]) > n_heads + 2]:
        raise SpecdecError(f"no rows long enough to train (> {shortest} tokens) or validate (> {n_heads + 2}) on; "
                           "give more data")

    def step_fn() -> tuple[torch.Tensor, dict[str, str]]:
        idx = rng.sample(usable, min(batch, len(usable)))
        W = min(window, min(len(seqs[i]) for i in idx))
        starts = [rng.randrange(0, len(seqs[i]) - W + 1) for i in idx]
        f = torch.stack([feats[i][s:s + W].float() for i, s in zip(idx, starts)])   # [B, W, H]
        loss, accs = medusa_loss(heads, f, w_sub)
        return loss, {"acc": " ".join(f"{a:.2f}" for a in accs)}

    params = [heads.w, heads.b]
    opt = torch.optim.AdamW(params, lr=lr)
    ckpt = Checkpoint(out, heads, opt, rng)
    steps, spent_min = train_loop("train medusa", params, opt, lr, minutes, ckpt, step_fn, dtype=train_dtype)
    with torch.no_grad():
        ev = [medusa_loss(heads, feats[i].float()[None], w_sub)[1] for i in eval_idx if len(seqs[i]) > n_heads + 2]
    acc = [sum(e[k] for e in ev) / len(ev) for k in range(n_heads)]
    report = {"target": name, "sequences": len(seqs), "tokens": sum(len(s) for s in seqs),
              "steps": steps, "minutes": spent_min,
              "vocab_size": int(heads.vocab_ids.numel()), "heldout_top1_agreement_per_head": acc}
    heads.save(out, {"report": json.dumps(report)})
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    ckpt.done()
    return report
