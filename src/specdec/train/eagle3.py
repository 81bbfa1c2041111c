"""`specdec train eagle3`: an EAGLE-3 head trained with training-time test.

Per window of a self-generated conversation, step 0 is teacher-forced: at position j the head reads
the fused target feature g_j and token x_{j+1} and predicts the target's distribution of x_{j+2}
(soft cross-entropy over the draft vocabulary; no feature regression). Step s >= 1 feeds the head
its own output of step s-1 at position j-1 in place of g_{j-1}'s successor, exactly as drafting
does, and its query attends to what it would see while drafting: step-0 keys up to j-s, then the
key of step r at position j-s+r for r = 1..s. Loss weights decay 0.8^s. Validation rows (every 20th
row, by key) are never trained on; acceptance per position per category is reported on them.
"""
from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from ..errors import SpecdecError
from ..models.decoder import Transformer
from ..models.eagle import read_weights
from ..models.eagle3 import Eagle3Config, Eagle3Head
from .features import begin, cached, check_ids, sequences_digest, vocab_subset, windows
from .loop import Checkpoint, autocast, train_loop
from .magpie import Row, no_shards, read_shards

STEP_DECAY = 0.8


@torch.inference_mode()
def extract_aux(target: Transformer, seqs: list[list[int]], layers: tuple[int, ...], piece: int = 256) -> list[Tensor]:
    """Per sequence, the target's final-normed hidden states and aux features [T, H*(1+n)] (bfloat16),
    through the prefill path (one sequence per forward, in pieces of `piece` tokens)."""
    out: list[Tensor] = []
    cache = target.new_cache(1, max(len(s) for s in seqs))
    row = torch.zeros(1, dtype=torch.long)
    bar = tqdm(total=sum(len(s) for s in seqs), desc="features", unit="tok", unit_scale=True)
    for s in seqs:
        cache.truncate(row, torch.zeros(1, dtype=torch.long))
        parts = []
        for a in range(0, len(s), piece):
            toks = torch.tensor(s[a:a + piece])[None]
            h = target.prefill(toks, torch.arange(a, a + toks.shape[1])[None], cache, row, features=layers)
            cache.commit(row, torch.arange(toks.shape[1])[None], torch.tensor([toks.shape[1]]))
            parts.append(h[0].to(torch.bfloat16))
        out.append(torch.cat(parts))
        bar.update(len(s))
    bar.close()
    return out


def _repeat_kv(x: Tensor, n: int) -> Tensor:
    return x.repeat_interleave(n, dim=1) if n > 1 else x


def _shift(x: Tensor, by: int) -> Tensor:
    """x [B, h, T, d] moved `by` positions later along T (zeros in front)."""
    return x if by == 0 else torch.cat([torch.zeros_like(x[:, :, :by]), x[:, :, :-by]], 2)


def _ttt_attend(q: Tensor, keys: list[Tensor], values: list[Tensor], s: int, scale: float) -> Tensor:
    """Step s's attention o [B, nh, W, hd] for queries q [B, nh, W, hd] over one layer's keys and values of
    steps 0..s (each [B, nh, W, hd]): at position j, step-0 keys up to j-s, then step r's key at j-s+r."""
    W = q.shape[2]
    j = torch.arange(W)
    s0 = (q @ keys[0].transpose(-1, -2)) * scale                               # [B, nh, W, W]
    s0 = s0.masked_fill(~(j[None, :] <= j[:, None] - s), float("-inf"))        # step-0 keys up to j-s
    diag = [(q * _shift(keys[r], s - r)).sum(-1, keepdim=True) * scale         # step r's key at j-s+r
            for r in range(1, s + 1)]
    att = torch.softmax(torch.cat([s0, *diag], -1), -1)
    o = att[..., :W] @ values[0]
    for r in range(1, s + 1):
        o = o + att[..., W + r - 1:W + r] * _shift(values[r], s - r)
    return o


