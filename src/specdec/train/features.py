"""Teacher-forced target features for training heads: the target's final hidden states per token."""
from __future__ import annotations

import contextlib
import random
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor
from tqdm import tqdm

from ..models.decoder import Transformer


@torch.inference_mode()
def extract(target: Transformer, seqs: list[list[int]], batch: int = 8, desc: str = "features") -> list[Tensor]:
    """Final-normed hidden states [T, H] (bfloat16) for each token sequence (one target forward per batch)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[Tensor] = [torch.empty(0)] * len(seqs)
    bar = tqdm(total=sum(len(s) for s in seqs), desc=desc, unit="tok", unit_scale=True)
    for i in range(0, len(order), batch):
        idx = order[i:i + batch]
        T = max(len(seqs[j]) for j in idx)
        toks = torch.zeros(len(idx), T, dtype=torch.long)
        for r, j in enumerate(idx):
            toks[r, :len(seqs[j])] = torch.tensor(seqs[j])
        cache = target.new_cache(len(idx), T)
        h = target(toks, torch.arange(T).expand(len(idx), T), cache, torch.arange(len(idx)))
        for r, j in enumerate(idx):
            out[j] = h[r, :len(seqs[j])].to(torch.bfloat16).clone()
        bar.update(sum(len(seqs[j]) for j in idx))
    bar.close()
    return out


def windows(seqs: list[list[int]], feats: list[Tensor], idx: list[int], window: int, rng: random.Random,
            dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random aligned windows of the sequences `idx` names (one rng.randrange per sequence, in order): tokens
    [B, W], their target features [B, W, F] in `dtype` (right-padded with zeros), lengths [B] and start
    offsets [B]; W = min(window, the longest sequence)."""
    W = min(window, max(len(seqs[i]) for i in idx))
    toks = torch.zeros(len(idx), W, dtype=torch.long)
    f = torch.zeros(len(idx), W, feats[idx[0]].shape[-1], dtype=dtype)
    lens = torch.zeros(len(idx), dtype=torch.long)
    starts = torch.zeros(len(idx), dtype=torch.long)
    for r, i in enumerate(idx):
        n = len(seqs[i])
        a = rng.randrange(0, max(1, n - W + 1))
        m = min(W, n - a)
        toks[r, :m] = torch.tensor(seqs[i][a:a + m])
        f[r, :m] = feats[i][a:a + m]
        lens[r], starts[r] = m, a
    return toks, f, lens, starts


def check_output(out: Path, overwrite: bool) -> None:
    """Before any work: `out` must be a writable file path, and not an existing file unless --overwrite (or its
    checkpoint beside it says the run resumes)."""
    from ..errors import SpecdecError
    from ..files import writable_file

    writable_file(out, "--out")
    if out.suffix != ".safetensors":
        raise SpecdecError(f"--out must name a .safetensors file (the trained weights; the report, learning curve "
                           f"and checkpoint are written beside it), got {out}")
    if overwrite or out.with_suffix(".ckpt").exists():
        return
    for f in (out, out.with_suffix(".json"), out.with_suffix(".curve.jsonl")):
        if f.exists():
            raise SpecdecError(f"{f} exists; pass --overwrite to replace it")


