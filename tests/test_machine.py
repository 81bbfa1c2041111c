"""Knowing the machine: the row-invariance check, the start-up self-check, dtype `auto` and its errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from specdec.api import choose_dtype, load_model
from specdec.errors import SpecdecError
from specdec.machine import probe
from specdec.models import kernels
from specdec.models.kernels import PackedLinear, RowCheck, check_rows, linear
from specdec.models.selfcheck import self_check

W = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
X = torch.randn(kernels.CHECK_ROWS, 64, generator=torch.Generator().manual_seed(1))


def by_row(x: torch.Tensor) -> torch.Tensor:
    """An invariant kernel: every row alone through the same dot products."""
    return torch.stack([(W * r).sum(-1) for r in x])


def test_kernel_checks_run_once_per_machine_and_thread_count(monkeypatch, tmp_path):
    """A kernel's check is kept on disk: a new process (an emptied memo) reads it instead of checking again;
    another thread count is another book (oneDNN may split a GEMM otherwise)."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_BOOKS", {})
    calls = []

    def counted(x):
        calls.append(len(x))
        return by_row(x)

    key = ("test", 96, 64)
    assert kernels.checked(key, counted, 64, torch.float32) == RowCheck(True, True) and calls
    n = len(calls)
    monkeypatch.setattr(kernels, "_BOOKS", {})
    assert kernels.checked(key, counted, 64, torch.float32) == RowCheck(True, True) and len(calls) == n
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        kernels.checked(key, counted, 64, torch.float32)
        assert len(calls) > n
    finally:
        torch.set_num_threads(threads)
    assert len(list((tmp_path / "kernel-checks").glob("*.json"))) == 2


def test_check_rows_passes_an_invariant_kernel():
    assert check_rows(by_row, X) == RowCheck(many_rows=True, lone_row=True)


def test_check_rows_catches_a_kernel_whose_rows_depend_on_their_neighbours():
    """A row's bits that depend on where it sits in the call (as a split-K GEMM's may) fail at every limit."""
    def by_place(x: torch.Tensor) -> torch.Tensor:
        return by_row(x) + 1e-3 * torch.arange(len(x))[:, None]

    check = check_rows(by_place, X)
    assert check.many_rows is False and "NOT" in check.verdict


def test_check_rows_limits_a_kernel_that_switches_algorithm_with_the_row_count():
    """A kernel that switches algorithm (here: float64 accumulation) from 4 rows on, as CPU GEMMs do,
    is only trusted with calls of fewer rows."""
    def switching(x: torch.Tensor) -> torch.Tensor:
        return by_row(x) if len(x) < 4 else (x.double() @ W.double().T).float()

    assert not torch.equal(switching(X[:4])[:1], switching(X[:1]))    # the broken property is real
    assert check_rows(switching, X) == RowCheck(many_rows=True, lone_row=True, max_rows=2)


def test_check_rows_tries_every_row_count_up_to_its_limit():
    """oneDNN's bfloat16 [576 x 576] at 2 threads (Intel Xeon with AMX) gave calls of 25-32 rows other bits than
    calls of 64 while 17 and 33 rows kept them: a kernel wrong only for row counts between the ones a sample
    would try gets no limit that lets such calls through."""
    def odd_counts(x: torch.Tensor) -> torch.Tensor:
        return by_row(x) + (1e-3 if 25 <= len(x) <= 32 else 0.0)

    check = check_rows(odd_counts, X)
    assert check.many_rows and check.max_rows < 25, check


def test_a_kernel_invariant_only_for_few_rows_gets_a_limit_and_linear_chunks_larger_calls():
    """Like oneDNN's AMX bfloat16 kernels (another algorithm above 32 rows): the check finds the largest
    row count that keeps the bits, and linear() splits larger calls into chunks of it."""
    def small_calls_only(x: torch.Tensor) -> torch.Tensor:
        return by_row(x) if len(x) <= 8 else (x.double() @ W.double().T).float()

    check = check_rows(small_calls_only, X)
    assert check == RowCheck(many_rows=True, lone_row=True, max_rows=8) and "up to 8 rows" in check.verdict

    class Fake(PackedLinear):
        pair = False

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return small_calls_only(x)

    packed = {"w": Fake(torch.empty(0), torch.float32, check)}
    many = linear(X[:21], W, packed, "w")                           # chunks of 8, 8 and 5 rows
    assert torch.equal(many, by_row(X[:21]))
    assert not torch.equal(small_calls_only(X[:21]), by_row(X[:21]))   # unchunked, the bits would differ


