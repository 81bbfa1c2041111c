"""`specdec train draft`: distil a small draft model from the target's own outputs.

The draft is a few of the target's layers (see models/distilled.py), retrained with
the KL divergence to the target's next-token distributions (over the draft's reduced
vocabulary), teacher-forced on the target's own generations. The target's
distributions come from its cached final features, so a step costs only the draft.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from ..errors import SpecdecError
from ..models.distilled import DistilledDraft
from .features import begin, split_heldout, training_set, vocab_subset, windows
from .loop import Checkpoint, train_loop


def draft_losses(draft: DistilledDraft, toks: torch.Tensor, f: torch.Tensor, lens: torch.Tensor,
                 w_sub: torch.Tensor) -> tuple[torch.Tensor, float]:
    """KL(target || draft) per position over the reduced vocabulary; returns (loss, top-1 agreement)."""
    B, W = toks.shape
    valid = (torch.arange(W)[None] < lens[:, None]).float()                     # [B, W]
    with torch.no_grad():
        logp = torch.log_softmax(f @ w_sub.T, -1)                               # [B, W, V'] target at t -> t+1
    cache = draft.new_cache(B, W)
    h = draft(toks, torch.arange(W).expand(B, W), cache, torch.arange(B))        # [B, W, H]
    logq = torch.log_softmax(draft.sub_logits(h), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)                                   # [B, W]
    n = valid.sum().clamp(min=1)
    agree = float(((logq.argmax(-1) == logp.argmax(-1)).float() * valid).sum() / n)
    return (kl * valid).sum() / n, agree


def train_draft(model: str, data: Path, out: Path, minutes: float, layers: list[int], vocab_size: int,
                window: int, batch: int, lr: float, max_seq: int, max_rows: int, overwrite: bool,
                seed: int = 0, train_dtype: torch.dtype = torch.float32) -> dict:
    target, name, rng = begin(model, out, overwrite, seed, data)
    layers = layers or [0, target.config.n_layers - 1]                   # default: the first and the last
    bad = [i for i in layers if not 0 <= i < target.config.n_layers]
    if bad:
        raise SpecdecError(f"--layers must name target layers in 0..{target.config.n_layers - 1}, got {layers}")
    seqs, feats = training_set(target, name, data, max_rows, max_seq, rng)
    train_idx, eval_idx = split_heldout(len(seqs))
    ids = vocab_subset(seqs, vocab_size, target.vocab_size)
    draft = DistilledDraft(target, ids, layers)
    draft.train()
    w_sub = (target.output if target.output.numel() else target.embed)[ids].float().detach()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    def step_fn() -> tuple[torch.Tensor, dict[str, str]]:
        idx = rng.sample(train_idx, min(batch, len(train_idx)))
        loss, agree = draft_losses(draft, *windows(seqs, feats, idx, window, rng)[:3], w_sub)
        return loss, {"agree": f"{agree:.2f}"}

    ckpt = Checkpoint(out, draft, opt, rng)
    steps, spent_min = train_loop("train draft", params, opt, lr, minutes, ckpt, step_fn, dtype=train_dtype)
    draft.eval()
    with torch.no_grad():
        agrees = [draft_losses(draft, *windows(seqs, feats, eval_idx[i:i + batch], window, random.Random(1))[:3],
                               w_sub)[1] for i in range(0, len(eval_idx), batch)]
    report = {"target": name, "layers": layers, "sequences": len(seqs), "tokens": sum(len(s) for s in seqs),
              "steps": steps, "minutes": spent_min, "vocab_size": len(ids),
              "heldout_top1_agreement": sum(agrees) / len(agrees)}
    draft.save(out, {"report": json.dumps(report)})
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    ckpt.done()
    return report
