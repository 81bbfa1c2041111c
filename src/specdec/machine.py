"""What this machine's CPU and torch build offer, and which compute modes follow from it.

Greedy speculation is token-identical to plain decoding only where a token's scores do not
depend on how many rows share its forward, a property of the kernels this CPU runs (see
`models/kernels.py`, which checks it at load time). This module knows the hardware side:
the CPU's name and instruction sets, what torch's kernels were limited to, and whether
oneDNN can run bfloat16 here at all.

`SPECDEC_ISA=avx2` (read when `specdec` is imported, before torch) limits torch, oneDNN and
MKL to AVX2 kernels, so the portable kernel family can be tested on an AVX-512 machine.
"""
from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

ISA_ENV = "SPECDEC_ISA"
# how each library is told to stop at AVX2 (each reads its variable when it first dispatches)
_ISA_LIMITS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def apply_isa_limit() -> str:
    """Apply $SPECDEC_ISA to the environment of torch, oneDNN and MKL; returns the limit ("" = none).

    Must run before torch computes anything; `specdec/__init__.py` calls it first thing."""
    isa = os.environ.get(ISA_ENV, "").strip().lower()
    if not isa or isa == "native":
        return ""
    if isa not in _ISA_LIMITS:
        print(f"specdec: error: {ISA_ENV}={isa!r} is not one of: native, {', '.join(_ISA_LIMITS)}", file=sys.stderr)
        raise SystemExit(2)
    for k, v in _ISA_LIMITS[isa].items():
        if os.environ.get(k, v) != v:              # the limit is what the user asked for: it wins, and says so
            print(f"specdec: warning: {ISA_ENV}={isa} sets {k}={v} (it was {os.environ[k]})", file=sys.stderr)
        os.environ[k] = v
    return isa


def env_switch(name: str) -> bool:
    """An on/off environment variable that is on unless set: 1, true, yes, on or 0, false, no, off (any case);
    another value is refused (a typo must not silently keep the default)."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    from .errors import SpecdecError

    raise SpecdecError(f"${name}={os.environ[name]!r}: use 1 (on, the default) or 0 (off)")


def cpu_model() -> str:
    """The CPU's "model name" from /proc/cpuinfo, with its family and model numbers (virtual machines
    often show only "AMD EPYC"); else what platform knows."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not line.strip():
                break                                               # the first CPU is enough
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = info.get("model name", "") or platform.processor() or platform.machine()
    if "cpu family" in info and "model" in info:
        name += f" (family {info['cpu family']}, model {info['model']})"
    return name


def cpu_flags() -> frozenset[str]:
    """Instruction-set flags from /proc/cpuinfo ("flags" on x86, "Features" on aarch64)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@dataclass(frozen=True)
class Machine:
    cpu: str                      # model name
    arch: str                     # x86_64, aarch64, ...
    torch_capability: str         # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    isa_limit: str                # $SPECDEC_ISA ("" = the CPU's own)
    avx2: bool
    avx512: bool                  # AVX-512 F/BW/VL/DQ
    avx512_bf16: bool             # native bf16 dot products
    amx: bool                     # AMX tiles with bf16
    avx_ne_convert: bool
    onednn: bool                  # torch has oneDNN (mkldnn) prepacked linears
    onednn_bf16: bool             # oneDNN packs and multiplies bfloat16 weights here
    int4_kernel: bool             # torch's CPU int4 weight-only kernel runs here
    threads: int

    @property
    def native_bf16(self) -> bool:
        """bfloat16 is computed by the CPU, not emulated (so it is fast, not only possible)."""
        return self.onednn_bf16 and (self.avx512_bf16 or self.amx or self.avx_ne_convert)

    @property
    def kernel_family(self) -> str:
        """A short name of the kernels torch dispatches to here."""
        if self.amx and self.onednn_bf16 and not self.isa_limit:
            return "AMX"
        return self.torch_capability

    def as_dict(self) -> dict:
        return {**asdict(self), "isa_limit": self.isa_limit or None,          # JSON: null when unset, as runtime's
                "native_bf16": self.native_bf16, "kernel_family": self.kernel_family}


def _onednn_bf16() -> bool:
    import torch

    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(32, 32, dtype=torch.bfloat16), 1)
        return True
    except (RuntimeError, AttributeError):
        return False


def _int4_kernel() -> bool:
    import torch

    try:
        w = torch.zeros(64, 64, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1)
        sz = torch.zeros(2, 64, 2, dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, 64, dtype=torch.bfloat16), packed, 32, sz)
        return True
    except (RuntimeError, AttributeError):
        return False


@lru_cache(maxsize=1)
def probe() -> Machine:
    """This machine's CPU, torch build and kernels (cached: probed once per process)."""
    import torch

    f = cpu_flags()
    arch = platform.machine()
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    return Machine(
        cpu=cpu_model(), arch=arch, torch_capability=torch.backends.cpu.get_cpu_capability(),
        isa_limit=os.environ.get(ISA_ENV, "").strip().lower().replace("native", ""),
        avx2="avx2" in f, avx512={"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f,
        avx512_bf16="avx512_bf16" in f or (arch == "aarch64" and "bf16" in f),
        amx={"amx_tile", "amx_bf16"} <= f, avx_ne_convert="avx_ne_convert" in f,
        onednn=onednn, onednn_bf16=onednn and _onednn_bf16(), int4_kernel=_int4_kernel(),
        threads=torch.get_num_threads(),
    )


def bf16_unavailable_reason(m: Machine) -> str:
    """Why bfloat16 cannot run here ("" if it can), naming the missing CPU feature."""
    if m.onednn_bf16:
        return ""
    if m.isa_limit:
        return f"{ISA_ENV}={m.isa_limit} limits oneDNN to kernels without bfloat16"
    if not m.onednn:
        return "this torch build has no oneDNN"
    return (f"this CPU ({m.cpu}, {m.torch_capability}) lacks what oneDNN's bfloat16 kernels need "
            "(AVX-512 BW/VL/DQ, AVX-512-BF16, AMX or AVX-NE-CONVERT)")
