"""`specdec serve`: the OpenAI-compatible server (FastAPI + uvicorn)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .cli import add_model_args, int_in, thread_count
from .errors import SpecdecError
from .names import AUTO_METHOD, DRAFTLESS

if TYPE_CHECKING:
    from .api import Generator
    from .models.base import CausalLM
    from .server.scheduler import Scheduler
    from .server import ServerState
    from uvicorn import Server

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def register(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI API (completions, chat, streaming) with speculation",
                       formatter_class=fmt)
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    p.add_argument("--port", type=int_in(0, 65535), default=8000, help="TCP port to listen on")
    p.add_argument("--api-key", action="append", default=None,
                   help="require Authorization: Bearer KEY on /v1/*; repeat it for several clients, each a tenant of its "
                        "own for suffix decoding (default: $SPECDEC_API_KEY, keys separated by commas; unset = no auth)")
    p.add_argument("--max-batch", type=int_in(1), default=8, help="sequences decoded together (batch slots)")
    p.add_argument("--max-waiting", type=int_in(0), default=256, help="requests queued for a slot before answering 429")
    p.add_argument("--max-prompt-tokens", type=int_in(1), default=1024,
                   help="longest prompt a request may send, in tokens (400 beyond)")
    p.add_argument("--max-tokens", type=int_in(1), default=512, help="largest max_tokens a request may ask for")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN", type=origin,
                   help="let browser apps from ORIGIN (e.g. http://localhost:3000; * for any) call the API: CORS "
                        "headers and preflights (repeatable) (default: none: browsers refuse cross-origin calls)")
    p.add_argument("--max-body-bytes", type=int_in(1), default=1 << 20, help="largest request body (413 beyond)")
    p.add_argument("--prefill-tokens", type=int_in(1), default=256,
                   help="prompt tokens prefilled per step; while sequences decode, prefill and decode steps alternate, "
                        "so this bounds the pause new prompts cause (~0.4 s for 256 on 2 cores)")
    p.add_argument("--prefix-cache-mb", type=int_in(0), default=512,
                   help="memory for the prefix cache: prompts that start like a recent one (the next turn of a chat, a "
                        "shared system prompt) reuse its keys and values in pieces of 128 tokens, bit for bit (0 = off)")
    p.add_argument("--threads", type=thread_count, default=0,
                   help="torch CPU threads for decode steps (0 = torch's default, all cores); the engines run in the "
                        "main thread, the HTTP side in a helper thread that needs little CPU; measured on 2 cores "
                        "(benchmarks/serve_load.py): 2 threads serve 1.2x (batched) to 1.27x (one at a time) the tokens/s of 1")
    p.add_argument("--prefill-threads", type=thread_count, default=0,
                   help="torch CPU threads while a step prefills new prompts (0 = torch's default, all cores)")
    p.add_argument("--max-engines", type=int_in(1), default=4,
                   help="engines kept at once, the default method's included: each other (method, K) a request names "
                        "in `speculative` builds one (its own KV caches and draft weights: 0.6-0.75 GB each for "
                        "smollm2-135m with the default limits, docs/server.md); past the bound the least recently used "
                        "idle one is dropped, and a request that finds every engine busy waits for one to be idle (1 = only "
                        "the default method and none; another method gets a 429)")
    p.add_argument("--learn", action="store_true",
                   help="learn from traffic: the EAGLE-3 head that eagle3 and hybrid requests draft with is distilled "
                        "from the target's features of what they commit, between batches, and its learnt weights swapped "
                        "in between steps (greedy outputs unchanged, sampled ones exact in distribution, acceptance rises on recurring traffic; docs/server.md, "
                        "Learning from traffic)")
    p.add_argument("--learn-checkpoint", metavar="PATH", default="",
                   help="with --learn: the learnt head's file, written every 5 minutes and at shutdown and drafted with "
                        "at the next start (default: $SPECDEC_CACHE/learn/MODEL-eagle3.safetensors)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="log level on stderr of uvicorn and of the server's own log (the specdec logger: refused "
                        "requests at info (4xx) or warning (5xx), failed generations at error)")
    p.set_defaults(func=cmd_serve)


def origin(text: str) -> str:
    """An argparse type: a browser origin, not empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected an origin such as http://localhost:3000 or *, got an empty string")
    return text


