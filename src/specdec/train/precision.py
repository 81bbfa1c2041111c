"""Which dtype training computes in here: bfloat16 autocast only where this CPU makes it faster.

CPUs with native bfloat16 dot products (AVX-512-BF16, AMX) run bfloat16 matmuls about twice as fast as
float32; elsewhere (AVX2 only) bfloat16 is emulated and many times slower. `--train-dtype auto` times a
forward+backward of a matmul shaped like a head's LM head in both, once per machine (CPU, torch build,
ISA limit, thread count), keeps the timings under $SPECDEC_CACHE/train-dtype, and picks the faster.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

from ..errors import SpecdecError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CHOICES = ("auto", *DTYPES)
SHAPE = (256, 576, 2048)          # rows x in -> out of the timed matmul (a draft LM head's shape, cut down)


@dataclass(frozen=True)
class Timings:
    """Seconds per forward+backward of the timed matmul."""
    float32: float
    bfloat16: float


def _fwd_bwd_seconds(bf16: bool, repeats: int) -> float:
    """Best of `repeats` forward+backward passes (after one warm-up) of x [M, K] @ w [N, K].T."""
    m, k, n = SHAPE
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g, requires_grad=True)
    w = torch.randn(n, k, generator=g, requires_grad=True)
    best = float("inf")
    for _ in range(repeats + 1):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = x @ w.T                                                   # [M, N]
        y.float().square().mean().backward()
        best = min(best, time.perf_counter() - t)
    return best


def measure(repeats: int = 3) -> Timings:
    """Time the matmul in float32 and under bfloat16 autocast on this machine."""
    return Timings(_fwd_bwd_seconds(False, repeats), _fwd_bwd_seconds(True, repeats))


def _timings_path():
    from ..machine import probe
    from ..models.registry import cache_dir

    m = probe()
    stamp = f"{m.cpu}|{torch.__version__}|{m.torch_capability}|{m.isa_limit}|{torch.get_num_threads()}|{SHAPE}"
    return cache_dir() / "train-dtype" / f"{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.json"


def machine_timings() -> Timings:
    """`measure()` once per machine; later runs read the kept result."""
    from ..models.registry import write_atomic

    path = _timings_path()
    try:
        t = Timings(**json.loads(path.read_text()))
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in asdict(t).values()):
            return t
    except (OSError, ValueError, TypeError):
        pass
    t = measure()                                    # none kept yet, or not what this code writes
    write_atomic(path, json.dumps(asdict(t)).encode())
    return t


def _check(requested: str) -> None:
    if requested not in CHOICES:
        raise SpecdecError(f"--train-dtype must be one of {', '.join(CHOICES)}, got {requested!r}")


def choose(requested: str, timings: Timings) -> torch.dtype:
    """The training dtype for `--train-dtype requested`: auto takes bfloat16 only where it is faster."""
    _check(requested)
    if requested != "auto":
        return DTYPES[requested]
    return torch.bfloat16 if timings.bfloat16 < timings.float32 else torch.float32


def train_dtype(requested: str) -> torch.dtype:
    """`choose` with this machine's timings (measured only for auto), and a line saying what was chosen."""
    _check(requested)
    if requested in DTYPES:
        from ..machine import probe

        slow = requested == "bfloat16" and not probe().native_bf16
        print(f"training dtype: {requested} (asked for" + ("; this CPU has no native bfloat16, so it is emulated "
              "and may run many times slower than float32: --train-dtype auto measures both)" if slow else ")"),
              file=sys.stderr)
        return DTYPES[requested]
    t = machine_timings()
    dtype = choose(requested, t)
    m, k, n = SHAPE
    print(f"training dtype: {str(dtype).removeprefix('torch.')} (auto: a [{m}x{k}] @ [{k}x{n}] forward+backward "
          f"takes {t.bfloat16 * 1e3:.1f} ms under bfloat16 autocast, {t.float32 * 1e3:.1f} ms in float32 here)",
          file=sys.stderr)
    return dtype
