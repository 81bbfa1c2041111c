"""The `specdec` command: generate, info, bench, serve, train, export.

Building the parser imports nothing heavy (names.py holds the accepted names): torch and the models load
inside the command that needs them, so `specdec --help` answers at once."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable

from . import names
from .errors import SpecdecError, terminate_as_interrupt

DEFAULT_METHOD = names.AUTO_METHOD


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, once: "(default: X)" is added unless the text states the
    default itself (options whose default is None or empty say in words what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("(default" in text or action.required or not action.option_strings
                or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (argparse names the flag in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {value}")
        return value
    return parse


def number_in(low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] ((low, high] with low_open)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
            bounds = f"in {'(' if low_open else '['}{low:g}, {high:g}]" if high != math.inf else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bounds}, got {text}")
        return value
    return parse


def one_of(kind: str, options: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse type: one of `options`, else an error naming the closest."""
    def parse(text: str) -> str:
        if text not in options:
            raise argparse.ArgumentTypeError(names.unknown(kind, text, options))
        return text
    return parse


def add_model_args(p: argparse.ArgumentParser, default_method: str = DEFAULT_METHOD,
                   default_policy: str = names.DEFAULT_POLICY) -> None:
    from .models.registry import DEFAULT_MODEL, MODELS

    p.add_argument("--model", default=DEFAULT_MODEL, help=f"registered name ({', '.join(MODELS)}) or a .gguf path")
    p.add_argument("--method", default=default_method, type=one_of("method", names.METHOD_CHOICES), metavar="METHOD",
                   help=f"speculative method: {', '.join(names.METHODS)}; auto: the best lossless one for the "
                        "model (suffix, prompt and output lookup, with the auto draft length); none: plain decoding")
    p.add_argument("--draft-model", default=None,
                   help="what the method drafts with: for draft and staged a registered name, a .gguf path, a "
                        "distilled draft (.safetensors from `specdec train draft`) or self:N (the target's first N "
                        "layers); for eagle, eagle3, hybrid, medusa and self a trained weights file (.safetensors; self also self:N, an "
                        "untrained exit); "
                        "for lookahead its shape W,N,G; none, ngram and suffix take none (serve: then it is the draft "
                        "of requests asking for method draft) (default: the draft, heads, exit shipped for the "
                        "target; lookahead 2,3,2)")
    p.add_argument("--num-draft-tokens", type=int_in(1, names.MAX_DRAFT_TOKENS), default=4,
                   help="drafts per step, K (start value for adaptive policies)")
    p.add_argument("--draft-policy", default=default_policy, type=one_of("draft policy", names.POLICIES),
                   choices=names.POLICIES,
                   help="draft length policy (auto: K from measured acceptance and costs, 0 when a big batch makes "
                        "drafting a loss)")
    p.add_argument("--tree", default="1", help="draft shape of eagle and eagle3: TOPKxBUDGET for a dynamic tree "
                                                "(e.g. 4x16: 4 children per node, 16 best nodes kept), 1 for a chain "
                                                "of K")
    p.add_argument("--sample-drafts", default=names.DEFAULT_SAMPLE_DRAFTS, metavar="{auto,on,off}",
                   type=one_of("draft sampling", names.SAMPLE_DRAFTS),
                   help="EAGLE chains (eagle, eagle3, hybrid's), rows that sample (temperature > 0): on draws their drafts from the "
                        "head's own distribution (accepted with probability 1 - TV(p, q) rather than p(argmax q)), "
                        f"off drafts the head's argmax, auto samples them at temperature {names.AUTO_SAMPLE_FROM:g} "
                        "and above, where that was measured to pay. Sampled drafts are exact in distribution, but "
                        "the sampled text is then not --method none's for the same seed (off keeps it); greedy "
                        "output is unaffected")
    add_dtype_arg(p)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")


def thread_count(text: str) -> int:
    """An argparse type: 0 (torch's default) or a thread count up to this machine's CPUs (torch crashes far above)."""
    cpus = os.cpu_count() or 1
    value = int_in(0)(text)
    if value > cpus:
        raise argparse.ArgumentTypeError(f"must be 0 or at most this machine's {cpus} CPUs, got {value}")
    return value


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=thread_count, default=0,
                   help="torch CPU threads (0 = torch's default, all cores); kernels are chosen per thread count, "
                        "so greedy text can differ between counts")