def test_a_kernel_whose_lone_row_differs_is_caught_and_linear_pairs_it():
    """gemv for one row, gemm for more: the check reports it, and linear() gives a lone row the bits of many."""
    def gemv_for_one(x: torch.Tensor) -> torch.Tensor:
        return by_row(x) + (1e-3 if len(x) == 1 else 0.0)

    check = check_rows(gemv_for_one, X)
    assert check == RowCheck(many_rows=True, lone_row=False) and "lone row differs" in check.verdict

    class Fake(PackedLinear):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return gemv_for_one(x)

    packed = {"w": Fake(torch.empty(0), torch.float32, check)}
    alone = linear(X[None, :1], W, packed, "w")                     # [1, 1, out]
    assert torch.equal(alone[0], gemv_for_one(X[:3])[:1])


@pytest.mark.skipif(not probe().onednn, reason="no oneDNN")
def test_packed_kernels_of_this_machine_pass_their_check():
    """The kernels this machine packs with are row-invariant for 2+ rows (the decoder relies on it)."""
    p = kernels.pack(torch.randn(3072, 576) * 0.05)
    assert p.check.many_rows
    x = torch.randn(9, 576)
    assert all(torch.equal(linear(x[i:i + 1], torch.empty(0), {"w": p}, "w"), linear(x, torch.empty(0), {"w": p}, "w")[i:i + 1])
               for i in range(9))


def test_self_check_catches_a_kernel_that_is_not_row_invariant(monkeypatch):
    """Feed the start-up self-check a linear kernel whose rows depend on the row count: it must fail."""
    from helpers import tiny_model

    model = tiny_model(seed=3).pack()
    assert self_check(model).passed
    true_call = PackedLinear.__call__
    monkeypatch.setattr(PackedLinear, "__call__", lambda self, x: true_call(self, x) * (1 + 1e-6 * len(x)))
    bad = self_check(model)
    assert not bad.passed and not bad.scores_invariant and "FAILED" in bad.summary()


@pytest.mark.parametrize("depends_on", ["rows", "sequences"])
def test_self_check_catches_an_lm_head_that_is_not_row_invariant(monkeypatch, depends_on):
    """The self-check scores the first layer's hidden states and then the LM head's rows apart: a head whose
    rows change with their count (or only with the number of sequences) fails it."""
    from helpers import tiny_model

    from specdec.models.decoder import Transformer

    model = tiny_model(seed=3).pack()
    assert self_check(model).passed
    true_head = Transformer.lm_head
    count = (lambda h: h.shape[0] * h.shape[1]) if depends_on == "rows" else (lambda h: h.shape[0])
    monkeypatch.setattr(Transformer, "lm_head", lambda self, h: true_head(self, h) * (1 + 1e-6 * count(h)))
    bad = self_check(model)
    assert not bad.passed and not bad.scores_invariant


