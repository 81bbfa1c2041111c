"""`specdec train exit`: the exit of a self-speculative draft (the target's first N layers).

Only the exit trains (a per-channel scale and an H x H projection onto the target's LM-head rows of a
reduced vocabulary): soft cross-entropy to the target's next-token distribution, on the target's
features of self-generated conversations (layer N's output and the final hidden state, extracted
once). Validation rows are never trained on; top-1 agreement per category is reported.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import Tensor

from ..errors import SpecdecError
from ..files import writable_dir
from ..models.decoder import Transformer, rms_norm
from ..models.early_exit import EarlyExitDraft
from .eagle3 import extract_aux
from .features import begin, cached, check_output, default_feature_dir, sequences_digest, vocab_subset
from .loop import Checkpoint, train_loop
from .magpie import no_shards, read_shards


def exit_losses(draft: EarlyExitDraft, feats: Tensor, w_sub: Tensor) -> tuple[Tensor, float]:
    """feats [M, 2H] (final hidden, layer N's output) -> (soft CE, top-1 agreement)."""
    t = draft.target[0]
    H = t.config.dim
    with torch.no_grad():
        p = torch.softmax(feats[:, :H].float() @ w_sub.T, -1)                   # [M, V'] the target
        x = rms_norm(feats[:, H:].float(), t.norm.float(), t.config.norm_eps)    # the truncated target's output
    logq = torch.log_softmax(draft.exit(x) @ w_sub.T, -1)
    return -(p * logq).sum(-1).mean(), float((logq.argmax(-1) == p.argmax(-1)).float().mean())


def exit_paths(out: Path, layers: list[int]) -> dict[int, Path]:
    """Where each exit is written: `out` for one N, OUT-N.safetensors for several."""
    return {n: out if len(layers) == 1 else out.with_name(f"{out.stem}-{n}{out.suffix}") for n in layers}


def train_exit(model: str, data: Path, out: Path, minutes: float, layers: list[int], vocab_size: int, batch: int,
               lr: float, max_seq: int, overwrite: bool, max_rows: int = 0, seed: int = 0,
               train_dtype: torch.dtype = torch.float32, features: Path | str = "") -> dict:
    """One exit per N in `layers` (features extracted once for all, cached in `features`, default
    $SPECDEC_CACHE/features/MODEL), each trained for `minutes`; written to `out` (one N) or OUT-N.safetensors
    (several). Without `overwrite` an exit already written (no checkpoint beside it) is kept: a re-run of an interrupted run
    trains only the others; where every one is written, the run is refused. -> the reports by N."""
    if len(set(layers)) != len(layers):
        raise SpecdecError(f"--layers names a layer count twice: {layers}")
    paths = exit_paths(out, layers)
    for path in paths.values():
        check_output(path, overwrite=True)                     # writable; existing ones are decided below
    done = [] if overwrite else [n for n, p in paths.items() if p.exists() and not p.with_suffix(".ckpt").exists()]
    if done and len(done) == len(layers):
        raise SpecdecError(f"{', '.join(str(paths[n]) for n in done)} exist; pass --overwrite to replace them")
    if overwrite:                                              # every exit's interrupted run is discarded
        for path in paths.values():
            path.with_suffix(".ckpt").unlink(missing_ok=True)
    if not Path(data).is_dir():                       # before the model loads
        raise no_shards(Path(data))
    target, name, rng = begin(model, out, overwrite, seed, data, checked=True)     # its outputs are OUT-N: checked above
    if not isinstance(target, Transformer):
        raise SpecdecError("exit training needs a lean GGUF target")
    L = target.config.n_layers
    if not layers or any(not 1 <= n < L for n in layers):
        raise SpecdecError(f"--layers must be in 1..{L - 1}, got {layers}")
    rows = read_shards(data)
    if not rows:
        raise no_shards(Path(data))
    rows = rows[:max_rows] if max_rows > 0 else rows
    seqs = [r.tokens[:max_seq] for r in rows]
    ids = vocab_subset(seqs, min(vocab_size, target.vocab_size), target.vocab_size)
    cache_dir = Path(features) if features else default_feature_dir(name)
    writable_dir(cache_dir, "--features")
    cache_file = cache_dir / (f"features-exit{'-'.join(map(str, layers))}-{len(seqs)}-{max_seq}-"
                              f"{sequences_digest(seqs)}.pt")             # other data never reads these features
    feats = cached(cache_file, lambda: extract_aux(target, seqs, tuple(n - 1 for n in layers)),
                   [(len(s), target.config.dim * (1 + len(layers))) for s in seqs])
    H = target.config.dim
    reports = {}
    for j, n in enumerate(layers):
        if n in done:
            print(f"kept {paths[n]} (written by an earlier run; --overwrite retrains it)", file=sys.stderr)
            continue
        cols = torch.cat([torch.arange(H), torch.arange(H * (1 + j), H * (2 + j))])      # final, layer n's output
        reports[n] = _train_one(target, name, n, ids, rows, [f[:, cols] for f in feats], paths[n], minutes, batch,
                               lr, rng, train_dtype)
    return reports


def _train_one(target: Transformer, name: str, n_layers: int, ids: Tensor, rows, feats: list[Tensor], out: Path,
               minutes: float, batch: int, lr: float, rng, train_dtype: torch.dtype) -> dict:
    draft = EarlyExitDraft(target, n_layers, ids)
    train = torch.cat([f for f, r in zip(feats, rows) if not r.validation])   # [M, 2H] every position
    by_cat: dict[str, list[Tensor]] = {}
    for f, r in zip(feats, rows):
        if r.validation:
            by_cat.setdefault(r.category, []).append(f)
    w_sub = draft.lm_rows().float().detach()
    draft.train()

    def step_fn() -> tuple[Tensor, dict[str, str]]:
        idx = torch.randint(0, train.shape[0], (batch,), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        loss, agree = exit_losses(draft, train[idx], w_sub)
        return loss, {"agree": f"{agree:.2f}"}

    params = [draft.scale, draft.proj]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    ckpt = Checkpoint(out, draft, opt, rng)
    steps, spent = train_loop(f"train exit N={n_layers}", params, opt, lr, minutes, ckpt, step_fn,
                              dtype=train_dtype)
    draft.eval()
    with torch.no_grad():
        val = {c: round(exit_losses(draft, torch.cat(fs), w_sub)[1], 4) for c, fs in sorted(by_cat.items())}
        untrained = EarlyExitDraft(target, n_layers, ids)
        base = {c: round(exit_losses(untrained, torch.cat(fs), w_sub)[1], 4) for c, fs in sorted(by_cat.items())}
    report = {"target": name, "n_layers": n_layers, "rows": len(rows), "tokens": int(train.shape[0]), "steps": steps,
              "minutes": spent, "vocab_size": len(ids), "validation_top1_agreement": val,
              "validation_top1_agreement_untrained_exit": base}
    draft.save(out, {"report": json.dumps(report)})
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    ckpt.done()
    return report
