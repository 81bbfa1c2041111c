"""The benchmark runner end to end on a tiny model: results schema, report files, the equality check, bad input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.bench import peers, report, runner
from specdec.bench.peers import parse_peers
from specdec.bench.suites import Prompt
from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.tree import TreeShape

from helpers import tiny_model

USER, ASSISTANT, ANSWER = 2, 3, 4


class ChatTokenizer:
    """Token ids as space-separated numbers, with a toy chat template (role markers 2 / 3, answer cue 4)."""

    has_chat_template = True

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_ids: frozenset[int] = frozenset()
        self.vocab = {str(i): i for i in range(vocab_size)}
        self.bos_id = -1
        self.byte_ids: frozenset[int] = frozenset()

    def encode(self, text: str, chat: bool) -> list[int]:
        ids = [int(t) % self.vocab_size for t in text.split()]
        return self.encode_chat([{"role": "user", "content": text}]) if chat else ids

    def encode_text(self, text: str) -> list[int]:
        return self.encode(text, False)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += [USER if m["role"] == "user" else ASSISTANT] + self.encode(m["content"], False)
        return ids + [ANSWER]

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


PROMPTS = [
    Prompt("qa", "qa/1", ("5 6 7 8 5 6 7 8 5 6",), 10),
    Prompt("mt_bench", "mt_bench/1", ("9 10 11 12 9 10", "13 14 15"), 6),
]


class Corrupted(runner.MethodSystem):
    """A deliberately broken method: its last token is changed."""

    def generate(self, ids, max_new_tokens, params, prediction=""):
        out = super().generate(ids, max_new_tokens, params)
        out.tokens[-1] = (out.tokens[-1] + 1) % self.generator.target.vocab_size
        return out


class FakePeer:
    """A peer that is really our plain decoding (checks the peer bookkeeping)."""

    kind = "peer"
    description = "a fake peer"

    def __init__(self, system: runner.MethodSystem) -> None:
        self.name, self.system = "fake-peer", system

    def generate(self, ids, max_new_tokens, params, prediction=""):
        return self.system.generate(ids, max_new_tokens, params)

    def forget(self):
        pass


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and a busy machine makes thread barriers slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=3, layers=2)


def systems(target, methods: str = "none,ngram,draft", broken: str | None = None) -> list:
    tok = ChatTokenizer(target.vocab_size)
    built = runner.build_systems(target, tok, runner.parse_methods(methods, "self:1"), "float32", "cpu", 3,
                                 "fixed", "tiny")
    return [Corrupted(s.name, s.generator) if s.name == broken else s for s in built]


def bench(target, found: list, temperature: float = 0.0, repeats: int = 2) -> dict:
    config = {"model": "tiny", "dtype": "float32", "suite": "test", "num_draft_tokens": 3,
              "draft_policy": "fixed", "draft_model": "self:1"}
    return runner.benchmark(found, PROMPTS, ChatTokenizer(target.vocab_size), config,
                            runner.machine_info("float32"), "specdec bench (test)", repeats=repeats,
                            sampling=runner.SamplingParams(temperature), progress=False)


def test_results_schema_and_report_files(target, tmp_path):
    found = systems(target)
    results = bench(target, [*found, FakePeer(found[0])])
    assert results["schema"] == runner.SCHEMA and results["ok"] is True
    assert set(results) >= {"command", "config", "machine", "prompts", "summary", "runs", "elapsed_seconds"}
    assert {"cpu", "torch_threads", "torch", "dtype", "date"} <= set(results["machine"])
    assert results["config"]["methods"] == ["none", "ngram", "draft"]
    assert len(results["runs"]) == 2 * len(PROMPTS) * 4
    for run in results["runs"]:
        assert {"system", "kind", "prompt_id", "category", "repeat", "tokens", "new_tokens", "seconds",
                "tokens_per_second"} <= set(run)
        assert run["new_tokens"] == sum(len(t) for t in run["tokens"]) > 0
        assert len(run["tokens"]) == (2 if run["category"] == "mt_bench" else 1)
        if run["kind"] == "method":
            assert {"tau", "target_forwards", "acceptance_rate", "acceptance_per_position", "draft_seconds",
                    "target_seconds"} <= set(run)
            assert 0 <= run["draft_seconds"] + run["target_seconds"] <= run["seconds"]
    methods = results["summary"]["methods"]
    assert set(methods) == {"none", "ngram", "draft"}
    for cells in methods.values():
        assert set(cells) == {"qa", "mt_bench", "overall"}
        for cell in cells.values():
            assert {"tokens_per_second", "speedup", "speedup_total", "tau", "acceptance_rate",
                    "acceptance_per_position", "equal", "mismatches"} <= set(cell)
            assert cell["equal"] is True and cell["mismatches"] == 0
    assert methods["none"]["overall"]["tau"] == 1.0 and methods["none"]["overall"]["speedup"] == 1.0
    assert 0 <= methods["none"]["overall"]["draft_share"] < methods["draft"]["overall"]["draft_share"] < 1.0
    assert methods["draft"]["overall"]["tau"] >= 1.0 and len(methods["draft"]["overall"]["acceptance_per_position"]) == 3
    peer = results["summary"]["peers"]["fake-peer"]["overall"]
    assert peer["same_output"] == peer["runs"] and set(peer["speedup_of"]) == {"none", "ngram", "draft"}

    paths = report.write_report(results, tmp_path / "out")
    assert [p.name for p in paths] == ["results.json", "report.md", "speedup.png", "acceptance.png"]
    assert json.loads(paths[0].read_text())["summary"]["equality"]["failures"] == 0
    text = paths[1].read_text()
    assert "| method | qa | mt_bench | overall |" in text and "| `none` | 1.00× (1.00)" in text
    assert "| time proposing |" in text
    assert "fake-peer" in text and "specdec bench (test)" in text
    for png in paths[2:]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_repeats_do_not_draft_from_earlier_runs(target):
    """Suffix decoding's global index outlives requests; a repeat of a prompt must not draft from the previous
    repeat's output (nor from the warm-up), so every repeat drafts and accepts exactly as the first."""
    results = bench(target, systems(target, "none,suffix"), repeats=3)
    runs = [r for r in results["runs"] if r["system"] == "suffix"]
    for prompt in PROMPTS:
        counts = [(r["drafted_at"], r["accepted_at"]) for r in runs if r["prompt_id"] == prompt.id]
        assert len(counts) == 3 and counts[1] == counts[0] and counts[2] == counts[0]