def set_threads(a: argparse.Namespace) -> None:
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=names.DTYPES, type=one_of("dtype", names.DTYPES),
                   help="auto: the fastest mode this machine computes exactly: q4 (the GGUF's 4- and 8-bit blocks through "
                        "native or torch int4 kernels) where they run, else bfloat16 where the CPU has it natively, else "
                        "float32; `specdec info` shows the choice and the self-check of exactness")


_ends_without_teardown = False       # set by `entry`: the process ends without freeing what is left
_KEPT: list[object] = []


def keep_until_exit(loaded: object) -> object:
    """`loaded` (a model or generator a command loaded), held until the process ends where the console script ends
    it without the interpreter's teardown (`entry`): freed when the command returned, gemma3-270m's tensors, maps and
    modules took 0.3-0.4 s of a one-token `specdec generate`. `main` called from Python holds nothing."""
    if _ends_without_teardown:
        _KEPT.append(loaded)
    return loaded


def cmd_info(a: argparse.Namespace) -> int:
    """The machine, the kernels and dtype `auto` chooses, and the self-check of exactness."""
    import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
    from .api import load_model, runtime_info
    from .machine import probe

    import resource
    import time

    from .models.registry import cache_dir

    set_threads(a)
    m = probe()
    t0 = time.perf_counter()
    target, _, name = keep_until_exit(load_model(a.model, a.dtype, a.device))
    load_s = time.perf_counter() - t0
    cache = cache_dir()
    cache_mb = tree_bytes(cache) / 2**20
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024              # Linux: KiB
    rt = runtime_info(target)                              # the object `generate --json` and /health carry too
    info = {"model": name, "context_tokens": target.max_seq_len, "machine": m.as_dict(), "runtime": rt,
            "load_seconds": round(load_s, 2), "cache": {"path": str(cache), "mib": round(cache_mb, 1)},
            "peak_rss_mib": round(peak_mb, 1)}
    if a.json:
        print(json.dumps(info))
        return 0
    feats = [f for f, on in (("AVX2", m.avx2), ("AVX-512", m.avx512), ("AVX-512-BF16", m.avx512_bf16),
                             ("AMX", m.amx), ("AVX-NE-CONVERT", m.avx_ne_convert)) if on]
    check = target.self_check
    rows = [("cpu", f"{m.cpu} ({m.arch}, {m.threads} thread{'s' if m.threads != 1 else ''})"),
            ("instruction sets", ", ".join(feats) or "none of AVX2/AVX-512"),
            ("torch kernels", m.torch_capability + (f" (limited by SPECDEC_ISA={m.isa_limit})" if m.isa_limit else "")
             + (f"; kernel family {m.kernel_family}" if m.kernel_family != m.torch_capability else "")),
            ("oneDNN bfloat16", "yes" + (" (native)" if m.native_bf16 else " (emulated)") if m.onednn_bf16 else "no"),
            ("int4 kernel", "yes" if m.int4_kernel else "no"),
            ("model", f"{name} (context {target.max_seq_len} tokens)"),
            ("dtype", rt["dtype"] + (f" (chosen by {a.dtype})" if a.dtype == "auto" else "")),
            ("linear kernels", rt["kernels"]), ("attention", rt["attention"]),
            ("layer loop", rt["layers"]),
            ("self-check", check.summary()),
            ("load", f"{load_s:.2f} s (this start; the first on a machine converts weights and checks kernels)"),
            ("cache", f"{cache_mb:.0f} MiB in {cache} ($SPECDEC_CACHE)"),
            ("peak RSS", f"{peak_mb:.0f} MiB")]
    rows += [(f"  {k}", v) for k, v in check.linears.items()]
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{w}}  {v}" for k, v in rows))
    return 0 if check.passed else 1