def ttt_unroll(head: Eagle3Head, toks: Tensor, feats: Tensor, steps: int) -> list[Tensor]:
    """The head's outputs h [B, W-1, H] of each training-time-test step for tokens [B, W] and target
    features [B, W, H*(1+n)]: entry s, position j is what drafting computes at draft position s+1 when
    position j-s is the last one with target features and the tokens after it are the given ones.
    Every layer of the head attends in the same pattern (its own keys of the steps so far)."""
    c = head.cfg
    B, W = toks.shape[0], toks.shape[1] - 1
    tok_in, pos = toks[:, 1:], torch.arange(W).expand(B, W)
    hidden = head.input_features(feats[:, :-1])                                 # g_j  [B, W, H]
    rep, scale = c.n_heads // c.n_kv_heads, c.head_dim ** -0.5
    n_layers = 1 + c.extra_layers
    keys: list[list[Tensor]] = [[] for _ in range(n_layers)]
    values: list[list[Tensor]] = [[] for _ in range(n_layers)]
    outs: list[Tensor] = []
    for s in range(steps):
        h = hidden
        for layer in range(n_layers):
            q, k, v = head.qkv(tok_in, h, pos, layer)                           # [B, nh|nkv, W, hd]
            keys[layer].append(_repeat_kv(k, rep))
            values[layer].append(_repeat_kv(v, rep))
            h = head.finish(h, _ttt_attend(q, keys[layer], values[layer], s, scale), layer)   # [B, W, H]
        outs.append(h)
        hidden = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)         # position j reads h_{j-1}
    return outs


def ttt_losses(head: Eagle3Head, toks: Tensor, feats: Tensor, lens: Tensor, w_sub: Tensor,
               steps: int, temperature: float = 1.0, weight: Tensor | float = 1.0) -> tuple[Tensor, list[float]]:
    """toks [B, W], feats [B, W, H*(1+n)] (final hidden, then aux), lens [B] -> (loss, top-1 agreement
    with the target per step: the greedy acceptance at draft position s+1 given the earlier ones).

    The loss is the cross-entropy from the target's distribution over the draft vocabulary at `temperature`
    (1: the target's own; below 1 sharpened toward its argmax, what greedy drafting is judged on), averaged
    with `weight` per draft position j ([B, W - 1], or one number for all); the agreement counts every
    position alike."""
    H, W = head.cfg.dim, toks.shape[1] - 1
    j = torch.arange(W)
    valid = (j[None] + 1 < lens[:, None])                                     # p_{j+1} exists  [B, W]
    with torch.no_grad():
        p = torch.softmax(feats[:, 1:, :H].float() @ w_sub.T / temperature, -1)  # [B, W, V'] target of x_{j+2}
        p_arg = p.argmax(-1)
    loss, accs = torch.zeros(()), []
    for s, h in enumerate(ttt_unroll(head, toks, feats, steps)):
        logq = torch.log_softmax(head.logits(h).float(), -1)
        m = (valid & (j[None] >= s)).float()
        n = m.sum().clamp(min=1)
        mw = m * weight
        loss = loss + STEP_DECAY ** s * (-(p * logq).sum(-1) * mw).sum() / mw.sum().clamp(min=1e-6)
        accs.append(float(((logq.argmax(-1) == p_arg).float() * m).sum() / n))
    return loss, accs


def answer_weight(rows: list[Row], idx: list[int], starts: Tensor, W: int, prompt_weight: float) -> Tensor:
    """Loss weight per draft position j of windows starting at `starts` [B] (W tokens each) -> [B, W - 1]:
    1 where the drafted token (window position j + 2) is an answer token, `prompt_weight` where it is part
    of the prompt (system prompt, template, question), which drafting never meets."""
    out = torch.full((len(idx), W - 1), prompt_weight)
    for r, (i, a) in enumerate(zip(idx, starts.tolist())):
        seg = rows[i].answer_mask[a + 2:a + W + 1]
        out[r, :len(seg)] = torch.where(torch.tensor(seg, dtype=torch.bool), 1.0, prompt_weight)
    return out


