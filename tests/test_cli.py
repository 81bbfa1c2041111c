"""The command line's surface: fast help without torch, the version, a bare or mistyped command, Ctrl-C."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

import specdec
from specdec.cli import main

# runs `main(argv)` in a fresh interpreter; prints its exit code and whether torch got imported
RUNNER = """
import json, sys
from specdec.cli import main
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


def test_help_is_fast():
    """`specdec --help` imports nothing heavy: well under half a second (Python's own start included)."""
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "specdec.cli", "--help"], capture_output=True, timeout=60, check=True)
        runs.append(time.perf_counter() - start)
    assert min(runs) < 0.5, runs


def test_keyboard_interrupt_is_one_line_exit_130(monkeypatch, capsys):
    import specdec.cli as cli

    def interrupted(a):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_info", interrupted)
    assert main(["info"]) == 130
    assert capsys.readouterr().err == "specdec: interrupted\n"


def test_ctrl_c_while_torch_imports_is_one_line():
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "generate", "--prompt", "hi"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)                                   # past the parser, inside the imports and the model load
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "specdec: interrupted\n"


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