def read_text(path: str, what: str) -> str:
    """The text of file `path` ("-": standard input)."""
    if path == "-":
        try:
            return sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError:
            raise SpecdecError(f"the {what} on standard input is not UTF-8 text") from None
    f = Path(path)
    if f.is_dir():
        raise SpecdecError(f"{what} file is a directory: {f}")
    if not f.exists():                             # a pipe (<(...)) or a device reads like a file
        raise SpecdecError(f"{what} file not found: {f}")
    try:
        return f.read_bytes().decode("utf-8")      # as written: "\r\n" stays (read_text would make it "\n")
    except UnicodeDecodeError:
        raise SpecdecError(f"{what} file is not UTF-8 text: {f}") from None
    except OSError as e:                           # unreadable: permissions, an I/O error
        raise SpecdecError(f"cannot read the {what} file {f}: {e.strerror or e}") from None


def check_chat_template(model: str) -> None:
    """`--chat` for a model whose GGUF holds no chat template (a base model): refused before the model loads (the
    tokenizer, converted once and cached, is read in a fraction of a second; gguf's reader takes 16 s for Gemma's
    262k-token vocabulary)."""
    from .models.registry import resolve
    from .models.tokenizer import Tokenizer

    name, path = resolve(model)
    if not Tokenizer.from_gguf(path).has_chat_template:
        raise SpecdecError(f"{name} has no chat template (a base model?): leave --chat out or give --no-chat")


LONG_PROMPT_CHARS = 4000                             # about 1000 tokens: a prefill of a second or more


