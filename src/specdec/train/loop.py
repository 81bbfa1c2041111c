"""Resumable training state beside the output file: weights, optimiser, step and time spent."""
from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from pathlib import Path
from typing import Callable, ContextManager

import torch
from tqdm import tqdm

from ..errors import Interrupted, SpecdecError, terminate_as_interrupt

FIRST_REPORT_STEPS = 10.0         # a report's cost is guessed at this many steps until one has been timed


class Checkpoint:
    """`out.ckpt`, written every `every_s` seconds (and on Ctrl-C); a re-run with the same `--out` resumes.

    The time budget counts across runs: a resumed run trains only for what is left of it.
    """

    def __init__(self, out: Path, module: torch.nn.Module, opt: torch.optim.Optimizer, rng: random.Random,
                 every_s: float = 120.0):
        self.path = Path(out).with_suffix(".ckpt")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.module, self.opt, self.rng, self.every_s = module, opt, rng, every_s   # rng: the batches' draws
        self.last_save = time.time()
        self.tokens = 0                                        # training tokens seen (the step function counts)
        self.setup = 0.0                                       # seconds of the budget spent before the first step
        self.resumed_at = 0                                    # the step a resumed run continues from
        self.spent_before = 0.0                                # seconds of the budget earlier runs spent

    def resume(self) -> tuple[int, float]:
        """Load the state if a checkpoint exists. -> (step, seconds already spent); (0, 0.0) for a fresh run."""
        self.path.with_suffix(".ckpt.tmp").unlink(missing_ok=True)    # a write that was killed: never read
        if not self.path.exists():
            return 0, 0.0
        try:
            state = torch.load(self.path, weights_only=True)
            for name, buf in self.module.named_buffers():
                kept = state["module"].get(name)
                if kept is not None and not (kept.shape == buf.shape and torch.equal(kept.to(buf.dtype), buf)):
                    raise SpecdecError(f"{self.path} holds a run over another {name} than this command's (the data or "
                                       "--max-rows changed?); rerun with what it started with, or --overwrite to "
                                       "start over")
            self.module.load_state_dict(state["module"])
            self.opt.load_state_dict(state["opt"])
        except SpecdecError:
            raise
        except (RuntimeError, ValueError, KeyError, OSError) as e:
            last = (str(e).strip().splitlines() or [""])[-1].strip()
            last = last if len(last) <= 160 else last[:157] + "..."
            raise SpecdecError(f"{self.path} holds a run this command cannot resume (other settings? {last}); rerun "
                               "with the settings it was started with, or --overwrite to start over") from None
        self.tokens = int(state.get("tokens", 0))
        self.setup = float(state.get("setup", 0.0))
        self.resumed_at = int(state["step"])
        self.spent_before = float(state["seconds"])
        if "rng" in state:                                     # the batches go on as an uninterrupted run's would
            version, internal, gauss = state["rng"]
            self.rng.setstate((version, tuple(internal), gauss))
        print(f"resumed from {self.path} at step {state['step']} ({state['seconds'] / 60:.1f} min spent)",
              file=sys.stderr)
        return int(state["step"]), float(state["seconds"])

    def save(self, step: int, seconds: float) -> None:
        tmp = self.path.with_suffix(".ckpt.tmp")
        torch.save({"module": self.module.state_dict(), "opt": self.opt.state_dict(), "step": step,
                    "seconds": seconds, "tokens": self.tokens, "setup": self.setup,
                    "rng": self.rng.getstate()}, tmp)
        tmp.replace(self.path)                                 # never a half-written checkpoint
        self.last_save = time.time()

    def maybe_save(self, step: int, seconds: float) -> None:
        if time.time() - self.last_save >= self.every_s:
            self.save(step, seconds)

    def done(self) -> None:
        """The final weights are written: the checkpoint is no longer needed."""
        self.path.unlink(missing_ok=True)
        self.path.with_suffix(".ckpt.tmp").unlink(missing_ok=True)


def autocast(dtype: torch.dtype) -> ContextManager:
    """bfloat16 autocast where training runs in bfloat16 (fp32 master weights); nothing for float32."""
    if dtype == torch.bfloat16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _lr_factor(elapsed: float, budget: float, setup: float) -> float:
    """Cosine from 1 to 0.1 over what the budget left for training after `setup` seconds."""
    frac = (elapsed - setup) / max(budget - setup, 1e-9)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(max(frac, 0.0), 1.0)))