@torch.no_grad()
def validate(head: Eagle3Head, seqs, feats, by_cat: dict[str, list[int]], window: int, w_sub: Tensor,
             steps: int, batch: int = 8) -> dict[str, list[float]]:
    """Top-1 agreement per draft position, per category, on the validation rows (fixed windows)."""
    out = {}
    for cat, idx in sorted(by_cat.items()):
        accs = []
        for i in range(0, len(idx), batch):
            toks, f, lens, _ = windows(seqs, feats, idx[i:i + batch], window, random.Random(i), torch.bfloat16)
            accs.append(ttt_losses(head, toks, f.float(), lens, w_sub, steps)[1])
        out[cat] = [round(sum(a[k] for a in accs) / len(accs), 4) for k in range(steps)]
    return out


@torch.no_grad()
def served_agreement(head: Eagle3Head, rows: list[Row], seqs: list[list[int]], feats: list[Tensor],
                     by_cat: dict[str, list[int]], w_full: Tensor, steps: int, window: int) -> dict[str, list[float]]:
    """Top-1 agreement per draft position and category counted as drafting meets it: answer positions only
    (not the prompt, template and question tokens `validate` counts too), against the target's argmax over
    its whole vocabulary (a token outside the draft vocabulary is a miss). Each row's last `window` tokens."""
    H, out = head.cfg.dim, {}
    for cat, idx in sorted(by_cat.items()):
        hits, counted = [0] * steps, [0] * steps
        for i in idx:
            a = max(0, len(seqs[i]) - window)
            toks = torch.tensor(seqs[i][a:])[None]                                  # [1, T]
            f = feats[i][a:][None].float()                                          # [1, T, F]
            T = toks.shape[1]
            if T < 3:
                continue
            full = (f[0, 1:T - 1, :H] @ w_full.T).argmax(-1)                        # [T-2] target's token j + 2
            seg = list(rows[i].answer_mask[a + 2:a + T])                            # a row may lack a mask
            answer = torch.tensor(seg + [0] * (T - 2 - len(seg)), dtype=torch.bool)   # [T-2]
            j = torch.arange(T - 2)
            for s, h in enumerate(ttt_unroll(head, toks, f, steps)):
                draft = head.vocab_ids[head.logits(h[0, :T - 2]).float().argmax(-1)]
                m = answer & (j >= s)
                hits[s] += int((draft == full)[m].sum())
                counted[s] += int(m.sum())
        out[cat] = [round(h / max(c, 1), 4) for h, c in zip(hits, counted)]
    return out


def shard_features(target: Transformer, rows: list[Row], seqs: list[list[int]], layers: tuple[int, ...],
                    cache: Path, max_seq: int, deadline: float) -> list[Tensor]:
    """The target's features of every sequence, extracted once per data shard and kept in `cache` as
    `features3-SHARD-ROWS-MAXSEQ-LAYERS-DIGEST.pt` (DIGEST: of the rows' tokens; an interrupted extraction
    resumes at the first missing shard).

    No shard is started after `deadline` (time.time()) once one has features: the rows of the shards left
    get empty tensors [0] (a later run extracts them)."""
    cache.mkdir(parents=True, exist_ok=True)
    by_shard: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_shard.setdefault(r.key.split("/")[0], []).append(i)
    feats: list[Tensor] = [torch.empty(0)] * len(seqs)
    tag = "-".join(map(str, layers))
    some = False
    for shard, idx in by_shard.items():
        f = cache / f"features3-{shard}-{len(idx)}-{max_seq}-{tag}-{sequences_digest([seqs[i] for i in idx])}.pt"
        if not f.exists() and some and time.time() >= deadline:
            continue
        width = target.config.dim * (1 + len(layers))
        part = cached(f, lambda: extract_aux(target, [seqs[i] for i in idx], layers),    # never half-written
                      [(len(seqs[i]), width) for i in idx])
        for i, t in zip(idx, part):
            feats[i] = t
        some = True
    return feats


def _validation_by_category(rows: list[Row]) -> dict[str, list[int]]:
    """Indices of the validation rows, per category."""
    out: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        if r.validation:
            out.setdefault(r.category, []).append(i)
    return out


