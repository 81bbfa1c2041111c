"""What small calls cost right after a forward-sized stream of memory, against a loop of their own.

A decoding step runs its Python and ATen calls between two weight streams (the layers, the LM head), so they
find the caches cold. This script streams `--mb` MB of other memory (a small C loop, built with the system C
compiler: plain loads, or `prefetchnta` ahead of them; the buffer in 4 kB pages or advised `MADV_HUGEPAGE`)
before each call and reports medians, cold and warm, of:

- a segment of two native norms and two small tensors, after each kind of stream;
- greedy verification of one row in the engine's ATen form and in numpy;
- a chain's attention mask in ATen and in numpy, and rope rows by indexing and by `index_select`;
- an empty `at::parallel_for` region (a C++ loop built against torch, as the layer loop is), what waking torch's
  other threads costs each of the layer loop's parallel linears.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cold_calls.py --threads 1
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
import torch

from specdec import verify
from specdec.machine import cpu_model
from specdec.models import native
from specdec.models.decoder import CAUSAL, Transformer
from specdec.verify import PAD, Verdict

STREAM_C = r"""
#include <immintrin.h>
#include <stdint.h>
/* sums n floats (n a multiple of 16); nta: prefetchnta 1 kB ahead of the loads */
double stream(const float *p, int64_t n, int nta) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        if (nta) _mm_prefetch((const char *)(p + i + 256), _MM_HINT_NTA);
        acc = _mm256_add_ps(acc, _mm256_loadu_ps(p + i));
        acc = _mm256_add_ps(acc, _mm256_loadu_ps(p + i + 8));
    }
    float t[8];
    _mm256_storeu_ps(t, acc);
    return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
"""
REGIONS_CPP = r"""
#include <ATen/Parallel.h>
#include <chrono>
/* seconds per empty at::parallel_for region over torch's threads, n regions back to back */
extern "C" double regions(int n) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; i++) at::parallel_for(0, 16, 1, [](int64_t, int64_t) {});
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
}
"""
MADV_HUGEPAGE = 14
PAGE_2M = 2 ** 21


def stream_lib(out: Path) -> ctypes.CDLL:
    src = out / "stream.c"
    src.write_text(STREAM_C)
    subprocess.run(["cc", "-O2", "-mavx2", "-shared", "-fPIC", "-o", str(out / "stream.so"), str(src)], check=True)
    lib = ctypes.CDLL(str(out / "stream.so"))
    lib.stream.restype, lib.stream.argtypes = ctypes.c_double, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lib


def region_cost(out: Path) -> float:
    """Seconds per empty parallel region on torch's threads (built as the layer loop is: `native._loop_flags`)."""
    src = out / "regions.cpp"
    src.write_text(REGIONS_CPP)
    subprocess.run([native._cxx(), str(src), "-o", str(out / "regions.so"), *native._loop_flags()], check=True)
    lib = ctypes.CDLL(str(out / "regions.so"))
    lib.regions.restype, lib.regions.argtypes = ctypes.c_double, [ctypes.c_int]
    lib.regions(1000)
    return statistics.median(lib.regions(5000) for _ in range(5))


def buffer(nbytes: int, huge: bool) -> tuple[mmap.mmap, np.ndarray]:
    """An anonymous mapping of nbytes floats aligned to 2 MB (advised MADV_HUGEPAGE if `huge`), touched."""
    m = mmap.mmap(-1, nbytes + 2 * PAGE_2M, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(m, dtype=np.uint8)
    skip = -raw.ctypes.data % PAGE_2M
    view = raw[skip:skip + nbytes].view(np.float32)
    if huge:
        ctypes.CDLL("libc.so.6").madvise(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    view[:] = 1.0
    return m, view


def cold_and_warm(fn: Callable[[], object], before: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median us of fn right after `before` (cold), and in a loop of its own (warm)."""
    cold = []
    for _ in range(repeats):
        before()
        t = time.perf_counter()
        fn()
        cold.append(time.perf_counter() - t)
    for _ in range(20):
        fn()
    warm = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - t)
    return statistics.median(cold) * 1e6, statistics.median(warm) * 1e6


def follow_numpy(x: np.ndarray, y: np.ndarray) -> Verdict:
    """Greedy verification's verdict in numpy (the alternative measured, not the engine's)."""
    K = x.shape[1]
    num = ((x != PAD) & (x == y[:, :K])).cumprod(-1).sum(-1)
    ar = np.arange(K + 1)
    kept = ar <= num[:, None]
    return Verdict(torch.from_numpy(num), torch.from_numpy(np.where(kept, y, PAD)),
                   torch.from_numpy(np.where(kept, ar, PAD)), torch.from_numpy(y))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--mb", type=int, default=80, help="MB streamed before each cold call (default: 80)")
    ap.add_argument("--repeats", type=int, default=40, help="calls per median (default: 40)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available(torch.device("cpu")):
        raise SystemExit("the native kernels are needed (a C compiler)")
    nbytes = args.mb * 2 ** 20
    with tempfile.TemporaryDirectory() as tmp:
        lib = stream_lib(Path(tmp))
        maps = {huge: buffer(nbytes, huge) for huge in (False, True)}
        n = nbytes // 4 - 512

        def streamer(huge: bool, nta: int) -> Callable[[], object]:
            return lambda: lib.stream(maps[huge][1].ctypes.data, n, nta)

        x, o, w = torch.randn(1, 576), torch.randn(1, 576), torch.ones(576)

        def segment() -> None:
            for _ in range(2):
                native.add_rms_norm(x, o, w, 1e-5)
                torch.zeros(3).tolist()

        print(f"{cpu_model()}, torch {torch.__version__} kernels {torch.backends.cpu.get_cpu_capability()}, "
              f"{args.threads} thread(s); medians of {args.repeats}, cold = after a {args.mb} MB stream")
        for label, huge, nta in (("4 kB pages, plain loads", False, 0), ("4 kB pages, prefetchnta", False, 1),
                                 ("2 MB pages, plain loads", True, 0)):
            cold, warm = cold_and_warm(segment, streamer(huge, nta), args.repeats)
            print(f"  segment after {label:24s} cold {cold:7.1f} us   warm {warm:6.1f} us")
        logits = torch.randn(1, 1, 49152)
        drafts = torch.zeros(1, 0, dtype=torch.long)
        lengths, positions, table = torch.tensor([100]), torch.tensor([[100]]), torch.randn(2048, 64)
        cases = {
            "greedy verdict, ATen (the engine's)": lambda: verify.verify_greedy(drafts, logits),
            "greedy verdict, numpy": lambda: follow_numpy(drafts.numpy(), logits.numpy().argmax(-1)),
            "chain mask, ATen (the torch form's)": lambda: Transformer._mask(lengths, 1, 128, CAUSAL),
            "chain mask, numpy": lambda: torch.from_numpy(
                np.arange(128) < (lengths.numpy()[:, None] + np.arange(1, 2))[:, :, None])[:, None],
            "rope rows, indexing": lambda: table[positions][:, None],
            "rope rows, index_select": lambda: table.index_select(0, positions.reshape(-1)).view(1, 1, 1, -1),
        }
        for label, fn in cases.items():
            cold, warm = cold_and_warm(fn, lambda: (streamer(False, 0)(), logits.add_(0)), args.repeats)
            print(f"  {label:38s} cold {cold:7.1f} us   warm {warm:6.1f} us")
        if native._cxx():
            print(f"  an empty parallel region on {args.threads} thread(s): {region_cost(Path(tmp)) * 1e6:.2f} us")


if __name__ == "__main__":
    main()