class _Reports:
    """When the periodic report runs: every `every_s` seconds, never more than a tenth of the time, and
    only when its expected cost still fits in the budget (until one is timed, FIRST_REPORT_STEPS steps)."""

    def __init__(self, every_s: float) -> None:
        self.every_s, self.cost = every_s, -1.0
        self.due = time.time() + every_s

    def ready(self, elapsed: float, budget: float, step_s: float) -> bool:
        cost = self.cost if self.cost >= 0 else FIRST_REPORT_STEPS * step_s
        return time.time() >= self.due and elapsed + cost < budget

    def ran(self, seconds: float) -> None:
        self.cost = seconds
        self.due = time.time() + max(self.every_s, 10 * seconds)


def train_loop(desc: str, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, lr: float, minutes: float,
               ckpt: Checkpoint, step_fn: Callable[[], tuple[torch.Tensor, dict[str, str]]],
               report: Callable[[int], str] = lambda step: "", report_every_s: float = 600.0,
               dtype: torch.dtype = torch.float32, setup_s: float = 0.0) -> tuple[int, float]:
    """AdamW steps under a cosine learning rate (to 10% of `lr`) until the time budget is spent.

    `step_fn` draws a batch and returns (loss, progress-bar fields); it runs under bfloat16 autocast
    when `dtype` is bfloat16 (fp32 master weights), else in float32. Resumes from and writes `ckpt`.
    The budget is wall time: `setup_s` (this run's feature extraction and loading), the steps, the
    periodic reports and checkpoints all count, across resumed runs too; the last step may end past it.
    The cosine runs over what the set-up before the first step left of the budget.
    Every `report_every_s` seconds the line `report(step)` returns (e.g. validation figures) is printed,
    under the same autocast, where its cost fits in what is left. -> (steps, minutes).
    """
    step, spent = ckpt.resume()
    if step == 0:
        ckpt.setup = spent + setup_s                           # the schedule starts with the first step
    budget = minutes * 60
    t0 = time.time() - spent - setup_s
    bar = tqdm(desc=desc, unit="step", initial=step, mininterval=0.1 if sys.stderr.isatty() else 60.0)
    reports, step_s = _Reports(report_every_s), 0.0
    try:
        counted = ckpt.tokens                                  # tokens of the steps done (step_fn counts its own first)
        drawn = ckpt.rng.getstate()                            # ... and the batch draws after them
        with terminate_as_interrupt():
            while (elapsed := time.time() - t0) < budget:
                a = time.time()
                for g in opt.param_groups:
                    g["lr"] = lr * _lr_factor(elapsed, budget, ckpt.setup)
                with autocast(dtype):
                    loss, fields = step_fn()
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                step += 1
                counted, drawn = ckpt.tokens, ckpt.rng.getstate()
                step_s = time.time() - a
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}", **fields, refresh=False)
                ckpt.maybe_save(step, time.time() - t0)
                if reports.ready(time.time() - t0, budget, step_s):
                    a = time.time()
                    with torch.no_grad(), autocast(dtype):
                        line = report(step)
                    if line:
                        tqdm.write(f"step {step}: {line}", file=sys.stderr)
                    reports.ran(time.time() - a)
    except KeyboardInterrupt:
        ckpt.tokens = counted                                  # a step cut short trained nothing
        ckpt.rng.setstate(drawn)
        ckpt.save(step, time.time() - t0)
        bar.close()
        raise Interrupted(f"state saved in {ckpt.path}; run the same command again to resume") from None
    bar.close()
    if step > ckpt.resumed_at:         # the final validation and write may take minutes: an interrupt keeps the steps
        ckpt.save(step, time.time() - t0)
    if step == 0:                      # nothing trained: no untrained weights written as if they were the result
        raise SpecdecError(f"--minutes {minutes:g} ran out before the first training step (the set-up took "
                           f"{ckpt.setup / 60:.1f} min); what it did is kept (cached features): run again with "
                           "more --minutes")
    return step, (time.time() - t0) / 60