@dataclass(frozen=True)
class Eagle3Options:
    """What `specdec train eagle3` takes besides the target, data and output."""
    minutes: float = 40.0            # wall-time budget: feature extraction, steps and progress reports
    vocab_size: int = 8192
    window: int = 128
    batch: int = 8
    lr: float = 1e-3
    max_seq: int = 640
    steps: int = 4                   # training-time-test steps
    max_rows: int = 0                # 0 = all
    seed: int = 0
    train_dtype: torch.dtype = torch.float32
    report_minutes: float = 10.0     # validation on a fixed sample, appended to OUT.curve.jsonl
    init: str = ""                   # a head (.safetensors) to continue from; "" = start from the target
    mlp_width: int = 0               # the head's MLP width (0: the target's; wider than `init`'s: widened in place)
    head_layers: int = 0             # the head's decoder layers (0: one, or `init`'s; more than `init`'s: deepened)
    target_temperature: float = 1.0  # the target distribution the head learns: softmax(logits / T)
    prompt_weight: float = 1.0       # loss weight of draft positions inside prompts (answers: 1)


class Curve:
    """The learning curve, `OUT.curve.jsonl`: per progress report, training tokens seen, steps, minutes and
    validation top-1 agreement per category and draft position. A fresh run starts a new one; a resumed
    run appends after the points up to its checkpoint (`benchmarks/plot_learning_curve.py` draws it)."""

    def __init__(self, out: Path, ckpt: Checkpoint) -> None:
        self.path = Path(out).with_suffix(".curve.jsonl")
        self.ckpt, self.trimmed = ckpt, False
        if not ckpt.path.exists():
            self.path.unlink(missing_ok=True)

    def since(self, step: int) -> None:
        """A resumed run continues from `step`: points a killed run appended after its last checkpoint go."""
        if self.path.exists():
            lines = [line for line in self.path.read_text().splitlines() if line.strip()]
            kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
            if len(kept) < len(lines):
                self.path.write_text("".join(line + "\n" for line in kept))

    def add(self, step: int, tokens: int, minutes: float, agreement: dict[str, list[float]]) -> None:
        if not self.trimmed:                           # the first point after the checkpoint was read
            self.since(self.ckpt.resumed_at)
            self.trimmed = True
        n = len(next(iter(agreement.values()), []))
        mean = [round(sum(a[k] for a in agreement.values()) / len(agreement), 4) for k in range(n)]
        line = {"step": step, "tokens": tokens, "run_minutes": round(minutes, 2), "mean": mean, "agreement": agreement}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def train_eagle3(model: str, data: Path, out: Path, overwrite: bool, opts: Eagle3Options, cache: Path) -> dict:
    """Train an EAGLE-3 head for `model` on the magpie shards in `data` (features kept in `cache`);
    the time budget starts now."""
    started = time.time()
    if not Path(data).is_dir():                       # before the model loads
        raise no_shards(Path(data))
    target, name, rng = begin(model, out, overwrite, opts.seed, data)
    if not isinstance(target, Transformer):
        raise SpecdecError("EAGLE-3 training needs a lean GGUF target")
    rows: list[Row] = read_shards(data)
    if not rows:
        raise no_shards(Path(data))
    rows = rows[:opts.max_rows] if opts.max_rows > 0 else rows
    return fit_eagle3(target, name, rows, out, opts, cache, rng, started)