def cmd_generate(a: argparse.Namespace) -> int:
    import time

    import specdec

    if (a.prompt is None) == (a.prompt_file is None):
        raise SpecdecError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if a.prompt_file == "-" and a.prediction_file == "-":
        raise SpecdecError("--prompt-file and --prediction-file cannot both read standard input")
    prompt = read_text(a.prompt_file, "prompt") if a.prompt_file is not None else a.prompt
    prediction = read_text(a.prediction_file, "prediction") if a.prediction_file is not None else ""
    if prompt == "":                                  # mistakes the model is not needed for: before it loads
        raise SpecdecError("empty prompt")
    if "" in a.stop:
        raise SpecdecError("--stop takes non-empty strings")
    if a.logprobs is not None and not a.json:
        raise SpecdecError("--logprobs needs --json (the log-probabilities are a field of its object)")
    if a.chat:
        check_chat_template(a.model)
    set_threads(a)
    gen = specdec.load(a.model, method=a.method, dtype=a.dtype, device=a.device, draft_model=a.draft_model,
                       num_draft_tokens=a.num_draft_tokens, draft_policy=a.draft_policy, tree=a.tree,
                       sample_drafts=a.sample_drafts)
    keep_until_exit(gen)
    chat = gen.tokenizer.has_chat_template if a.chat is None else a.chat
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
              seed=a.seed, stop=tuple(a.stop), chat=chat, truncate=a.truncate, prediction=prediction)
    if a.json:
        asked = a.logprobs is not None
        res = gen.generate(prompt, **kw, logprobs=asked, top_logprobs=a.logprobs or 0)
        from .api import runtime_info

        out = {"method": gen.method, "text": res.text, "tokens": res.tokens, "metrics": res.metrics,
               "finish_reason": res.finish_reason, "prompt_tokens": res.prompt_tokens,
               "runtime": runtime_info(gen.target)}
        if asked:
            from .logprobs import token_text

            text = gen.tokenizer.token_bytes
            out["logprobs"] = [{"token": lp.token, "text": token_text(text(lp.token)),
                                "logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]} for lp in res.logprobs]
        print(json.dumps(out))
        return 0
    if hasattr(sys.stdout, "reconfigure"):           # a terminal that cannot show a character shows "?"
        sys.stdout.reconfigure(errors="replace")
    pieces = gen.stream(prompt, **kw)                # (checks the arguments)
    if len(prompt) >= LONG_PROMPT_CHARS:             # a long prefill says so before its wait
        print(f"specdec: reading the prompt ({len(gen.tokenizer.encode(prompt, chat))} tokens) ...", file=sys.stderr,
              flush=True)
    t0, first = time.perf_counter(), 0.0
    for piece in pieces:
        first = first or time.perf_counter() - t0
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    m, r = gen.last_result.metrics, gen.last_result
    ttft = f"; first text after {first:.2f} s" if first else ""        # the prompt's prefill is in it
    lines = [f"method {gen.method}, {m['new_tokens']} token{'s' * (m['new_tokens'] != 1)} in {m['wall_seconds']:.2f} "
             f"s after a prompt of {r.prompt_tokens} ({m['tokens_per_second']:.1f} tokens/s, prefill included{ttft}), "
             f"{m['target_forwards']} target forwards, tau {m['tau']:.2f}"]
    if m["acceptance_rate"] is not None:
        per = " ".join(f"{x:.2f}" for x in m["acceptance_per_position"])
        lines.append(f"acceptance {m['acceptance_rate']:.2f} (per position: {per}); "
                     f"draft {m['draft_seconds']:.2f} s, target {m['target_seconds']:.2f} s")
    taken = m["accepted_prediction_tokens"] + m["rejected_prediction_tokens"]
    if taken:
        lines.append(f"prediction: {m['accepted_prediction_tokens']} of its {taken} drafted tokens accepted "
                     f"(counted in the acceptance above)")
    print("\n".join(lines), file=sys.stderr)
    return 0


class VersionAction(argparse.Action):
    """--version: print "specdec VERSION" and exit (the version looked up only then)."""

    def __init__(self, option_strings: list[str], dest: str, default: str = argparse.SUPPRESS,
                 help: str = "print the version and exit") -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        from . import version

        print(f"specdec {version()}")
        parser.exit()


class SpecdecParser(argparse.ArgumentParser):
    """specdec's parsers: a usage error is a SpecdecError (one line, exit 2, see main); `commands` names the
    top-level parser's subcommands."""
    commands: tuple[str, ...] = ()
    subparsers: dict[str, "SpecdecParser"] = {}

    def error(self, message: str) -> None:          # argparse: print the usage, exit 2
        raise SpecdecError(f"{message} (see {self.prog} --help)")


def tree_bytes(folder: Path) -> int:
    """The bytes of the files under `folder`; files and folders another process removes meanwhile (a cache being
    written) are skipped, not an error."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += st.st_size
    return total


STOP_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def stop_string(text: str) -> str:
    """--stop's value with \\n, \\t, \\r and \\\\ read as the characters they stand for (a shell passes them
    as typed); any other backslash stays as it is."""
    import re

    return re.sub(r"\\([ntr\\])", lambda m: STOP_ESCAPES[m.group(1)], text)


def build_parser() -> SpecdecParser:
    fmt = HelpFormatter
    ap = SpecdecParser(prog="specdec", description="Lossless speculative decoding for LLMs.",
                                 formatter_class=fmt)
    ap.add_argument("--version", action=VersionAction)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    from .models.registry import DEFAULT_MODEL

    g = sub.add_parser("generate", help="generate text (streams it, then prints metrics)", formatter_class=fmt)
    add_model_args(g)
    g.add_argument("--prompt", default=None, help="prompt text (this or --prompt-file) (default: none)")
    g.add_argument("--prompt-file", default=None, help="read the prompt from this file, - for standard input "
                                                       "(default: none)")
    g.add_argument("--prediction-file", default=None,
                   help="the output you expect (e.g. the text being edited; - for standard input): drafted wherever "
                        "it matches, for any method, none included; the output stays exactly the model's "
                        "(default: no prediction)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: on when the model has one)")
    g.add_argument("--max-new-tokens", type=int_in(1), default=128, help="most tokens to generate")
    g.add_argument("--temperature", type=number_in(0.0), default=0.0, help="sampling temperature, 0 = greedy")
    g.add_argument("--top-p", type=number_in(0.0, 1.0), default=1.0,
                   help="nucleus sampling: keep the most likely tokens up to this probability mass, 1 = off, "
                        "0 = the most likely token only")
    g.add_argument("--top-k", type=int_in(0), default=0, help="keep the K most likely tokens, 0 = off")
    g.add_argument("--seed", type=int, default=0,
                   help="sampling seed (temperature > 0): the same seed, the same text; for methods that sample "
                        "their drafts (draft, self; eagle, eagle3, hybrid where --sample-drafts samples) only under "
                        "--draft-policy fixed")
    g.add_argument("--stop", action="append", default=[], type=stop_string,
                   help="stop string (repeatable); \\n, \\t, \\r and \\\\ in it are a newline, a tab, a carriage "
                        "return and a backslash, so --stop '\\n\\n' stops at a blank line (default: none)")
    g.add_argument("--truncate", action="store_true", help="keep the end of a prompt that is too long for the context")
    g.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    g.add_argument("--logprobs", type=int_in(0, names.MAX_TOP_LOGPROBS), default=None, metavar="N",
                   help="with --json: each generated token's log-probability under the model (before temperature, "
                        "top-k, top-p) and its position's N most likely tokens (default: off)")
    add_threads_arg(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="this machine, the kernels and dtype chosen, and the self-check of exactness",
                       formatter_class=fmt)
    i.add_argument("--model", default=DEFAULT_MODEL, help="registered name or .gguf path to check")
    add_dtype_arg(i)
    i.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    add_threads_arg(i)
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(func=cmd_info)

    for extra in ("bench", "serve", "train", "export"):
        try:
            mod = __import__(f"specdec.cli_{extra}", fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != f"specdec.cli_{extra}":
                raise
            continue
        mod.register(sub, fmt)
    ap.commands = tuple(sub.choices)
    ap.subparsers = dict(sub.choices)
    return ap


def check_command(ap: SpecdecParser, argv: list[str]) -> None:
    """A mistyped command is an error naming the closest one (argparse would only list them)."""
    first = next((x for x in argv if not x.startswith("-")), None)
    if first is not None and first not in ap.commands:
        raise SpecdecError(names.unknown("command", first, ap.commands))


def run(argv: list[str]) -> int:
    """Parse `argv` and run its command; a bare `specdec` prints the help on stderr (exit 2)."""
    import logging

    log = logging.getLogger("specdec")
    if not log.handlers:                                     # progress and notes (e.g. a draft vocabulary's overlap)
        class Stderr(logging.Handler):                       # whatever sys.stderr is when a record comes
            def emit(self, record: logging.LogRecord) -> None:
                print(self.format(record), file=sys.stderr, flush=True)

        handler = Stderr()
        handler.setFormatter(logging.Formatter("specdec: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    ap = build_parser()
    check_command(ap, argv)
    a, extra = ap.parse_known_args(argv)
    if extra:                                                # named by the command's parser: its --help lists them
        parser = ap.subparsers.get(a.command, ap)
        parser = parser.subparsers.get(getattr(a, "kind", ""), parser)     # `train KIND`: the kind's own parser
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if a.command is None:
        ap.print_help(sys.stderr)
        return 2
    if a.command == "train":                       # runs are stopped with `kill` too: SIGTERM ends one as Ctrl-C does
        from .cli_train import no_empty_dirs_of

        with terminate_as_interrupt(), no_empty_dirs_of(a):
            return a.func(a)
    if a.command == "bench":
        with terminate_as_interrupt():
            return a.func(a)
    return a.func(a)


def main(argv: list[str] | None = None) -> int:
    """The `specdec` entry point: bad input is one line and exit 2, Ctrl-C one line and exit 130, a reader that
    closes the output early (`specdec generate ... | head`) a quiet exit 141 (as a process killed by SIGPIPE)."""
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:                 # errors.Interrupted says more, e.g. where a run's state went
        print(f"specdec: interrupted{': ' + str(e) if str(e) else ''}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # nothing left to flush at exit
        except (OSError, ValueError):                                      # stdout is no file (captured)
            pass
        return 141


def entry() -> None:
    """The `specdec` console script: `main`, then, once no other thread is left, the exit handlers and a flush of
    the output, and the process ends without the interpreter's teardown (freeing a loaded model's modules, tensors
    and libraries one by one took 0.7-0.8 s of a one-token `specdec generate` on an AMD EPYC Zen 3); what a command
    loaded is not freed when it returns either (`keep_until_exit`)."""
    import atexit
    import threading

    global _ends_without_teardown
    _ends_without_teardown = True
    rc = main()
    if threading.active_count() > 1:               # a thread still running ends as Python ends it
        sys.exit(rc)
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:                        # the reader left before the last of the output
        rc = rc or 141
    except (OSError, ValueError):
        pass
    os._exit(rc)


if __name__ == "__main__":
    entry()
