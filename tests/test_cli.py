"""The command line's surface: fast help without torch, the version, a bare or mistyped command, Ctrl-C."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

import specdec
from specdec.cli import build_parser, main
from specdec.errors import SpecdecError

# runs `main(argv)` in a fresh interpreter; prints its exit code and whether torch got imported
RUNNER = """
import json, sys
from specdec.cli import build_parser, main
from specdec.errors import SpecdecError
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def run_cli(argv: list[str]) -> tuple[dict, str, str]:
    """(the runner's report, stdout, the rest of stderr) of `specdec ARGV` in a subprocess."""
    out = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(argv)], capture_output=True, text=True, timeout=120)
    *err, last = out.stderr.rstrip("\n").split("\n")
    return json.loads(last), out.stdout, "\n".join(err)


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["bench", "--help"], ["serve", "--help"],
                                  ["train", "eagle3", "--help"], ["export", "--help"], ["info", "--help"],
                                  ["--version"], [], ["gnerate"]])
def test_help_version_and_bad_commands_do_not_import_torch(argv):
    report, out, err = run_cli(argv)
    assert report["torch"] is False
    assert report["code"] == (2 if argv in ([], ["gnerate"]) else 0)


def test_import_specdec_is_light_and_loads_lazily():
    code = ("import sys, specdec; light = 'torch' not in sys.modules; load = specdec.load; "
            "print(light, 'torch' in sys.modules, load.__module__, specdec.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "True", "specdec.api", specdec.__version__]


def test_version():
    from importlib.metadata import version

    assert specdec.__version__ == version("specdec")
    report, out, _ = run_cli(["--version"])
    assert out.strip() == f"specdec {specdec.__version__}" and report["code"] == 0


def test_bare_specdec_prints_the_commands_and_exits_2():
    report, out, err = run_cli([])
    assert report["code"] == 2 and out == ""
    assert err.startswith("usage: specdec") and all(c in err for c in ("generate", "bench", "serve", "train"))


def test_mistyped_command_suggests_the_closest():
    report, _, err = run_cli(["gnerate", "--prompt", "hi"])
    assert report["code"] == 2
    assert err == ("specdec: error: unknown command 'gnerate'; did you mean 'generate'? "
                   "choose one of: generate, info, bench, serve, train, export")


def test_help_imports_nothing_heavy():
    """`specdec --help` (and a bare `specdec`) import neither torch nor numpy nor transformers: what makes a
    call take seconds (checked by the modules loaded, not by a time on a shared machine)."""
    probe = ("import sys, contextlib, io\n"
             "from specdec.cli import main\n"
             "for args in (['--help'], []):\n"
             "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
             "        try:\n"
             "            main(args)\n"
             "        except SystemExit:\n"
             "            pass\n"
             "print(sorted(m for m in ('torch', 'numpy', 'transformers', 'tokenizers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_keyboard_interrupt_is_one_line_exit_130(monkeypatch, capsys):
    import specdec.cli as cli

    def interrupted(a):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_info", interrupted)
    assert main(["info"]) == 130
    assert capsys.readouterr().err == "specdec: interrupted\n"


def test_ctrl_c_while_the_model_loads_is_one_line():
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "generate", "--prompt", "1, 2, 3, 4,", "--no-chat",
                             "--max-new-tokens", "2000", "--method", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))   # xdist workers ignore it
    first = proc.stderr.readline()                    # past the parser and torch's import: loading the model
    assert first.startswith("specdec: loading smollm2-135m")
    proc.send_signal(signal.SIGINT)                   # once: a native read that mangles it must not drop it
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.endswith("specdec: interrupted\n") and "Traceback" not in err


def test_the_light_names_equal_the_tables_they_stand_for():
    from specdec import api, draft_length, export, names
    from specdec.bench import peers, runner

    assert names.METHODS == api.METHODS == specdec.METHODS
    assert names.DTYPES == api.DTYPE_CHOICES and set(api.DTYPES) < set(names.DTYPES)
    assert names.POLICIES == draft_length.POLICIES
    assert names.MAX_DRAFT_TOKENS == draft_length.MAX_DRAFT_TOKENS
    assert names.PEERS == peers.PEERS and names.EXPORT_FORMATS == export.FORMATS
    assert names.BENCH_FALLBACK_DRAFT == runner.FALLBACK_DRAFT
    assert set(names.DRAFTLESS) < set(names.METHODS)