def test_equality_check_really_fails(target, tmp_path):
    results = bench(target, systems(target, broken="ngram"), repeats=1)
    eq = results["summary"]["equality"]
    assert results["ok"] is False and eq["failures"] == len(PROMPTS)
    assert eq["failed_ids"] == ["ngram:mt_bench/1", "ngram:qa/1"]
    assert results["summary"]["methods"]["ngram"]["overall"]["equal"] is False
    assert results["summary"]["methods"]["draft"]["overall"]["equal"] is True
    report.write_report(results, tmp_path)
    assert "FAIL" in (tmp_path / "report.md").read_text()


def test_sampling_reports_no_equality(target, tmp_path):
    results = bench(target, systems(target, "none,ngram"), temperature=1.0, repeats=1)
    assert results["ok"] is True and results["summary"]["equality"]["checked"] is False
    assert results["summary"]["methods"]["ngram"]["overall"]["equal"] is None
    report.write_report(results, tmp_path)
    assert "n/a (sampling)" in (tmp_path / "report.md").read_text()


@pytest.fixture
def fake_cli(monkeypatch, target):
    """`specdec bench` on the tiny model and the two fake prompts; set broken[0] to corrupt a method."""
    import specdec.cli_bench as cli_bench

    broken: list[str | None] = [None]
    build = runner.build_systems
    monkeypatch.setattr(cli_bench, "load_model", lambda model, dtype, device: (target, ChatTokenizer(target.vocab_size), "tiny"))
    monkeypatch.setattr(cli_bench, "load_suite", lambda suite, categories: list(PROMPTS))
    monkeypatch.setattr(runner, "build_systems", lambda *a: [Corrupted(s.name, s.generator) if s.name == broken[0] else s
                                                              for s in build(*a)])
    return broken