def drafts_for_server(a: argparse.Namespace, gen: Generator) -> dict[str, str | CausalLM]:
    """What --draft-model means for each method's engines.

    With --method draft (or a method without one of its own: none, ngram, suffix) it is the draft model, loaded
    once and shared by every draft engine; with another method (e.g. trained heads) it is that method's weights.
    """
    from .api import make_proposer

    from .proposers.draft_model import DraftModelProposer

    if a.draft_model is None:
        return {}
    if gen.method in ("draft", *DRAFTLESS):
        proposer = gen.proposer if gen.method == "draft" else \
            make_proposer("draft", gen.target, gen.tokenizer, a.draft_model, a.dtype, a.device)
        # a draft with the target's tokenizer is shared; one with another (cross-vocabulary) is named, and each
        # draft engine loads it with its own vocabulary map
        return {"draft": proposer.model if isinstance(proposer, DraftModelProposer) else a.draft_model}
    return {gen.method: a.draft_model}


def learn_line(method: str, checkpoint: Path) -> str:
    """serve --learn's start-up line: what it learns from, where the head is kept, whether the default method learns."""
    from .server.learn import LEARNED_METHODS

    note = "" if method in LEARNED_METHODS else \
        f"; the default method {method} drafts without the head (--method hybrid learns from every request)"
    kept = "resuming the head learnt in" if checkpoint.exists() else "head kept in"
    return f"specdec: learning from eagle3 and hybrid requests ({kept} {checkpoint}){note}"


def check_learning(a: argparse.Namespace, method: str) -> None:
    """--learn where no request could ever teach the head is refused."""
    from .server.learn import LEARNED_METHODS

    if a.learn and a.max_engines == 1 and method not in LEARNED_METHODS:
        raise SpecdecError(f"--learn learns from eagle3 and hybrid requests, but with --max-engines 1 this server runs "
                           f"its default method {method} alone; use --method hybrid (or eagle3), or more engines")


def cmd_serve(a: argparse.Namespace) -> int:
    import signal

    import torch

    import specdec
    from .api import check_draft_source, serve_sample_drafts
    from .machine import probe
    from .server import ServeConfig, ServerState
    from .server.learn import LearnConfig
    from .tree import TreeShape

    check_address(a.host, a.port)                  # before the model loads: a taken port fails in a second
    cores = torch.get_num_threads()
    keys = tuple(a.api_key if a.api_key is not None else
                 [k.strip() for k in os.environ.get("SPECDEC_API_KEY", "").split(",") if k.strip()])
    if not all(keys):
        raise SpecdecError("--api-key must not be empty")
    config = ServeConfig(max_batch=a.max_batch, max_waiting=a.max_waiting, max_prompt_tokens=a.max_prompt_tokens,
                         max_tokens=a.max_tokens, max_body_bytes=a.max_body_bytes, api_keys=keys,
                         cors_origins=tuple(a.cors_origin),
                         prefill_tokens=a.prefill_tokens, prefix_cache_mb=a.prefix_cache_mb,
                         prefill_threads=a.prefill_threads or cores, max_engines=a.max_engines,
                         learn=LearnConfig(enabled=a.learn, checkpoint=a.learn_checkpoint))
    if a.learn_checkpoint and not a.learn:
        raise SpecdecError("--learn-checkpoint goes with --learn")
    torch.set_num_threads(a.threads or cores)
    if a.method != AUTO_METHOD:
        check_learning(a, a.method)                          # before the model loads
    own_draft = a.draft_model if a.method not in (*DRAFTLESS, AUTO_METHOD) else None   # else: method 'draft' uses it
    if a.draft_model is not None and own_draft is None:
        check_draft_source("draft", a.draft_model)                # a draft that is not there: before loading
    gen = specdec.load(a.model, method=a.method, dtype=a.dtype, device=a.device, draft_model=own_draft,
                       num_draft_tokens=a.num_draft_tokens, draft_policy=a.draft_policy, tree=a.tree,
                       sample_drafts=serve_sample_drafts(a.sample_drafts, a.method))
    check_learning(a, gen.method)                            # `auto` is known now
    context = gen.target.max_seq_len
    if a.max_prompt_tokens > context - 2:                      # a prompt, one answer token and the spare slot
        raise SpecdecError(f"--max-prompt-tokens {a.max_prompt_tokens} leaves no room for an answer in {gen.name}'s "
                           f"context of {context} tokens (at most {context - 2})")
    dtype = str(gen.target.dtype).removeprefix("torch.")      # the activations' dtype: proposers load in it too
    state = ServerState(gen, config, drafts_for_server(a, gen), dtype, TreeShape.parse(a.tree), a.sample_drafts)
    if a.host not in LOOPBACK and not keys:
        print(f"specdec: warning: listening on {a.host} without an API key (--api-key or SPECDEC_API_KEY)",
              file=sys.stderr)
    print(f"specdec: {gen.target.self_check.summary()}", file=sys.stderr)
    auth = f"on, {len(keys)} key(s)" if keys else "off"
    compute = state.runtime["dtype"]                         # what /health reports (q4, bfloat16, float32)
    if a.learn:
        print(learn_line(gen.method, config.learn.checkpoint_path(gen.name)), file=sys.stderr)
    family = probe().kernel_family                           # as `specdec info` names it
    print(f"specdec: serving {gen.name} (method {gen.method}, {compute}, kernels {family}) on http://{a.host}:{a.port}/v1 "
          f"(max batch {a.max_batch}, auth {auth})", file=sys.stderr, flush=True)
    server_log(a.log_level)
    code = run_server(http_server(state, a.host, a.port, a.log_level), state.scheduler)
    for sig in (signal.SIGINT, signal.SIGTERM):        # the process is ending: a repeated signal changes nothing,
        signal.signal(sig, signal.SIG_IGN)             # also while the interpreter exits (it resets Python handlers)
    return code