def parsers(parser: argparse.ArgumentParser, name: str = "specdec") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every (command line, parser) below `parser`, itself included."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from parsers(p, f"{name} {sub}")


def test_every_option_has_help_and_shows_its_default_once():
    checked = 0
    for name, parser in parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.default == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
                continue                                            # --help, --version, the command itself
            flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{flag} has no help text"
            text = formatter._expand_help(action)
            shown = 0 if action.required or not action.option_strings else 1
            assert text.count("(default") == shown, f"{flag}: {text!r}"
            assert "(default: None)" not in text and "(default: [])" not in text, f"{flag}: {text!r}"
            checked += 1
        usage = parser.format_help()
        assert all("(default:" not in line.split("(default:", 1)[1] for line in usage.splitlines()
                   if "(default:" in line), name
    assert checked > 100


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got 0"),
    (["generate", "--prompt", "hi", "--top-p", "1.5"], "argument --top-p: must be a finite number in [0, 1], got 1.5"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
    (["generate", "--prompt", "hi", "--top-k", "-2"], "argument --top-k: must be an integer >= 0, got -2"),
    (["generate", "--prompt", "hi", "--num-draft-tokens", "0"], "argument --num-draft-tokens: must be an integer in [1, 64]"),
    (["serve", "--port", "70000"], "argument --port: must be an integer in [0, 65535], got 70000"),
    (["serve", "--cors-origin", ""], "argument --cors-origin: expected an origin such as http://localhost:3000 or *"),
    (["generate", "--prompt", "hi", "--method", "eagel"], "unknown method 'eagel'; did you mean 'eagle'?"),
    (["generate", "--prompt", "hi", "--dtype", "flaot32"], "unknown dtype 'flaot32'; did you mean 'float32'?"),
    (["generate", "--prompt", "hi", "--draft-policy", "atuo"], "unknown draft policy 'atuo'; did you mean 'auto'?"),
    (["bench", "--draft-policy", "fixd"], "unknown draft policy 'fixd'; did you mean 'fixed'?"),
    (["bench", "--methods", "none,eagel"], "unknown method 'eagel'; did you mean 'eagle'?"),
    (["serve", "--port", "0", "--draft-model", "no-such-draft"], "draft 'no-such-draft' of method 'draft' not found"),
    (["serve", "--port", "0", "--learn", "--max-engines", "1", "--method", "suffix", "--threads", "1"],
     "with --max-engines 1 this server runs its default method suffix alone"),
    (["generate", "--prompt", "hi", "--method", "eagle3", "--draft-model", "h.safetensors"],
     "draft 'h.safetensors' of method 'eagle3' not found: it takes an EAGLE-3 head"),
    (["generate", "--prompt", "hi", "--model", "smolm2-135m"], "unknown model 'smolm2-135m'; did you mean 'smollm2-135m'?"),
    *[([*cmd, flag, "99999"], f"argument {flag}: must be 0 or at most this machine's {os.cpu_count()} CPUs, got 99999")
      for cmd, flag in [(["generate", "--prompt", "hi"], "--threads"), (["serve"], "--threads"),
                        (["serve"], "--prefill-threads"), (["bench"], "--threads"), (["info"], "--threads"),
                        (["train", "eagle3", "--out", "h.safetensors"], "--threads"), (["train", "magpie"], "--threads")]],
])
def test_cli_errors_name_the_flag_and_the_closest_name(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: ") and message in err and err.count("\n") == 1, err


def test_prompt_file_dash_reads_standard_input(monkeypatch):
    import io

    import specdec.cli as cli

    seen = {}

    class Stop(Exception):
        pass

    def fake_load(*args, **kw):
        raise Stop

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("a prompt from a pipe".encode())))
    monkeypatch.setattr(cli, "read_text", lambda path, what, read=cli.read_text: seen.setdefault(what, read(path, what)))
    monkeypatch.setattr(specdec, "load", fake_load)
    with pytest.raises(Stop):
        main(["generate", "--prompt-file", "-"])
    assert seen == {"prompt": "a prompt from a pipe"}
    assert main(["generate", "--prompt-file", "-", "--prediction-file", "-"]) == 2
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello \xff world")))     # not UTF-8: one line
    with pytest.raises(SpecdecError, match="the prompt on standard input is not UTF-8 text"):
        cli.read_text("-", "prompt")