def initial_head(target: Transformer, seqs: list[list[int]], opts: Eagle3Options) -> Eagle3Head:
    """The trainable (float32) head a run starts from: the weights, configuration and draft vocabulary of
    `opts.init` (continuing a shipped or earlier head with a fresh optimiser), else a new head whose draft
    vocabulary is the data's most frequent tokens and whose LM head starts from the target's rows."""
    if opts.init:
        check_ids(seqs, target.vocab_size)
        sd, meta = read_weights(Path(opts.init), "eagle3", target)
        raw = json.loads(meta["config"])
        cfg = Eagle3Config(**{**raw, "aux_layers": tuple(raw["aux_layers"])})
        head = Eagle3Head(target, cfg, sd.pop("vocab_ids").long())
        try:
            missing, unexpected = head.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
        except RuntimeError as e:                  # a tensor of another shape than its configuration says
            last = (str(e).strip().splitlines() or [""])[-1].strip()
            raise SpecdecError(f"{opts.init} does not fit an EAGLE-3 head ({last[:160]})") from None
        if unexpected or [m for m in missing if m != "vocab_ids"]:
            raise SpecdecError(f"{opts.init} does not fit an EAGLE-3 head: missing {missing}, unexpected {unexpected}")
        if opts.mlp_width and opts.mlp_width != cfg.hidden_dim:
            head = widened(head, opts.mlp_width, opts.seed)
        if opts.head_layers and opts.head_layers != 1 + cfg.extra_layers:
            head = deepened(head, opts.head_layers, opts.seed)
        return head
    if opts.vocab_size > target.vocab_size:
        raise SpecdecError(f"--vocab-size {opts.vocab_size} exceeds the target's vocabulary ({target.vocab_size})")
    cfg = Eagle3Config.for_target(target, opts.vocab_size)
    if opts.mlp_width:
        cfg = replace(cfg, hidden_dim=opts.mlp_width)
    if opts.head_layers:
        cfg = replace(cfg, extra_layers=opts.head_layers - 1)
    return Eagle3Head(target, cfg, vocab_subset(seqs, cfg.draft_vocab, target.vocab_size)).init_from_target()


def widened(head: Eagle3Head, width: int, seed: int) -> Eagle3Head:
    """The same head with an MLP `width` wide, computing the same function: the new gate/up rows start small
    and random, the new down_proj columns at zero (so they add nothing until trained)."""
    old = head.cfg.hidden_dim
    if width < old:
        raise SpecdecError(f"--mlp-width {width} is narrower than the head's MLP ({old}): a head only widens")
    wide = Eagle3Head(head.tgt, replace(head.cfg, hidden_dim=width), head.vocab_ids)
    sd = head.state_dict()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj"):
            w = sd[f"midlayer.mlp.{name}.weight"]                                    # [old, H]
            extra = torch.randn(width - old, w.shape[1], generator=gen) * 0.02
            sd[f"midlayer.mlp.{name}.weight"] = torch.cat([w, extra.to(w.dtype)])    # [width, H]
        w = sd["midlayer.mlp.down_proj.weight"]                                      # [H, old]
        sd["midlayer.mlp.down_proj.weight"] = torch.cat([w, w.new_zeros(w.shape[0], width - old)], 1)
    wide.load_state_dict(sd)
    return wide