def test_cli_samples_with_top_p_and_top_k_and_says_so(fake_cli, tmp_path, monkeypatch):
    """--top-p and --top-k reach every generation (with the run's seeds) and the results and report name them."""
    seen = []
    generate = runner.MethodSystem.generate
    monkeypatch.setattr(runner.MethodSystem, "generate", lambda self, ids, n, params, *rest: seen.append(params)
                        or generate(self, ids, n, params, *rest))
    out = tmp_path / "topp"
    assert main(["bench", "--methods", "ngram", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20",
                 "--seed", "3", "--no-progress", "--dtype", "float32", "--peers", "", "--out", str(out)]) == 0
    timed = [p for p in seen if p.temperature > 0]
    assert timed and all((p.temperature, p.top_p, p.top_k) == (0.8, 0.9, 20) for p in timed)
    assert len({p.seed for p in timed}) == len(PROMPTS)                     # a seed per prompt, shared by the methods
    c = json.loads((out / "results.json").read_text())["config"]
    assert (c["temperature"], c["top_p"], c["top_k"], c["greedy"]) == (0.8, 0.9, 20, False)
    assert "temperature 0.8, top-p 0.9, top-k 20" in (out / "report.md").read_text()
    assert main(["bench", "--top-p", "1.5", "--no-progress"]) == 2


def test_cli_exit_status_follows_equality(fake_cli, tmp_path):
    args = ["bench", "--methods", "ngram,draft", "--draft-model", "self:1", "--num-draft-tokens", "2",
            "--no-progress", "--dtype", "float32", "--peers", "", "--out"]
    assert main(args + [str(tmp_path / "good")]) == 0
    good = json.loads((tmp_path / "good" / "results.json").read_text())
    assert good["ok"] and good["config"]["methods"] == ["none", "ngram", "draft"]
    fake_cli[0] = "draft"
    assert main(args + [str(tmp_path / "bad")]) == 1
    bad = json.loads((tmp_path / "bad" / "results.json").read_text())
    assert not bad["ok"] and bad["summary"]["equality"]["failed_ids"] == ["draft:mt_bench/1", "draft:qa/1"]