def test_a_file_and_a_pipe_give_the_text_as_written(monkeypatch, tmp_path):
    import io

    import specdec.cli as cli

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"one\r\ntwo\rthree")))
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"one\r\ntwo\rthree")
    assert cli.read_text(str(crlf), "prompt") == cli.read_text("-", "prompt") == "one\r\ntwo\rthree"


def test_a_reader_that_closes_early_is_a_quiet_exit(monkeypatch, capsys):
    import specdec.cli as cli

    def closed(argv):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "run", closed)
    assert main(["generate", "--prompt", "hi"]) == 141
    assert capsys.readouterr().err == ""


def test_an_interrupted_training_run_says_where_its_state_is_in_one_line(monkeypatch, capsys):
    import specdec.cli as cli
    from specdec.errors import Interrupted

    def stopped(argv):
        raise Interrupted("state saved in out.ckpt; run the same command again to resume")

    monkeypatch.setattr(cli, "run", stopped)
    assert main(["train", "eagle3", "--out", "out.safetensors"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "specdec: interrupted: state saved in out.ckpt; run the same command again to resume\n"
    assert captured.out == ""


def test_unknown_flags_point_to_the_commands_help(capsys):
    assert main(["generate", "--prompt", "hi", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus (see specdec generate --help)" in capsys.readouterr().err
    assert main(["--bogus"]) == 2
    assert "(see specdec --help)" in capsys.readouterr().err


def test_exported_files_get_the_umask_mode(tmp_path):
    import os

    import torch

    from specdec.export import _write

    umask = os.umask(0o022)
    os.umask(umask)
    out = _write(tmp_path / "head", {"architectures": ["X"]}, {"w": torch.zeros(2, 3)}, overwrite=False)
    for name in ("model.safetensors", "config.json"):
        assert (out / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.integration
def test_a_failed_export_leaves_no_directory_it_made(tmp_path, capsys):
    bad = tmp_path / "not-a-head.safetensors"
    bad.write_text("not safetensors")
    out = tmp_path / "export"
    assert main(["export", "eagle3", str(out), "--weights", str(bad)]) == 2
    assert not out.exists() and "not-a-head.safetensors" in capsys.readouterr().err


def test_readme_lists_the_json_keys_there_are():
    import re
    from pathlib import Path

    from specdec.metrics import Counters

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    listed = re.search(r'`--json` prints exactly one object: `\{(.*?)\}`', readme, re.S).group(1)
    metrics = re.search(r'"metrics": \{(.*?)\}', listed, re.S).group(1)
    assert set(re.findall(r'"(\w+)"', metrics)) == set(Counters().as_dict())
    outer = re.sub(r'"metrics": \{.*?\}', '"metrics"', listed, flags=re.S)
    assert set(re.findall(r'"(\w+)"', outer)) == {"method", "text", "tokens", "metrics", "finish_reason", "prompt_tokens", "runtime"}


def test_bench_writes_a_new_run_folder_by_default(monkeypatch, tmp_path, capsys):
    """Without --out a run's report goes to runs/bench/SUITE-UTCTIME under the working directory, never over
    the shipped docs/benchmarks reports; --out is taken as given."""
    import re
    from pathlib import Path

    import specdec.api
    import specdec.cli_bench as cli_bench
    from specdec.bench import report, runner

    written: list[Path] = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_bench, "load_model", lambda model, dtype, device: (None, None, "tiny"))
    monkeypatch.setattr(cli_bench, "load_suite", lambda suite, categories: [])
    monkeypatch.setattr(specdec.api, "runtime_info", lambda target: {"dtype": "float32"})
    monkeypatch.setattr(runner, "build_systems", lambda *a: [])
    monkeypatch.setattr(runner, "machine_info", lambda dtype: {})
    monkeypatch.setattr(runner, "benchmark", lambda *a: {"ok": True, "summary": {"equality": {}}})
    monkeypatch.setattr(report, "write_report", lambda results, out: written.append(out) or [out / "results.json"])
    monkeypatch.setattr(report, "summary_table", lambda results: "")
    args = ["bench", "--methods", "none", "--peers", "", "--suite", "mini"]
    assert main(args) == 0
    assert main([*args, "--out", "mine"]) == 0
    assert re.fullmatch(r"runs/bench/mini-\d{8}T\d{6}Z", written[0].as_posix()), written
    assert written[1] == Path("mine")


def test_training_data_defaults_to_the_shipped_shards_from_any_directory(monkeypatch, tmp_path):
    """train exit / eagle3 read, and train magpie appends to, the data/MODEL shipped in the source tree when no
    path is given, whatever the working directory; a given path is taken as given (relative to it)."""
    from pathlib import Path

    import specdec.cli_train as cli_train
    import specdec.train.exit
    import specdec.train.magpie

    shipped = Path(__file__).resolve().parents[1] / "data" / "smollm2-135m"
    assert list(shipped.glob("magpie-*.npz")), "the repository ships magpie shards"
    seen: list[Path] = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_train, "_train_dtype", lambda a: None, raising=False)
    monkeypatch.setattr(specdec.train.exit, "train_exit", lambda model, data, *rest, **kw: seen.append(data) or {})
    monkeypatch.setattr(specdec.train.magpie, "generate_magpie", lambda model, out, *rest: seen.append(out))
    monkeypatch.setattr(specdec.train.magpie, "summary", lambda out: {})
    exit_args = ["train", "exit", "--out", "exit.safetensors", "--layers", "6"]
    assert main(exit_args) == 0
    assert main([*exit_args, "--data", "mine"]) == 0
    assert main(["train", "magpie"]) == 0
    assert main(["train", "magpie", "--out", "shards"]) == 0
    assert seen[0].is_absolute() and seen[0].resolve() == seen[2].resolve() == shipped
    assert seen[1] == Path("mine") and seen[3] == Path("shards")


def test_text_a_terminal_cannot_encode_is_replaced_not_a_traceback(monkeypatch, capsys):
    import io
    from types import SimpleNamespace

    from specdec.metrics import Counters

    metrics = {**Counters().as_dict(), "new_tokens": 2, "wall_seconds": 0.1, "tokens_per_second": 20.0,
               "target_forwards": 2, "tau": 1.0}

    class Gen:
        method, tokenizer = "none", SimpleNamespace(has_chat_template=False)
        last_result = SimpleNamespace(metrics=metrics, prompt_tokens=3)

        def stream(self, prompt, **kw):
            yield from ("Tokyo: ", "東京")

    out = io.TextIOWrapper(io.BytesIO(), encoding="latin-1")
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(specdec, "load", lambda *a, **kw: Gen())
    assert main(["generate", "--prompt", "Hi"]) == 0
    out.flush()
    assert out.buffer.getvalue() == b"Tokyo: ??\n"
    stats = capsys.readouterr().err.strip()             # what the rate counts: the prefill too
    assert re.fullmatch(r"method none, 2 tokens in 0\.10 s after a prompt of 3 \(20\.0 tokens/s, prefill included; "
                        r"first text after \d\.\d\d s\), 2 target forwards, tau 1\.00", stats), stats


def test_stop_strings_read_backslash_escapes(monkeypatch):
    from specdec.cli import build_parser

    a = build_parser().parse_args(["generate", "--prompt", "hi", "--stop", "\\n\\n", "--stop", "a\\tb\\\\n",
                                   "--stop", "\\d", "--stop", "\n"])
    assert a.stop == ["\n\n", "a\tb\\n", "\\d", "\n"]


def test_the_summary_names_the_predictions_accepted_drafts(monkeypatch, capsys):
    from types import SimpleNamespace

    from specdec.metrics import Counters

    c = Counters(wall_seconds=0.5)
    c.record_step(2, 1, 2)
    c.record_step(8, 6, 7, predicted=True)

    class Gen:
        method, tokenizer = "ngram", SimpleNamespace(has_chat_template=False)
        last_result = SimpleNamespace(metrics=c.as_dict(), prompt_tokens=3)

        def stream(self, prompt, **kw):
            yield "text"

    monkeypatch.setattr(specdec, "load", lambda *a, **kw: Gen())
    assert main(["generate", "--prompt", "Hi"]) == 0
    err = capsys.readouterr().err
    assert "acceptance 0.70 (per position: 1.00 0.50 1.00 1.00 1.00 1.00 0.00 0.00)" in err
    assert "prediction: 6 of its 8 drafted tokens accepted (counted in the acceptance above)" in err


def test_serve_shares_a_draft_of_the_same_tokenizer_and_names_one_of_another(monkeypatch):
    """serve --draft-model: a draft with the target's tokenizer is loaded once and shared by the draft engines;
    one with another tokenizer (gemma3-270m drafted by smollm2-135m) is passed by name, each draft engine
    building its own vocabulary map; a head's file goes to its method."""
    from types import SimpleNamespace

    import specdec.api
    from specdec.cli_serve import drafts_for_server
    from specdec.proposers.cross_vocab import CrossVocabProposer
    from specdec.proposers.draft_model import DraftModelProposer

    same = DraftModelProposer(object())
    other = object.__new__(CrossVocabProposer)
    a = SimpleNamespace(draft_model="smollm2-135m", dtype="auto", device="cpu")
    gen = SimpleNamespace(method="draft", proposer=same, target=None, tokenizer=None)
    assert drafts_for_server(a, gen) == {"draft": same.model}
    assert drafts_for_server(a, SimpleNamespace(**{**vars(gen), "proposer": other})) == {"draft": "smollm2-135m"}
    for made in (same, other):
        monkeypatch.setattr(specdec.api, "make_proposer", lambda *args, made=made: made)
        want = same.model if made is same else "smollm2-135m"
        assert drafts_for_server(a, SimpleNamespace(**{**vars(gen), "method": "suffix"})) == {"draft": want}
    head = SimpleNamespace(draft_model="head.safetensors")
    assert drafts_for_server(head, SimpleNamespace(**{**vars(gen), "method": "eagle3"})) == {"eagle3": "head.safetensors"}


ENTRY = """
import atexit, sys, threading, time
import specdec.cli as cli
path, threaded = sys.argv[1], sys.argv[2] == "1"
def fake_main():
    sys.stdout.write("x" * 1_000_000)                     # left in the buffer: the exit must flush it
    atexit.register(lambda: open(path, "w").write("handlers ran"))
    if threaded:                                          # a thread still running: Python's own exit waits for it
        threading.Thread(target=lambda: (time.sleep(0.5), sys.stderr.write("thread done"))).start()
    return 3
cli.main = fake_main
cli.entry()
"""


@pytest.mark.parametrize("threaded", [False, True])
def test_the_console_script_exits_with_the_code_output_and_handlers_of_a_full_exit(tmp_path, threaded):
    """`entry` skips the interpreter's teardown, not what an exit owes: the buffered output, the exit handlers, the
    command's exit code; a thread still running is waited for as Python's own exit would."""
    marker = tmp_path / "marker"
    out = subprocess.run([sys.executable, "-c", ENTRY, str(marker), str(int(threaded))], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 3 and out.stdout == "x" * 1_000_000
    assert marker.read_text() == "handlers ran"
    assert ("thread done" in out.stderr) == threaded


def test_what_a_command_loaded_is_held_only_where_the_process_ends_without_teardown(monkeypatch):
    """`generate` and `info` hand their model to `keep_until_exit`: held (not freed when the command returns) only
    under the console script, which ends the process without freeing it; `main` called from Python holds nothing."""
    import specdec.cli as cli

    loaded = object()
    monkeypatch.setattr(cli, "_KEPT", [])
    assert cli.keep_until_exit(loaded) is loaded and cli._KEPT == []
    monkeypatch.setattr(cli, "_ends_without_teardown", True)
    assert cli.keep_until_exit(loaded) is loaded and cli._KEPT == [loaded]
