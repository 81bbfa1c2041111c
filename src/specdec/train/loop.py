"""Resumable training state beside the output file: weights, optimiser, step and time spent."""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm


class Checkpoint:
    """`out.ckpt`, written every `every_s` seconds (and on Ctrl-C); a re-run with the same `--out` resumes.

    The time budget counts across runs: a resumed run trains only for what is left of it.
    """

    def __init__(self, out: Path, module: torch.nn.Module, opt: torch.optim.Optimizer, every_s: float = 120.0):
        self.path = Path(out).with_suffix(".ckpt")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.module, self.opt, self.every_s = module, opt, every_s
        self.last_save = time.time()

    def resume(self) -> tuple[int, float]:
        """Load the state if a checkpoint exists. -> (step, seconds already spent); (0, 0.0) for a fresh run."""
        if not self.path.exists():
            return 0, 0.0
        state = torch.load(self.path, weights_only=True)
        self.module.load_state_dict(state["module"])
        self.opt.load_state_dict(state["opt"])
        print(f"resumed from {self.path} at step {state['step']} ({state['seconds'] / 60:.1f} min spent)")
        return int(state["step"]), float(state["seconds"])

    def save(self, step: int, seconds: float) -> None:
        tmp = self.path.with_suffix(".ckpt.tmp")
        torch.save({"module": self.module.state_dict(), "opt": self.opt.state_dict(), "step": step,
                    "seconds": seconds}, tmp)
        tmp.replace(self.path)                                 # never a half-written checkpoint
        self.last_save = time.time()

    def maybe_save(self, step: int, seconds: float) -> None:
        if time.time() - self.last_save >= self.every_s:
            self.save(step, seconds)

    def done(self) -> None:
        """The final weights are written: the checkpoint is no longer needed."""
        self.path.unlink(missing_ok=True)


def train_loop(desc: str, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, lr: float, minutes: float,
               ckpt: Checkpoint, step_fn: Callable[[], tuple[torch.Tensor, dict[str, str]]],
               report: Callable[[], str] = lambda: "", report_every_s: float = 600.0) -> tuple[int, float]:
    """AdamW steps under a cosine learning rate (to 10% of `lr`) until the time budget is spent.

    `step_fn` draws a batch and returns (loss, progress-bar fields); it runs under bfloat16 autocast
    (AVX-512 bf16 matmuls, fp32 master weights). Resumes from and writes `ckpt`. Every `report_every_s`
    seconds the line `report()` returns (e.g. validation figures) is printed. -> (steps, minutes).
    """
    step, spent = ckpt.resume()
    budget = minutes * 60
    t0 = time.time() - spent
    bar = tqdm(desc=desc, unit="step", initial=step)
    last_report = time.time()
    try:
        while (elapsed := time.time() - t0) < budget:
            for g in opt.param_groups:
                g["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / budget)))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, fields = step_fn()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", **fields)
            ckpt.maybe_save(step, time.time() - t0)
            if time.time() - last_report >= report_every_s:
                with torch.no_grad():
                    line = report()
                if line:
                    tqdm.write(f"step {step}: {line}")
                last_report = time.time()
    except KeyboardInterrupt:
        ckpt.save(step, time.time() - t0)
        bar.close()
        print(f"\ninterrupted: state saved in {ckpt.path}; run the same command again to resume")
        raise
    bar.close()
    return step, (time.time() - t0) / 60