def split_heldout(n: int) -> tuple[list[int], list[int]]:
    """(training, held-out) indices of n shuffled rows: max(8, n / 20) held out; a clear error where none is left
    to train on."""
    from ..errors import SpecdecError

    n_eval = max(8, n // 20)
    if n <= n_eval:
        raise SpecdecError(f"{n} rows leave none to train on after the {n_eval} held out for validation; give "
                           f"more data (a larger --max-rows, or more rows in --data)")
    return list(range(n_eval, n)), list(range(n_eval))


def begin(model: str, out: Path, overwrite: bool, seed: int, data: Path,
          checked: bool = False) -> tuple[Transformer, str, random.Random]:
    """The common start of a training run: refuse to overwrite `out` (unless a checkpoint beside it says the run
    resumes: runs refresh `out` while they train; with `overwrite` the checkpoint goes: a fresh run; `checked`:
    the caller decided about its own outputs), seed, load the target (dtype auto) and refuse `data` written under
    another tokenizer."""
    from . import source
    from ..api import load_model
    from ..errors import SpecdecError

    if not checked:
        check_output(out, overwrite)
        if overwrite:                                            # afresh: no old run resumes, no old report stays
            for old in (out.with_suffix(".ckpt"), out.with_suffix(".json"), out.with_suffix(".ckpt.tmp")):
                try:
                    old.unlink(missing_ok=True)
                except OSError as e:
                    raise SpecdecError(f"--overwrite cannot remove {old}: {e.strerror or e}") from None
    torch.manual_seed(seed)
    target, tokenizer, name = load_model(model, "auto")
    source.check(Path(data), name, tokenizer)
    return target, name, random.Random(seed)


def vocab_subset(seqs: list[list[int]], size: int, vocab: int) -> Tensor:
    """The `size` most frequent token ids of the data (sorted ids); a clear error where the data holds ids
    outside the target's vocabulary (data written for another model)."""

    check_ids(seqs, vocab)
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(torch.tensor(s, dtype=torch.long), minlength=vocab)
    return counts.topk(min(size, vocab)).indices.sort().values


def check_ids(seqs: list[list[int]], vocab: int) -> None:
    """A clear error where the data holds token ids outside the target's vocabulary (data for another model)."""
    from ..errors import SpecdecError

    for s in seqs:
        if s and not 0 <= min(s) <= max(s) < vocab:
            raise SpecdecError(f"the training data holds token ids outside the target's vocabulary [0, {vocab}): "
                               "data for another model? (--data)")


def sequences_digest(seqs: list[list[int]]) -> str:
    """A short digest of token sequences: part of a feature cache's name, so that other data of the same shape
    (another --data with the same shard names) never reads these features."""
    import hashlib

    h = hashlib.sha256()
    for s in seqs:
        h.update(len(s).to_bytes(4, "little"))
        h.update(torch.tensor(s, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:12]


def cached(path: Path, compute: Callable[[], list[Tensor]], shapes: Sequence[tuple[int, ...]] = ()) -> list[Tensor]:
    """Features kept in `path`: loaded where a whole file is there, else computed and written atomically (a
    temporary file renamed into place, so an interrupted write never leaves a file that looks whole). A file
    that does not load (damaged), or whose tensors are not of `shapes` (where given), is computed again, with a
    note."""
    if path.exists():
        try:
            feats = torch.load(path, weights_only=True)
            if shapes and not (isinstance(feats, list) and len(feats) == len(shapes) and all(
                    isinstance(t, Tensor) and tuple(t.shape) == tuple(want) for t, want in zip(feats, shapes))):
                raise ValueError("its tensors are not of the shapes these rows give")
            return feats
        except (RuntimeError, OSError, EOFError, ValueError) as e:
            print(f"note: {path} does not load ({(str(e).strip().splitlines() or [''])[0][:120]}); extracting again", file=sys.stderr)
    feats = compute()
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(feats, tmp)
        tmp.replace(path)
    except (OSError, RuntimeError) as e:             # torch.save reports an unwritable file as RuntimeError
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        print(f"note: cannot keep the features in {path} ({(str(e).strip().splitlines() or [''])[0][:120]}); "
              "training goes on, the next run extracts them again", file=sys.stderr)
    return feats


def default_feature_dir(model: str) -> Path:
    """Where features are cached without --features: $SPECDEC_CACHE/features/MODEL (never the data directory,
    which may be the source tree's shipped shards)."""
    from ..models.registry import cache_dir

    return cache_dir() / "features" / model


def training_set(target: Transformer, name: str, data, max_rows: int, max_seq: int,
                 rng) -> tuple[list[list[int]], list[Tensor]]:
    """The self-distillation sequences (last `max_seq` tokens, shuffled by `rng`) and the final features of the
    target named `name`, extracted once per set of rows and cached under `default_feature_dir(name)` (never in
    the data's folder, which may be read-only or the source tree's shipped shards)."""
    from .data import read_data

    rows = read_data(Path(data))
    rows = rows[:max_rows] if max_rows > 0 else rows
    seqs = [r["tokens"][-max_seq:] for r in rows]
    rng.shuffle(seqs)
    cache_file = default_feature_dir(name) / f"features-{len(seqs)}-{max_seq}-{sequences_digest(seqs)}.pt"
    return seqs, cached(cache_file, lambda: extract(target, seqs))
