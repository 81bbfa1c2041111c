"""Where a `specdec train eagle3` step spends its time on this machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_step_profile.py --rows 24 --steps 6

Extracts the target's features for `--rows` conversations of the committed shards (tokens/s), then
runs `--steps` training steps of the default recipe (8 windows x 128 tokens, 4 training-time-test
steps, 8192-token draft vocabulary) in each training dtype and prints the median time of each phase:
the batch (windows and features), the target's distribution over the draft vocabulary, the unrolled
TTT forward of the head's layer, the LM head and loss over the draft vocabulary, backward, and the
optimizer step (gradient clipping and AdamW). Also prints how much of the target's next-token
probability mass the most frequent V tokens of the data cover, for a few V.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from specdec.api import load_model
from specdec.machine import probe
from specdec.models.eagle3 import Eagle3Config, Eagle3Head
from specdec.train.eagle3 import STEP_DECAY, extract_aux, ttt_unroll
from specdec.train.features import windows
from specdec.train.features import vocab_subset
from specdec.train.magpie import read_shards


def _phases(head: Eagle3Head, w_sub: torch.Tensor, batch: tuple, steps: int, opt, params,
            dtype: torch.dtype) -> dict[str, float]:
    """One training step, timed phase by phase (seconds)."""
    toks, f, lens, _ = batch
    H, W = head.cfg.dim, toks.shape[1] - 1
    j = torch.arange(W)
    valid = (j[None] + 1 < lens[:, None])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        a = time.perf_counter()
        with torch.no_grad():
            p = torch.softmax(f[:, 1:, :H].float() @ w_sub.T, -1)                  # [B, W, V'] as ttt_losses
            p_arg = p.argmax(-1)
        b = time.perf_counter()
        outs = ttt_unroll(head, toks, f.float(), steps)
        c = time.perf_counter()
        loss = torch.zeros(())
        for s, h in enumerate(outs):
            logq = torch.log_softmax(head.logits(h).float(), -1)
            m = (valid & (j[None] >= s)).float()
            loss = loss + STEP_DECAY ** s * (-(p * logq).sum(-1) * m).sum() / m.sum().clamp(min=1)
            float(((logq.argmax(-1) == p_arg).float() * m).sum())
        d = time.perf_counter()
    opt.zero_grad()
    loss.backward()
    e = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    g = time.perf_counter()
    return {"target distribution": b - a, "TTT forward (layer)": c - b, "LM head + loss": d - c,
            "backward": e - d, "optimizer": g - e}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/smollm2-135m")
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    m = probe()
    print(f"CPU: {m.cpu}, torch {torch.__version__} {m.torch_capability}, {torch.get_num_threads()} thread(s)")
    target, _, _ = load_model("smollm2-135m", "auto")
    rows = read_shards(Path(a.data))
    seqs = [r.tokens[:640] for r in rows]
    cfg = Eagle3Config.for_target(target, 8192)
    ids = vocab_subset(seqs, cfg.draft_vocab, target.vocab_size)
    head = Eagle3Head(target, cfg, ids).init_from_target().train()
    sample = seqs[:a.rows]
    t = time.perf_counter()
    feats = extract_aux(target, sample, head.feature_layers)
    dt = time.perf_counter() - t
    print(f"feature extraction: {sum(map(len, sample))} tokens in {dt:.1f} s = {sum(map(len, sample)) / dt:.0f} tokens/s")
    w = target.output if target.output.numel() else target.embed
    w_sub = w[ids].float()
    full = w.float()
    for V in (2048, 4096, 8192, 16384):
        sub = vocab_subset(seqs, V, target.vocab_size)
        mass = [torch.softmax(f[:, :cfg.dim].float() @ full.T, -1)[:, sub].sum(-1) for f in feats]
        print(f"draft vocab {V}: covers {float(torch.cat(mass).mean()):.3f} of the target's next-token probability")
    params = [p for p in head.parameters() if p.requires_grad]
    rng = random.Random(0)
    for dtype in (torch.float32, torch.bfloat16):
        opt = torch.optim.AdamW(params, lr=1e-4)
        runs = [_phases(head, w_sub, windows(sample, feats, rng.sample(range(len(sample)), 8), 128, rng, torch.bfloat16),
                        4, opt, params, dtype) for _ in range(a.steps)]
        med = {name: statistics.median(r[name] for r in runs[1:]) for name in runs[0]}
        total = sum(med.values())
        print(f"\n{dtype}: {total * 1e3:.0f} ms per step (median of {a.steps - 1} after one warm-up)")
        for name, v in med.items():
            print(f"  {name:22s} {v * 1e3:8.0f} ms  {v / total:5.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