def server_log(level: str) -> None:
    """The server's own log (failed generations, rejected requests) on stderr at --log-level, beside
    uvicorn's lines."""
    import logging

    log = logging.getLogger("specdec")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     specdec: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False


def check_address(host: str, port: int) -> None:
    """Raise SpecdecError if `host`:`port` cannot be listened on (taken, unknown host, no permission)."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)          # as uvicorn binds
            s.bind((host, port))
    except OSError as e:
        raise SpecdecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


GRACE_SECONDS = 3.0      # after the scheduler stops: how long open connections (e.g. a client still sending its body)
                         # may keep the HTTP side from closing


def http_server(state: ServerState, host: str, port: int, log_level: str) -> Server:
    """uvicorn serving the app of `state` (not started)."""
    import uvicorn

    from .server.app import create_app

    return uvicorn.Server(uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                                         access_log=False, timeout_graceful_shutdown=GRACE_SECONDS))


def run_server(server: Server, scheduler: Scheduler) -> int:
    """uvicorn in a helper thread, the scheduler's loop in this one (the thread that loaded the model,
    see server/scheduler.py) until the HTTP side stops or SIGINT / SIGTERM arrives; a repeated signal changes
    nothing while the scheduler stops, and closes the remaining connections at once once it has. The previous
    handlers are back when it returns."""
    import signal
    import threading

    def http() -> None:
        try:
            server.run()                      # not the main thread: uvicorn installs no signal handlers
        finally:
            scheduler.stop()                  # e.g. the port was taken: end the loop too

    def interrupt(signum: int, frame: object) -> None:
        scheduler.request_stop()              # a flag read at the loop's next boundary: no step cut in half,
                                              # no request lost between the loop's lists; repeated signals too

    # explicit handlers, as uvicorn installs in the main thread (a shell's background job ignores SIGINT)
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    scheduler.in_caller = True
    web = threading.Thread(target=http, name="specdec-http", daemon=True)
    web.start()
    try:
        scheduler.run()
    finally:
        server.should_exit = True             # open streams got their 503 from run(); close gracefully, within
        for sig in previous:                  # GRACE_SECONDS or at the next signal
            signal.signal(sig, lambda signum, frame: setattr(server, "force_exit", True))
        web.join(GRACE_SECONDS + 10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        print("specdec: the HTTP server did not start (see the message above)", file=sys.stderr)
        return 1
    return 0