def test_auto_picks_q4_then_native_bf16_then_float32(monkeypatch):
    import specdec.machine as machine

    cpu = torch.device("cpu")
    native = replace(probe(), onednn_bf16=True, avx512_bf16=True, int4_kernel=False)
    emulated = replace(native, avx512_bf16=False, amx=False, avx_ne_convert=False)
    monkeypatch.setattr(machine, "probe", lambda: native)
    assert choose_dtype("auto", cpu) == (torch.bfloat16, False)
    monkeypatch.setattr(machine, "probe", lambda: replace(native, int4_kernel=True))
    assert choose_dtype("auto", cpu) == (torch.bfloat16, True)          # q4, bfloat16 activations
    monkeypatch.setattr(machine, "probe", lambda: emulated)
    assert choose_dtype("auto", cpu) == (torch.float32, False)
    assert choose_dtype("bfloat16", cpu) == (torch.bfloat16, False)     # asked for: possible, if slower
    monkeypatch.setattr(machine, "probe", lambda: replace(emulated, int4_kernel=True))
    assert choose_dtype("auto", cpu) == (torch.float32, True)           # q4, float32 activations
    monkeypatch.setattr(machine, "probe", lambda: replace(emulated, onednn_bf16=False, isa_limit=""))
    with pytest.raises(SpecdecError, match="lacks what oneDNN's bfloat16 kernels need.*float32"):
        choose_dtype("bfloat16", cpu)
    with pytest.raises(SpecdecError, match="int4 kernel"):
        choose_dtype("q4", cpu)
    assert choose_dtype("auto", cpu) == (torch.float32, False)


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_cli_bad_dtype_and_isa_are_one_line_errors():
    out = _cli(["generate", "--prompt", "hi", "--dtype", "bfloat16"], {"SPECDEC_ISA": "avx2"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "bfloat16" in out.stderr and "float32" in out.stderr
    out = _cli(["generate", "--prompt", "hi", "--dtype", "float16"], {})
    assert out.returncode == 2 and "unknown dtype 'float16'" in out.stderr and "Traceback" not in out.stderr
    out = _cli(["generate", "--prompt", "hi", "--device", "cuda"], {}) if not torch.cuda.is_available() else None
    assert out is None or (out.returncode == 2 and "CUDA" in out.stderr and "Traceback" not in out.stderr)
    out = _cli(["info"], {"SPECDEC_ISA": "avx9"})
    assert out.returncode != 0 and "SPECDEC_ISA" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.integration
def test_info_names_machine_dtype_and_self_check():
    out = _cli(["info", "--json"], {})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    rt = info["runtime"]                                   # the object `generate --json` and /health carry
    assert info["machine"]["cpu"] and rt["self_check"]["passed"] and rt["cpu"] and info["context_tokens"] == 8192
    assert rt["dtype"] == ("q4" if probe().int4_kernel else "bfloat16" if probe().native_bf16 else "float32")
    assert info["cache"]["mib"] > 10 and 100 < info["peak_rss_mib"] < 8192          # MiB, as `info` prints them


@pytest.mark.integration
def test_auto_falls_back_to_float32_when_its_choice_fails_the_self_check(monkeypatch):
    import specdec.models.selfcheck as sc

    true_check = sc.self_check
    monkeypatch.setattr(sc, "self_check", lambda m: replace(true_check(m), scores_invariant=m.compute == "float32"))
    with pytest.warns(UserWarning, match="loading float32 instead"):
        model, _, _ = load_model("smollm2-135m", "auto")
    assert model.compute == "float32" and model.self_check.passed


# ---- the 4-bit mode ----------------------------------------------------------------------------------
def random_blocks(n: int, k: int, seed: int = 0):
    from specdec.models.int4 import GROUP, Blocks4
    import numpy as np

    r = np.random.default_rng(seed)
    return Blocks4(r.integers(0, 16, (n, k)).astype(np.uint8), (r.random((n, k // GROUP)) * 0.02 + 0.001).astype(np.float32),
                   (r.standard_normal((n, k // GROUP)) * 0.02).astype(np.float32))


@pytest.mark.skipif(not probe().int4_kernel, reason="no int4 kernel in this torch build")
def test_int4_kernel_computes_the_blocks_weights_with_rows_independent_of_their_count():
    from specdec.models.int4 import Int4Linear

    b = random_blocks(192, 256)
    lin = Int4Linear.of(b)
    assert lin.check == RowCheck(many_rows=True, lone_row=True)
    x = torch.randn(5, 256).bfloat16()
    ref = x.float() @ torch.from_numpy(b.dequantize()).T
    torch.testing.assert_close(lin(x).float(), ref, atol=0.03 * float(ref.abs().max()), rtol=0)
    assert all(torch.equal(lin(x[i:i + 1]), lin(x)[i:i + 1]) for i in range(5))


def test_q4_1_and_q4_k_blocks_decode_to_what_gguf_dequantizes():
    """Our block readers against the gguf package's own dequantizer, on quantized random weights."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    from specdec.models.int4 import blocks_q4_1, blocks_q4_k

    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    q41 = quantize(w, T.Q4_1)
    assert np.array_equal(blocks_q4_1(q41, (8, 512)).dequantize(), dequantize(q41, T.Q4_1).reshape(8, 512))
    try:
        q4k = quantize(w, T.Q4_K)
    except NotImplementedError:
        pytest.skip("this gguf version cannot quantize Q4_K")
    np.testing.assert_allclose(blocks_q4_k(q4k, (8, 512)).dequantize(), dequantize(q4k, T.Q4_K).reshape(8, 512), rtol=1e-6)


def _gguf_tensor(w, kind: str):
    """A GGUF reader's tensor view of w [N, K] quantized to `kind`: data, tensor_type, shape (innermost first)."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    return SimpleNamespace(data=quantize(w, T[kind]), tensor_type=T[kind], shape=[w.shape[1], w.shape[0]])


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_0"])
def test_blocks_of_8_bit_codes_decode_to_what_gguf_dequantizes(kind):
    """Q8_0, Q5_0 and Q4_0 as 8-bit codes and a scale per block give exactly gguf's weights (and Q4_0 as 4-bit
    blocks too); zero blocks (a scale of 0) decode to zeros."""
    import numpy as np
    from gguf.quants import dequantize

    from specdec.models.int4 import blocks_q4_0, read_blocks8

    w = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    w[3, 64:96] = 0
    t = _gguf_tensor(w, kind)
    ref = dequantize(t.data, t.tensor_type).reshape(8, 512)
    b = read_blocks8(t)
    assert b.q.dtype == np.int8 and np.array_equal(b.dequantize(), ref)
    assert np.abs(b.q).max() > {"Q8_0": 100, "Q5_0": 12, "Q4_0": 6}[kind]      # the codes' whole range is used
    if kind == "Q4_0":
        assert np.array_equal(blocks_q4_0(t.data, (8, 512)).dequantize(), ref)
    with pytest.raises(ValueError, match="8-bit codes"):
        read_blocks8(_gguf_tensor(w, "Q4_1"))


def test_q6_k_blocks_decode_to_what_gguf_dequantizes():
    """Random Q6_K super-blocks (any bits are valid codes and scales; the fp16 d kept finite) as 8-bit codes with a
    scale per 16 weights give exactly gguf's weights; joined with a Q8_0 part, that part's scales repeat."""
    import numpy as np
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    from specdec.models.int4 import Blocks8, read_blocks8

    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, (8 * 2, 210), dtype=np.uint8)                 # 8 rows of 512: 2 super-blocks each
    data[:, 208:210] = np.frombuffer(rng.uniform(1e-4, 1e-2, 16).astype(np.float16).tobytes(), np.uint8).reshape(16, 2)
    t = SimpleNamespace(data=data, tensor_type=T.Q6_K, shape=[512, 8])
    b = read_blocks8(t)
    assert b.sub == 16 and np.abs(b.q).max() == 32 and b.q.min() >= -32
    assert np.array_equal(b.dequantize(), dequantize(data, T.Q6_K).reshape(8, 512))
    w = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32)
    q8 = read_blocks8(_gguf_tensor(w, "Q8_0"))
    both = Blocks8.cat([q8, b])
    assert both.sub == 16 and np.array_equal(both.dequantize()[:4], q8.dequantize())


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q6_K"])
def test_real_8_bit_code_tensors_decode_to_what_gguf_dequantizes(kind):
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from specdec.models.int4 import read_blocks8
    from specdec.models.registry import resolve

    reader = gguf.GGUFReader(resolve("gemma3-270m")[1])
    t = next(t for t in reader.tensors if t.tensor_type.name == kind and t.name.startswith("blk."))
    ref = dequantize(t.data, t.tensor_type).reshape([int(s) for s in reversed(t.shape)])
    assert np.array_equal(read_blocks8(t).dequantize(), ref)


@pytest.mark.integration
@pytest.mark.parametrize("model, kind", [("smollm2-135m", "Q4_1"), ("gemma3-270m", "Q4_K")])
def test_real_4bit_tensors_decode_to_what_gguf_dequantizes(model, kind):
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from specdec.models.int4 import read_blocks
    from specdec.models.registry import resolve

    reader = gguf.GGUFReader(resolve(model)[1])
    t = next(t for t in reader.tensors if t.tensor_type.name == kind)
    ref = dequantize(t.data, t.tensor_type).reshape([int(s) for s in reversed(t.shape)])
    assert np.array_equal(read_blocks(t).dequantize(), ref)


def test_the_isa_limit_wins_over_a_variable_already_set_and_says_so(monkeypatch, capsys):
    """SPECDEC_ISA=avx2 with ATEN_CPU_CAPABILITY=avx512 already set ran AVX-512 kernels while reporting the limit."""
    from specdec.machine import apply_isa_limit

    monkeypatch.setattr(os, "environ", dict(os.environ))    # what apply_isa_limit sets must not reach later subprocesses
    monkeypatch.setenv("SPECDEC_ISA", "avx2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    assert apply_isa_limit() == "avx2"
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert capsys.readouterr().err == "specdec: warning: SPECDEC_ISA=avx2 sets ATEN_CPU_CAPABILITY=avx2 (it was avx512)\n"