def deepened(head: Eagle3Head, layers: int, seed: int) -> Eagle3Head:
    """The same head with `layers` decoder layers, computing the same function: each new layer starts with
    small random q/k/v/gate/up and zero o_proj and down_proj, so its residual branches add nothing until
    trained (and the gradients reach them through those zeros)."""
    old = 1 + head.cfg.extra_layers
    if layers < old:
        raise SpecdecError(f"--head-layers {layers} is fewer than the head's {old}: a head only deepens")
    deep = Eagle3Head(head.tgt, replace(head.cfg, extra_layers=layers - 1), head.vocab_ids)
    sd = head.state_dict()
    gen = torch.Generator().manual_seed(seed)
    for name, p in deep.state_dict().items():
        if name in sd:
            continue
        if "norm" in name:
            sd[name] = torch.ones_like(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            sd[name] = torch.zeros_like(p)
        else:
            sd[name] = (torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype)
    deep.load_state_dict(sd)
    return deep


def fit_eagle3(target: Transformer, name: str, rows: list[Row], out: Path, opts: Eagle3Options, cache: Path,
               rng: random.Random, started: float) -> dict:
    """Extract (or load) features, train within what is left of `opts.minutes` since `started`, validate,
    write the head and its report."""
    seqs = [r.tokens[:opts.max_seq] for r in rows]
    head = initial_head(target, seqs, opts)
    cfg, ids = head.cfg, head.vocab_ids
    feats = shard_features(target, rows, seqs, head.feature_layers, cache, opts.max_seq,
                            started + opts.minutes * 60)
    if (left := sum(f.numel() == 0 for f in feats)):
        print(f"the budget ran out during feature extraction: {left} of {len(rows)} rows have none yet (a later run "
              f"over the same --features extracts them); this run trains on the others", file=sys.stderr)
        keep = [i for i, f in enumerate(feats) if f.numel()]
        rows, seqs, feats = [rows[i] for i in keep], [seqs[i] for i in keep], [feats[i] for i in keep]
    train_idx = [i for i, r in enumerate(rows) if not r.validation]
    val_by_cat = _validation_by_category(rows)
    if not train_idx:
        raise SpecdecError("no training rows (every row read is a validation row); add data or raise --max-rows")
    if not val_by_cat:
        more = "raise --max-rows for it" if opts.max_rows > 0 else "add shards (`specdec train magpie`) for it"
        print("note: no validation rows among those read (validation is the rows every shard marks held out); "
              f"agreement is not measured: {more}", file=sys.stderr)
    w = target.output if target.output.numel() else target.embed
    w_sub = w[ids].float().detach()
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    ckpt = Checkpoint(out, head, opt, rng)
    curve = Curve(out, ckpt)

    def step_fn() -> tuple[Tensor, dict[str, str]]:
        idx = rng.sample(train_idx, min(opts.batch, len(train_idx)))
        toks, f, lens, starts = windows(seqs, feats, idx, opts.window, rng, torch.bfloat16)
        weight = answer_weight(rows, idx, starts, toks.shape[1], opts.prompt_weight)
        loss, accs = ttt_losses(head, toks, f.float(), lens, w_sub, opts.steps, opts.target_temperature, weight)
        ckpt.tokens += int((lens - 1).clamp(min=0).sum())
        return loss, {f"acc{k + 1}": f"{a:.2f}" for k, a in enumerate(accs)}

    def progress(step: int) -> str:            # a quick look: the same 16 validation rows per category each time
        head.eval()
        acc = validate(head, seqs, feats, {c: v[:16] for c, v in val_by_cat.items()}, opts.window, w_sub,
                       opts.steps)
        head.train()
        curve.add(step, ckpt.tokens, (ckpt.spent_before + time.time() - started) / 60, acc)
        # the head as it stands, usable while the run goes on (the final write replaces it with the full report)
        head.save(out, {"report": json.dumps({"target": name, "snapshot_at_step": step, "tokens_seen": ckpt.tokens,
                                              "validation_sample_top1_agreement_per_position": acc})})
        return f"{ckpt.tokens} tokens; validation top-1 agreement per position: " + json.dumps(acc)

    n_steps, spent = train_loop("train eagle3", params, opt, opts.lr, opts.minutes, ckpt, step_fn, progress,
                                opts.report_minutes * 60, opts.train_dtype, time.time() - started)
    head.eval()
    if val_by_cat:
        print(f"final validation over {sum(map(len, val_by_cat.values()))} rows ...", file=sys.stderr, flush=True)
    with torch.no_grad(), autocast(opts.train_dtype):
        final = validate(head, seqs, feats, val_by_cat, opts.window, w_sub, opts.steps)
        served = served_agreement(head, rows, seqs, feats, val_by_cat, w.float().detach(), opts.steps, opts.window)
    report = {"target": name, "rows": len(rows), "train_rows": len(train_idx),
              "tokens": sum(len(s) for s in seqs), "tokens_seen": ckpt.tokens, "steps": n_steps, "minutes": spent,
              "train_dtype": str(opts.train_dtype).removeprefix("torch."),
              "draft_vocab": cfg.draft_vocab, "aux_layers": list(cfg.aux_layers), "ttt_steps": opts.steps,
              "head_layers": 1 + cfg.extra_layers,
              "target_temperature": opts.target_temperature, "prompt_weight": opts.prompt_weight,
              "validation_top1_agreement_per_position": final,
              "served_top1_agreement_per_position": served}
    curve.add(n_steps, ckpt.tokens, (ckpt.spent_before + time.time() - started) / 60,
              {c: final[c] for c in sorted(final)})
    head.save(out, {"report": json.dumps(report)})
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    ckpt.done()
    return report