@pytest.mark.parametrize("args, listed", [
    (["--methods", "none,bogus"], "unknown method 'bogus'; choose from: none, ngram, draft"),
    (["--categories", "qa,poetry"], "unknown benchmark category 'poetry'; valid categories: mt_bench, translation"),
    (["--peers", "vllm"], "unknown peer 'vllm'; choose from: transformers, llamacpp"),
    (["--model", "llama-70b"], "known models: smollm2-135m, gemma3-270m"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--temperature", "0.5", "--peers", "transformers"], "greedy only"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["--out", "/proc/nope"], "cannot write --out /proc/nope"),
    (["--out", ""], "--out is empty"),
    (["--categories", "qa,code,qa"], "--categories names 'qa' twice"),
    (["--methods", "none,lookahead=2,3"], "lookahead shape is W,N,G"),
    (["--methods", "eagle3=no-such-head.safetensors"], "draft 'no-such-head.safetensors' of method 'eagle3' not found"),
    (["--methods", "draft", "--draft-model", "no-such-draft"], "draft 'no-such-draft' of method 'draft' not found"),
])
def test_bad_input_lists_valid_names(monkeypatch, capsys, args, listed):
    import specdec.cli_bench as cli_bench

    monkeypatch.setattr(cli_bench, "load_suite", lambda suite, categories: list(PROMPTS))
    assert main(["bench", *args]) == 2
    assert listed in capsys.readouterr().err


def test_the_report_command_repeats_the_options_that_differ_from_the_defaults(monkeypatch):
    import specdec.cli_bench as cli_bench
    from specdec.cli import build_parser

    monkeypatch.setattr(cli_bench.sys, "argv", ["python"])          # not run as `specdec`: the command is rebuilt
    a = build_parser().parse_args(["bench", "--peers", "", "--device", "cuda:1", "--methods", "ngram"])
    line = cli_bench.command_line(a)
    assert "--peers ''" in line and "--device cuda:1" in line
    assert "--peers" not in cli_bench.command_line(build_parser().parse_args(["bench"]))
    monkeypatch.setenv("SPECDEC_ISA", "avx2")                       # a run on limited kernels says so, to be rerun so
    assert "SPECDEC_ISA=avx2 specdec bench" in cli_bench.command_line(a)


def test_a_report_under_an_isa_limit_names_it(target, tmp_path):
    results = bench(target, systems(target, "none"), repeats=1)
    results["config"]["runtime"] = {**results["config"].get("runtime", {}), "isa_limit": "avx2"}
    assert "(kernels limited to avx2 by SPECDEC_ISA)" in report.markdown(results)


def test_prediction_drafts_are_reported_apart_from_the_methods_own(target, tmp_path):
    """An `edit` prompt drafts from its prediction: the method's acceptance leaves those drafts out, and the
    report gives the prediction's own acceptance."""
    found = systems(target, "none,ngram")
    tok = ChatTokenizer(target.vocab_size)
    plain = found[0].generate(runner.turn_ids(tok, ("5 6 7 8",), []), 10, runner.SamplingParams()).tokens
    prompt = Prompt("edit", "edit/1", ("5 6 7 8",), 10, prediction=tok.decode(plain))   # what the target writes
    config = {"model": "tiny", "dtype": "float32", "suite": "test", "num_draft_tokens": 3,
              "draft_policy": "fixed", "draft_model": None}
    results = runner.benchmark(found, [*PROMPTS, prompt], tok, config, runner.machine_info("float32"),
                               "specdec bench (test)", repeats=1, progress=False)
    (r,) = [r for r in results["runs"] if r["prompt_id"] == "edit/1" and r["system"] == "ngram"]
    assert r["accepted_prediction"] >= 8 and len(r["drafted_at"]) <= 3      # K = 3: the prediction's 8 apart
    assert r["drafted"] == sum(r["drafted_at"]) and r["accepted"] == sum(r["accepted_at"])
    ngram, none = (results["summary"]["methods"][m]["overall"] for m in ("ngram", "none"))
    assert ngram["prediction_drafts"] >= 8 and ngram["prediction_acceptance"] > 0.5
    assert none["prediction_drafts"] == 0 and none["prediction_acceptance"] is None   # plain decoding: no prediction
    report.write_report(results, tmp_path)
    assert "prediction drafts accepted" in (tmp_path / "report.md").read_text()


def test_method_specs():
    specs = runner.parse_methods("ngram,draft,draft=self:3", "self:1")
    assert [(s.label, s.method, s.draft) for s in specs] == [
        ("none", "none", None), ("ngram", "ngram", None), ("draft", "draft", "self:1"), ("draft=self:3", "draft", "self:3")]
    with pytest.raises(SpecdecError, match="given twice"):
        runner.parse_methods("ngram,ngram", None)
    specs = runner.parse_methods("lookahead=2,3,2,ngram,lookahead", None)       # lookahead's shape keeps its commas
    assert [(s.label, s.draft) for s in specs[1:]] == [("lookahead=2,3,2", "2,3,2"), ("ngram", None),
                                                       ("lookahead", None)]
    assert runner.default_draft("no-such-model") == runner.FALLBACK_DRAFT
    specs = runner.parse_methods("ngram,ngram@auto,draft=self:2@heuristic", None)
    assert [(s.label, s.method, s.draft, s.policy) for s in specs[1:]] == [
        ("ngram", "ngram", None, ""), ("ngram@auto", "ngram", None, "auto"),
        ("draft=self:2@heuristic", "draft", "self:2", "heuristic")]
    with pytest.raises(SpecdecError, match="unknown draft policy 'fast'.*fixed, heuristic, auto"):
        runner.parse_methods("ngram@fast", None)
    specs = runner.parse_methods("eagle,eagle:4x16@auto", None)
    assert [(s.label, s.method, s.tree, s.policy) for s in specs[1:]] == [
        ("eagle", "eagle", TreeShape(1, 16), ""), ("eagle:4x16@auto", "eagle", TreeShape(4, 16), "auto")]
    specs = runner.parse_methods("eagle3,eagle3@sample=on,eagle3@sample=off,eagle@auto@sample=on,hybrid@auto", None)
    assert [(s.label, s.method, s.policy, s.sample_drafts) for s in specs[1:]] == [
        ("eagle3", "eagle3", "", "auto"), ("eagle3@sample=on", "eagle3", "", "on"),
        ("eagle3@sample=off", "eagle3", "", "off"), ("eagle@auto@sample=on", "eagle", "auto", "on"),
        ("hybrid@auto", "hybrid", "auto", "auto")]
    for spec, message in [
            ("eagle:wide", "TOPKxBUDGET"), ("eagle:4x", "TOPKxBUDGET"),
            ("ngram=self:4", "'ngram' drafts from the context and takes no draft"),
            ("eagle3=", "gives an empty draft"),
            ("ngram@sample=on", "applies to the EAGLE chains of eagle, eagle3 and hybrid.*not 'ngram'"),
            ("eagle:4x16@sample=on", "with a tree"),
            ("eagle3@sample=yes", "unknown setting 'sample=yes'.*sample=auto|on|off"),
            ("eagle3@sample=on@sample=off", "sets its draft sampling twice"),
            ("eagle3@auto@fixed", "sets its draft policy twice")]:
        with pytest.raises(SpecdecError, match=message):
            runner.parse_methods(spec, None)
    assert parse_peers("") == [] and parse_peers("transformers") == ["transformers"]


# --------------------------------------------------------------------------- llama.cpp's decode loop


class FakeDecoder:
    """The llama.cpp calls of the greedy loop on a fake model: the argmax after token t at position p is
    (3 t + p) % vocab; every call is recorded."""

    def __init__(self, vocab: int = 50, n_batch: int = 4) -> None:
        self.vocab, self.n_batch = vocab, n_batch
        self.calls: list[tuple] = []
        self.length = 0

    def truncate(self, length: int) -> None:
        self.calls.append(("truncate", length))
        self.length = min(self.length, length)

    def decode(self, tokens, start, every_row=False):
        assert 0 < len(tokens) <= self.n_batch and start == self.length and not every_row
        self.calls.append(("decode", list(tokens), start))
        self.length += len(tokens)

    def last_logits(self):
        _, tokens, start = self.calls[-1]
        logits = np.zeros(self.vocab, dtype=np.float32)
        logits[(3 * tokens[-1] + start + len(tokens) - 1) % self.vocab] = 1.0
        return logits


def expected_greedy(ids: list[int], n: int, vocab: int, eos: frozenset[int]) -> list[int]:
    out: list[int] = []
    last, pos = ids[-1], len(ids) - 1
    while len(out) < n:
        last, pos = (3 * last + pos) % vocab, pos + 1
        out.append(last)
        if last in eos:
            break
    return out


def test_greedy_loop_prefills_in_pieces_then_one_token_per_decode():
    dec = FakeDecoder(n_batch=4)
    ids = [5, 6, 7, 8, 9, 10, 11]
    tokens = peers.greedy_loop(dec, ids, 5, frozenset())
    assert tokens == expected_greedy(ids, 5, dec.vocab, frozenset())
    assert dec.calls[:3] == [("truncate", 0), ("decode", [5, 6, 7, 8], 0), ("decode", [9, 10, 11], 4)]
    # one decode of one token per new token but the last, at consecutive positions
    assert dec.calls[3:] == [("decode", [t], 7 + i) for i, t in enumerate(tokens[:-1])]


def test_greedy_loop_stops_at_eos_and_budget():
    ids = [1, 2, 3]
    free = expected_greedy(ids, 12, 50, frozenset())
    eos = frozenset({free[3]})
    assert free[3] not in free[:3]
    assert peers.greedy_loop(FakeDecoder(), ids, 12, eos) == free[:4]              # the EOS is kept, as ours
    assert peers.greedy_loop(FakeDecoder(), ids, 1, frozenset()) == free[:1]
    dec = FakeDecoder()
    assert peers.greedy_loop(dec, ids, 0, frozenset()) == [] and dec.calls[-1] == ("decode", ids, 0)


def test_loop_peer_times_the_loop_and_runs_greedy_only():
    peer = peers.LlamaCppLoopPeer("llama.cpp-loop", "fake", FakeDecoder(), frozenset())
    out = peer.generate([4, 5], 6, runner.SamplingParams())
    assert out.tokens == expected_greedy([4, 5], 6, 50, frozenset()) and out.seconds > 0 and out.counters is None
    peer.generate([9], 3, runner.SamplingParams())
    assert peer.decoder.calls.count(("truncate", 0)) == 2                       # every call starts afresh
    with pytest.raises(SpecdecError, match="greedy only"):
        peer.generate([4, 5], 6, runner.SamplingParams(temperature=1.0))


class ScaledPeer(FakePeer):
    """A yardstick peer giving our plain decoding's tokens (one changed when ``wrong``) in ``scale`` x 10 ms per
    token (a fixed time: the test checks the report, not this machine's speed)."""

    yardstick = True

    def __init__(self, system, name: str, scale: float, wrong: bool = False) -> None:
        super().__init__(system)
        self.name, self.scale, self.wrong = name, scale, wrong

    def generate(self, ids, max_new_tokens, params, prediction=""):
        out = super().generate(ids, max_new_tokens, params)
        if self.wrong and len(ids) > 15:                                      # the mt_bench prompt's second turn
            out.tokens[0] += 1
        return runner.Generation(out.tokens, 0.01 * self.scale * len(out.tokens), None)


def test_report_compares_every_method_with_the_fastest_yardstick(target, tmp_path):
    found = systems(target, "none,ngram")
    slow, fast = ScaledPeer(found[0], "plain-slow", 3.0), ScaledPeer(found[0], "plain-fast", 0.5, wrong=True)
    results = bench(target, [*found, slow, fast, FakePeer(found[0])], repeats=1)
    yard = results["summary"]["yardstick"]
    assert yard["peers"] == ["plain-slow", "plain-fast"] and yard["fastest"] == "plain-fast"
    assert yard["runs"] == len(PROMPTS) and yard["same_output"] == len(PROMPTS) - 1
    assert yard["tokens_per_second"]["plain-fast"] > 4 * yard["tokens_per_second"]["plain-slow"]
    text = report.markdown(results)
    assert "## Speedup over `plain-fast`, the fastest plain peer" in text
    assert "`plain-slow` and `plain-fast` gave the same tokens on 1/2 runs." in text
    section = text.split("## Speedup over `plain-fast`")[1].split("\n## ")[0]
    none_row = next(line for line in section.splitlines() if line.startswith("| `none` |"))
    ratio = results["summary"]["peers"]["plain-fast"]["overall"]["speedup_of"]["none"]
    assert ratio > 0 and none_row.endswith(f"{ratio:.2f}× |")
    assert bench(target, found, repeats=1)["summary"]["yardstick"] == {}


@pytest.mark.integration
def test_llamacpp_loop_gives_llamacpp_generate_tokens():
    """llama.cpp's decode loop through the low-level API and its Llama.generate agree, greedy, on real prompts."""
    pytest.importorskip("llama_cpp")
    from specdec.models.registry import resolve
    from specdec.models.tokenizer import Tokenizer

    path = resolve("smollm2-135m")[1]
    tok = Tokenizer.from_gguf(path)
    llm = peers.load_llama(path, 1)
    plain = peers.LlamaCppPeer("llama.cpp", "", llm, tok.eos_ids, yardstick=True)
    loop = peers.LlamaCppLoopPeer("llama.cpp-loop", "", peers.LlamaCppDecoder(llm), tok.eos_ids)
    for text in ("Write a haiku about the sea.", "What is 17 times 23? Explain step by step."):
        ids = tok.encode(text, True)
        want = plain.generate(ids, 40, runner.SamplingParams()).tokens
        assert len(want) > 5 and loop.generate(ids, 40, runner.SamplingParams()).tokens == want


class StopsAt:
    """A system that runs like `inner` until its `n`-th generation, where Ctrl-C arrives."""

    def __init__(self, inner, n: int) -> None:
        self.inner, self.n, self.calls = inner, n, 0
        self.name, self.kind = inner.name, inner.kind

    def generate(self, ids, max_new_tokens, params, prediction=""):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return self.inner.generate(ids, max_new_tokens, params, prediction)

    def forget(self):
        self.inner.forget()


def test_an_interrupted_run_reports_the_prompts_every_system_finished(target, tmp_path):
    none, ngram = systems(target, "none,ngram")
    results = bench(target, [none, StopsAt(ngram, 3)], repeats=1)   # a warm-up, prompt 1, then Ctrl-C in prompt 2
    assert results["interrupted"] and results["generations"] == {"ran": 2, "planned": 2 * len(PROMPTS)}
    assert [p["id"] for p in results["prompts"]] == [PROMPTS[0].id]
    assert {(r["system"], r["prompt_id"]) for r in results["runs"]} == {("none", PROMPTS[0].id),
                                                                         ("ngram", PROMPTS[0].id)}
    assert results["ok"] and "**Interrupted**: 2 of 4 generations" in report.markdown(results)
    assert not bench(target, [none, ngram], repeats=1)["interrupted"]
    with pytest.raises(KeyboardInterrupt, match="no prompt was finished"):
        bench(target, [none, StopsAt(ngram, 2)], repeats=1)


def bench_stopped_by_sigterm(out: Path, methods: str, when) -> tuple[int, str]:
    """A real `specdec bench` process (one prompt per category, 1 thread) sent SIGTERM once `when(its stderr so
    far)` holds: (its exit code, its stderr after the signal)."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([str(Path(sys.executable).parent / "specdec"), "bench", "--suite", "mini", "--limit", "1",
                             "--methods", methods, "--peers", "", "--threads", "1", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen = ""
    while not when(seen) and proc.poll() is None:
        seen += proc.stderr.read(1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


@pytest.mark.integration
def test_bench_interrupted_by_sigterm_keeps_a_report_and_exits_130(tmp_path):
    """A real `specdec bench` process (smollm2-135m), SIGTERM while it runs: the report of the prompts every
    system finished, exit 130 with one line."""
    import re

    out = tmp_path / "run"
    code, err = bench_stopped_by_sigterm(out, "none,ngram",                      # once a prompt is done by both
                                         lambda seen: re.search(r"\| ([3-9]|1[0-5])/16 ", seen))
    assert code == 130, err
    assert "specdec: interrupted: the report covers" in err
    results = json.loads((out / "results.json").read_text())
    assert results["interrupted"] and 0 < results["generations"]["ran"] < results["generations"]["planned"]
    assert results["ok"] and "**Interrupted**" in (out / "report.md").read_text()


@pytest.mark.integration
def test_bench_stopped_by_sigterm_while_it_loads_exits_130_and_leaves_no_folder(tmp_path):
    """SIGTERM before the timed loop (the model loading): one line, exit 130, no empty --out folder (the process
    used to die by the signal and leave the folder)."""
    out = tmp_path / "run"
    code, err = bench_stopped_by_sigterm(out, "none", lambda seen: "loading" in seen)
    assert code == 130, err
    assert err.strip().splitlines()[-1].startswith("specdec: interrupted") and "Traceback" not in err
    assert not out.exists()


@pytest.mark.integration
def test_bench_refuses_a_method_without_weights_for_the_model_before_loading(capsys):
    """As `generate` does: no "loading ..." first (it took 6 s for gemma3-270m)."""
    from specdec.cli import main

    assert main(["bench", "--model", "gemma3-270m", "--methods", "none,eagle3", "--peers", "", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "no shipped eagle3 weights for 'gemma3-270m'" in err and "loading" not in err
    assert "draft with a file (--methods ...,eagle3=FILE)" in err          # bench's --draft-model is `draft`'s


def test_a_report_file_that_cannot_be_replaced_is_refused_before_the_run(tmp_path, capsys):
    from specdec.cli import main

    (tmp_path / "results.json").mkdir()                                  # cannot be opened for writing
    assert main(["bench", "--methods", "none", "--peers", "", "--limit", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path}: cannot replace results.json" in err and "loading" not in err


def test_a_report_that_cannot_be_written_goes_to_a_new_folder(target, tmp_path):
    """A finished run is never lost: the files go elsewhere and the error says where."""
    import re
    import shutil

    results = bench(target, systems(target), repeats=1)
    (tmp_path / "report.md").mkdir()
    with pytest.raises(SpecdecError, match=f"cannot write the report into {tmp_path} .*; it went to ") as e:
        report.write_report(results, tmp_path)
    went = Path(re.search(r"it went to (\S+)$", str(e.value))[1])
    try:
        assert json.loads((went / "results.json").read_text()) == json.loads(json.dumps(results))
        assert (went / "report.md").is_file() and (went / "speedup.png").is_file()
    finally:
        shutil.rmtree(went)


def test_report_notes_show_no_absolute_paths():
    from specdec import cli_bench

    pkg = Path(cli_bench.__file__).resolve().parent
    note = f"transformers-assisted skipped: no transformers twin of draft '{pkg}/weights/d.safetensors' (x)"
    assert cli_bench.shown_paths(note) == ("transformers-assisted skipped: no transformers twin of draft "
                                           "'specdec/weights/d.safetensors' (x)")
    assert cli_bench.shown_paths(f"{Path.cwd().resolve()}/runs/a") == "./runs/a"
