"""The OpenAI-compatible HTTP layer: request validation, responses, SSE streaming, auth, limits, metrics.

Request bodies are validated by FastAPI with the pydantic models of schema.py (types, ranges, unknown
fields: a 400 naming the field, never silently ignored), then against this server (its model, limits,
draft models, tokenizer) here. Every error answers with OpenAI's error JSON.
"""
from __future__ import annotations

import asyncio
import codecs
import hashlib
import hmac
import json
import logging
import math
import random
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import torch
from fastapi import Depends, FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..api import WEIGHTS_OF, DraftSource, Generator, best_method, has_shipped, runtime_info
from ..draft_length import MAX_DRAFT_TOKENS
from ..engine import Request
from ..errors import SpecdecError
from ..logprobs import TokenLogprob, token_text
from ..models.tokenizer import Tokenizer
from ..names import AUTO_METHOD, DEFAULT_SAMPLE_DRAFTS
from ..prefix_cache import PrefixCache
from ..sampling import SamplingParams, derive_seed
from ..tree import TreeShape
from .learn import LearnConfig, Learner, NoLearning, OnlineLearner
from .schema import (ChatCompletionRequest, CommonRequest, CompletionRequest, Prediction, Speculative, TextPart,
                     describe)
from .scheduler import (Closed, Done, EngineCollector, EnginePool, Event, Failed, Job, QueueFull, Scheduler,
                        ServerMetrics, SpecChoice, TextPiece, log)

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
POLL_SECONDS = 0.5                      # how often a non-streaming request checks for a disconnect
STREAM_START_SECONDS = 5.0              # a stream whose first event takes longer (queued) starts without it
KEEP_ALIVE_SECONDS = 15.0               # an SSE comment after this long without an event (proxies' idle timeouts)


@dataclass(frozen=True)
class ServeConfig:
    max_batch: int = 8                  # sequences decoded together (cache rows per engine)
    max_waiting: int = 256              # queued beyond max_batch before 429
    max_prompt_tokens: int = 1024
    max_tokens: int = 512               # cap on a request's max_tokens
    max_body_bytes: int = 1 << 20
    api_keys: tuple[str, ...] = ()      # accepted bearer tokens (none: no auth); each key is a suffix tenant
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any; none: no CORS headers)
    max_engines: int = 4                # distinct (method, K) engines kept at once
    prefill_tokens: int = 256           # prompt tokens prefilled per step (prefill and decode steps alternate)
    prefix_cache_mb: int = 512          # the prefix cache's budget for keys, values and hidden states (0: off)
    # torch threads while prefilling (default: torch's own count); decode steps use the process's setting
    prefill_threads: int = field(default_factory=torch.get_num_threads)
    learn: LearnConfig = LearnConfig()  # online distillation of the EAGLE-3 head (off unless learn.enabled)

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_prompt_tokens", "max_tokens", "max_body_bytes", "max_engines",
                     "prefill_tokens", "prefill_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecdecError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.prefix_cache_mb, int) or self.prefix_cache_mb < 0:
            raise SpecdecError(f"prefix_cache_mb must be an integer >= 0, got {self.prefix_cache_mb!r}")
        if not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            raise SpecdecError(f"max_waiting must be an integer >= 0, got {self.max_waiting!r}")
        if not isinstance(self.api_keys, tuple) or not all(isinstance(k, str) and k for k in self.api_keys):
            raise SpecdecError("api_keys must be a tuple of non-empty strings")
        if not isinstance(self.cors_origins, tuple) or not all(isinstance(o, str) and o for o in self.cors_origins):
            raise SpecdecError("cors_origins must be a tuple of non-empty strings")


class ServerState:
    """Everything one app serves: the model, its engines and worker, limits and metrics."""

    def __init__(self, generator: Generator, config: ServeConfig, drafts: dict[str, DraftSource] | None = None,
                 dtype: str = "float32", tree: TreeShape = TreeShape(),
                 sample_drafts: str = DEFAULT_SAMPLE_DRAFTS) -> None:
        """`drafts`: per method, what its proposers draft with (api.DraftSource, e.g. {"draft": a loaded draft});
        `dtype`: the target's dtype name, for anything a proposer loads; `tree`: EAGLE's draft shape;
        `sample_drafts`: whether the EAGLE chains of its engines (the default one included) sample their drafts
        (api.sample_drafts_from)."""
        self.generator, self.config, self.drafts = generator, config, dict(drafts or {})
        self.model_name = generator.name
        self.runtime = runtime_info(generator.target)          # machine, dtype, kernels, self-check (/health)
        self.created = int(time.time())
        k = generator.num_draft_tokens if generator.method != "none" else 0
        self.default = SpecChoice(generator.method, k)
        self.max_draft_tokens = min(MAX_DRAFT_TOKENS, max(16, k))
        prefix_cache = PrefixCache(config.prefix_cache_mb << 20)           # one for every engine of the pool
        self.metrics = ServerMetrics(prefix_cache)
        self.learner = self._learner(generator)
        self.pool = EnginePool(generator, self.learner.source(self.drafts), dtype, self.default, config.max_batch,
                               config.max_prompt_tokens + config.max_tokens, config.max_engines, tree,
                               prefix_cache, config.prefill_tokens, self.learner, sample_drafts)
        self.metrics.registry.register(EngineCollector(self.pool))
        self.scheduler = Scheduler(self.pool, self.metrics, config.max_batch, config.max_waiting,
                                   config.prefill_threads)

    def _learner(self, generator: Generator) -> Learner:
        """The eagle3 head's online learner with --learn (a lean GGUF target only), else none."""
        from ..models.decoder import Transformer

        if not self.config.learn.enabled:
            return NoLearning()
        if not isinstance(generator.target, Transformer):
            raise SpecdecError("learning from traffic (--learn) needs a lean GGUF target (EAGLE-3 heads do)")
        return OnlineLearner(self.config.learn, generator.target, self.model_name, self.metrics.registry)


# ---- errors ------------------------------------------------------------------------------
class ApiError(Exception):
    """An error answered with OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class KeepAlive:
    """No event for a while: the stream sends an SSE comment so that proxies keep the connection."""


class StillWaiting(Exception):
    """No event of the job came within the time asked."""


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object; a message quoting a lone surrogate of the request shows it escaped (UTF-8 has none)."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if code is None and status == 429:
        code = "rate_limit_exceeded"
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


# ---- request parsing: the server-dependent checks after schema validation ------------------------
@dataclass(frozen=True)
class Parsed:
    prompts: list[list[int]]           # one for chat; completions may send several (each gets n choices)
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    spec: SpecChoice
    stream: bool
    include_usage: bool
    prediction: tuple[int, ...]
    logprobs: bool                     # report the completion tokens' log-probabilities
    top_logprobs: int                  # ... with that many alternatives each
    echoes: list[str] = field(default_factory=list)  # completions with echo: each prompt's text, before its text
    n: int = 1                         # choices per prompt (OpenAI's n), each sampled with a seed of its own


def content_text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def prediction_ids(prediction: Prediction | None, state: ServerState) -> tuple[int, ...]:
    """OpenAI's `prediction` as token ids (() if absent)."""
    if prediction is None:
        return ()
    try:
        return state.generator.prediction_ids(content_text(prediction.content))
    except SpecdecError as e:
        raise bad(str(e), "prediction", "context_length_exceeded") from None


def check_model(value: Any, state: ServerState) -> None:
    """An unknown model is a 404 (checked before anything else about the request)."""
    if isinstance(value, str) and value != state.model_name:
        raise ApiError(404, f"The model `{value}` does not exist (this server serves `{state.model_name}`)",
                       "model", "model_not_found")


def seed_of(value: int | None) -> int:
    """A request's seed as given, any 64-bit integer, as offline generation takes it (absent: a random one)."""
    return random.getrandbits(64) if value is None else value


def include_usage(req: CommonRequest) -> bool:
    """stream_options.include_usage (stream_options only goes with stream: true)."""
    if req.stream_options is None:
        return False
    if not req.stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    return bool(req.stream_options.include_usage)


def speculation(value: Speculative | None, state: ServerState) -> SpecChoice:
    """The extension field {"method": ..., "num_draft_tokens": K}; absent = the server's default."""
    if value is None:
        return state.default
    method = value.method or state.default.method
    if method == AUTO_METHOD:                          # as `load(method="auto")`: the best method for the model
        method = best_method(state.generator.target)
    if method == "none":
        return SpecChoice("none", 0)
    if method in WEIGHTS_OF and not state.pool.drafts.get(method) and not has_shipped(state.model_name,
                                                                                       WEIGHTS_OF[method]):
        raise bad(f"method {method!r} has no draft weights for {state.model_name} on this server; ask for another "
                  "method (e.g. suffix), or start the server with --draft-model for it", "speculative")
    k = value.num_draft_tokens or state.default.num_draft_tokens or state.generator.num_draft_tokens
    if k > state.max_draft_tokens:
        raise bad(f"speculative.num_draft_tokens must be <= {state.max_draft_tokens}, got {k}", "speculative")
    return SpecChoice(method, k)


def check_prompt_length(ids: list[int], max_tokens: int, state: ServerState, param: str) -> None:
    """max_tokens 0: not sent (the answer takes the room left, at least one token)."""
    limit = state.config.max_prompt_tokens
    if len(ids) > limit:
        raise bad(f"the prompt has {len(ids)} tokens, more than this server's limit of {limit}", param,
                  "context_length_exceeded")
    context = state.generator.target.max_seq_len
    if not max_tokens and len(ids) + 2 > context:
        raise bad(f"the {param} ({len(ids)} tokens) leave no room for an answer in the model's context of "
                  f"{context} tokens", param, "context_length_exceeded")
    if len(ids) + max_tokens + 1 > context:
        raise bad(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) must be below the model's context of "
                  f"{context} tokens (one slot stays spare)", param, "context_length_exceeded")


def parse_common(req: CommonRequest, state: ServerState, max_tokens_names: tuple[str, ...]) -> dict:
    """The parameters both endpoints share (max_tokens 0: not given)."""
    cap, max_tokens = state.config.max_tokens, 0
    given = {name: getattr(req, name) for name in max_tokens_names if getattr(req, name) is not None}
    if len(set(given.values())) > 1:
        raise bad(f"{' and '.join(given)} differ ({', '.join(map(str, given.values()))}): send one", next(iter(given)))
    for name, value in given.items():
        if value > cap:
            raise bad(f"{name} must be <= {cap} (this server's --max-tokens), got {value}", name)
        max_tokens = value
    prediction = prediction_ids(req.prediction, state)
    n = req.n or 1
    if n > state.config.max_batch + state.config.max_waiting:
        raise bad(f"n must be <= {state.config.max_batch + state.config.max_waiting} (this server's --max-batch + "
                  f"--max-waiting: each choice takes a batch slot), got {n}", "n")
    try:
        sampling = SamplingParams(1.0 if req.temperature is None else req.temperature, req.top_k or 0,
                                  1.0 if req.top_p is None else req.top_p, seed_of(req.seed))
    except SpecdecError as e:
        raise bad(str(e)) from None
    stop = () if req.stop is None else ((req.stop,) if isinstance(req.stop, str) else tuple(req.stop))
    return {"max_tokens": max_tokens, "sampling": sampling, "stream": bool(req.stream), "stop": stop,
            "spec": speculation(req.speculative, state), "include_usage": include_usage(req),
            "prediction": prediction, "n": n}


def prompt_list(value: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """A completion's prompts: a string or a list of token ids is one prompt, a list of those several."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        return list(value)
    return [value]


def prompt_ids(value: str | list[int], state: ServerState, where: str = "prompt") -> list[int]:
    """One completion prompt's token ids (`where`: how errors name it)."""
    if isinstance(value, str):
        ids = state.generator.tokenizer.encode(value, False) if value else []
    else:
        ids = list(value)
    if not ids:
        raise bad(f"{where} must not be empty", "prompt")
    vocab = state.generator.target.vocab_size
    if not isinstance(value, str) and not all(0 <= t < vocab for t in ids):
        raise bad(f"{where} token ids must be in [0, {vocab})", "prompt")
    return ids


def parse_completion(req: CompletionRequest, state: ServerState) -> Parsed:
    check_model(req.model, state)
    common = parse_common(req, state, ("max_tokens",))
    common["max_tokens"] = common["max_tokens"] or min(16, state.config.max_tokens)
    values = prompt_list(req.prompt)
    slots = state.config.max_batch + state.config.max_waiting
    if len(values) * common["n"] > slots:
        raise bad(f"{len(values)} prompts x n={common['n']} choices must be <= {slots} (this server's --max-batch + "
                  "--max-waiting: each choice takes a batch slot)", "prompt")
    prompts = []
    for i, value in enumerate(values):
        where = "prompt" if len(values) == 1 else f"prompt[{i}]"
        prompts.append(prompt_ids(value, state, where))
        check_prompt_length(prompts[-1], common["max_tokens"], state, "prompt")
    echoes = [v if isinstance(v, str) else state.generator.tokenizer.decode(ids)
              for v, ids in zip(values, prompts)] if req.echo else []
    return Parsed(prompts, **common, logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
                  echoes=echoes)


def parse_chat(req: ChatCompletionRequest, state: ServerState) -> Parsed:
    check_model(req.model, state)
    if req.top_logprobs and not req.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    common = parse_common(req, state, ("max_tokens", "max_completion_tokens"))
    tok = state.generator.tokenizer
    if not tok.has_chat_template:
        raise bad(f"the model {state.model_name} has no chat template; use /v1/completions", "messages")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": content_text(m.content)}
                | ({"name": m.name} if m.name is not None else {}) for m in req.messages]
    ids = tok.encode_chat(messages)
    check_prompt_length(ids, common["max_tokens"], state, "messages")
    if not common["max_tokens"]:            # default: as much as the limits allow (at least 1: checked above)
        common["max_tokens"] = min(state.config.max_tokens, state.generator.target.max_seq_len - len(ids) - 1)
    return Parsed([ids], **common, logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs or 0)


def validation_error(e: RequestValidationError, state: ServerState) -> ApiError:
    """A body that fails its schema: a 404 if it names another model, else a 400 naming the first bad field."""
    try:
        if isinstance(e.body, dict):
            check_model(e.body.get("model"), state)
    except ApiError as unknown_model:
        return unknown_model
    errors = e.errors()
    extra = sorted(str(err["loc"][1]) for err in errors if err["type"] == "extra_forbidden" and len(err["loc"]) == 2)
    if len(extra) > 1:
        return bad(f"unsupported fields: {', '.join(extra)}", extra[0], "unsupported_parameter")
    message, param, code = describe(errors[0])
    return bad(message, param, code)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is a 413 (from Content-Length, or while it streams in)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            too_long = f"request body of {int(length)} bytes exceeds the limit of {self.limit} bytes"
        else:
            too_long = f"request body exceeds the limit of {self.limit} bytes"
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit or (length.isdigit() and int(length) > self.limit):
                    # the rest of the body is not read: the connection closes after the 413, so that its bytes
                    # are not parsed as another request
                    raise StarletteHTTPException(413, too_long, headers={"Connection": "close"})
            return message

        await self.app(scope, limited, send)


SHARED_TENANT = "shared"               # the one tenant of a server without API keys


def tenant_of(key: str) -> str:
    """The tenant of an API key: a hash of it (the key itself is kept nowhere else)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def authorize(keys: tuple[str, ...]) -> Callable[[HttpRequest], str]:
    """A route dependency giving the caller's tenant: with API keys, /v1/* needs Authorization: Bearer <one of
    them> (else 401) and each key is a tenant of its own; without, every caller is the shared tenant."""
    def check(request: HttpRequest) -> str:
        if not keys:
            return SHARED_TENANT
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        # every key compared (in constant time each): the time taken says nothing of which one matched
        matched = [k for k in keys if hmac.compare_digest(given, k.encode())]
        if scheme.lower() != "bearer" or not matched:
            raise ApiError(401, "Incorrect or missing API key: send Authorization: Bearer <key>", None,
                           "invalid_api_key")
        return tenant_of(matched[0])
    return check


# ---- responses -----------------------------------------------------------------------------
class LogprobsView:
    """The completion tokens' log-probabilities as OpenAI writes them: chat completions' `content` entries (token,
    logprob, bytes, top_logprobs), or completions' lists (tokens, token_logprobs, top_logprobs: the alternatives
    and the token itself by text, text_offset: where each token's text starts in the text, counted on across a
    stream's chunks). A token that is not whole UTF-8 by itself (a piece of a character) is written
    `bytes:\\xe6\\x97` as OpenAI does, so pieces stay apart. JSON null where the request did not ask."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, asked: bool) -> None:
        self.tokenizer, self.chat, self.asked = tokenizer, chat, asked
        self.offset = 0                                          # completions: characters before the next token
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")  # ... counted as the text decodes them

    def text(self, token: int) -> str:
        return token_text(self.tokenizer.token_bytes(token))

    def echoing(self, text: str, prompt: Sequence[int]) -> "LogprobsView":
        """Offsets counted in the echoed prompt `text`: tokens its encoding put before it that it does not spell
        (a BOS the encoder adds) stand at 0 and take no room."""
        if not text or not self.asked or self.chat:
            return self
        spelled = b"".join(self.tokenizer.token_bytes(t) for t in prompt).decode("utf-8", "replace")
        if spelled != text and spelled.endswith(text):
            self.offset = len(text) - len(spelled)
        return self

    def _entry(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": list(self.tokenizer.token_bytes(token))}

    def render(self, logprobs: Sequence[TokenLogprob], echo: Sequence[int] = (),
               echo_logprobs: Sequence[TokenLogprob] = ()) -> dict | None:
        """The entries of `logprobs`; completions with echo: first those of the prompt `echo` (its first token has
        none: null), `echo_logprobs` being the prompt's others'."""
        if not self.asked:
            return None
        if self.chat:
            return {"content": [self._entry(lp.token, lp.logprob)
                                | {"top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in logprobs],
                    "refusal": None}
        scored = [*echo_logprobs, *logprobs]
        first = list(echo[:1])                                       # the prompt's first token: no log-probability
        ids = first + [lp.token for lp in scored]
        values: list[float | None] = [None] * len(first) + [lp.logprob for lp in scored]
        tops: list[dict | None] = [None] * len(first)
        tops += [{self.text(t): v for t, v in lp.top} | {self.text(lp.token): lp.logprob} for lp in scored]
        offsets = []
        for token in ids:                    # a piece of a character starts where that character will stand
            offsets.append(max(self.offset, 0))
            self.offset += len(self.decoder.decode(self.tokenizer.token_bytes(token)))
        return {"tokens": [self.text(t) for t in ids], "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}


class Responder:
    """OpenAI response objects for one choice of a request (a completion or a chat completion); the choices of one
    request share its id (`Responder.of`)."""

    def __init__(self, chat: bool, model: str, include_usage: bool, logprobs: LogprobsView,
                 echo: str = "", prompt: Sequence[int] = (), index: int = 0, n: int = 1) -> None:
        """echo: a completion's prompt text to put before its text (echo: true), `prompt` its token ids; index:
        the choice's (prompt i's choice j is i * n + j)."""
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.logprobs, self.echo, self.prompt, self.index, self.n = logprobs, echo, prompt, index, n
        self.echoed = not echo                       # a stream: the prompt's text went out (or there is none)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    @staticmethod
    def of(chat: bool, model: str, include_usage: bool, tokenizer: Tokenizer, parsed: Parsed) -> list["Responder"]:
        """The responders of a request's choices (n per prompt), under one id."""
        n = parsed.n
        echoes = parsed.echoes or [""] * len(parsed.prompts)
        outs = [Responder(chat, model, include_usage,
                          LogprobsView(tokenizer, chat, parsed.logprobs).echoing(echoes[k // n], parsed.prompts[k // n]),
                          echoes[k // n], parsed.prompts[k // n], k, n)
                for k in range(len(parsed.prompts) * n)]
        for out in outs[1:]:
            out.id, out.created = outs[0].id, outs[0].created
        return outs

    @staticmethod
    def usage(dones: Sequence[Done], n: int) -> dict:
        """A request's usage: each prompt once (its n choices share it), the completion tokens of all choices."""
        prompt, completion = sum(d.prompt_tokens for d in dones[::n]), sum(d.completion_tokens for d in dones)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "completion_tokens_details": {
                    key: sum(d.speculative[key] for d in dones)
                    for key in ("accepted_prediction_tokens", "rejected_prediction_tokens")}}

    def _obj(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def choice(self, done: Done) -> dict:
        """This choice in a response that does not stream."""
        if self.chat:
            return {"index": self.index, "message": {"role": "assistant", "content": done.text},
                    "logprobs": self.logprobs.render(done.logprobs), "finish_reason": done.finish_reason}
        shown = self.logprobs.render(done.logprobs, self.prompt if self.echo else (), done.prompt_logprobs)
        return {"index": self.index, "text": self.echo + done.text, "logprobs": shown,
                "finish_reason": done.finish_reason}

    @staticmethod
    def full(outs: Sequence["Responder"], dones: Sequence[Done]) -> dict:
        """The response of a request whose choices are `dones` (in choice order): `speculative` is the first
        choice's report; with n > 1 every choice carries its own too."""
        choices = [out.choice(d) | ({"speculative": d.speculative} if len(dones) > 1 else {})
                   for out, d in zip(outs, dones)]
        kind = "chat.completion" if outs[0].chat else "text_completion"
        return outs[0]._obj(kind, choices) | {"usage": Responder.usage(dones, outs[0].n),
                                              "speculative": dones[0].speculative}

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False,
              logprobs: Sequence[TokenLogprob] = (), prompt_logprobs: Sequence[TokenLogprob] = ()) -> dict:
        """A stream's chunk: text (None: no delta), the log-probabilities of its tokens where asked (JSON null in
        the role's and the finishing chunk); a completion's first one puts the echoed prompt first."""
        shown = None
        if text is not None and not role:
            echo = () if self.echoed else self.prompt
            shown = self.logprobs.render(logprobs, echo, prompt_logprobs if echo else ())
            if not self.echoed:
                text, self.echoed = self.echo + text, True
        if self.chat:
            delta = {} if text is None else ({"role": "assistant", "content": text} if role else {"content": text})
            choice = {"index": self.index, "delta": delta, "logprobs": shown, "finish_reason": finish_reason}
            obj = self._obj("chat.completion.chunk", [choice])
        else:
            obj = self._obj("text_completion", [{"index": self.index, "text": text or "", "logprobs": shown,
                                                 "finish_reason": finish_reason}])
        return obj | {"usage": None} if self.include_usage else obj

    def head(self) -> list[dict]:
        return [self.chunk("", None, role=True)] if self.chat else []

    def finish(self, done: Done) -> list[dict]:
        """The chunks that end this choice's stream: its echo if nothing streamed yet, then its finish_reason with
        its `speculative` report."""
        echo = [] if self.echoed else [self.chunk("", None, prompt_logprobs=done.prompt_logprobs)]
        return [*echo, self.chunk(None, done.finish_reason) | {"speculative": done.speculative}]

    def usage_chunk(self, dones: Sequence[Done]) -> list[dict]:
        """With include_usage: the last chunk, no choices and the request's usage."""
        if not self.include_usage:
            return []
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return [self._obj(kind, []) | {"usage": self.usage(dones, self.n)}]


def sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


# ---- the app -------------------------------------------------------------------------------
def endpoint_label(request: HttpRequest) -> str:
    path = request.url.path
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return path if path in ENDPOINTS else "other"


class Watch:
    """A request's client, checked for a disconnect at most every POLL_SECONDS while its job's events are
    awaited, however often they come (a running request's tokens come faster than that)."""

    def __init__(self, request: HttpRequest) -> None:
        self.request, self.checked = request, time.monotonic()

    async def next_event(self, job: "Job | Choices", within: float = math.inf) -> Event:
        """The job's (or choices') next event; ClientGone once the client has gone away, StillWaiting after
        `within` seconds without one."""
        end = time.monotonic() + within
        while True:
            if time.monotonic() - self.checked >= POLL_SECONDS:
                self.checked = time.monotonic()
                if await self.request.is_disconnected():
                    raise ClientGone()
            left = end - time.monotonic()
            if left <= 0:
                raise StillWaiting()
            try:
                return await asyncio.wait_for(job.events.get(), min(POLL_SECONDS, left))
            except asyncio.TimeoutError:
                continue


class Routes:
    """What the routes of one app share: its state, request counting, error responses, and running a
    parsed request through the scheduler (answered as JSON or an SSE stream)."""

    def __init__(self, state: ServerState) -> None:
        self.state, self.metrics = state, state.metrics

    def count(self, request: HttpRequest, status: int) -> None:
        self.metrics.requests.labels(endpoint_label(request), str(status)).inc()

    def error_response(self, request: HttpRequest, status: int, message: str, param: str | None = None,
                       code: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
        self.count(request, status)
        log_refusal(request, status, message)
        headers = dict(headers or {}) | ({"WWW-Authenticate": "Bearer"} if status == 401 else
                                         {"Retry-After": "1"} if status == 429 else {})
        return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)

    def user_input(self, parse: Callable[[Any, ServerState], Parsed], body: CommonRequest) -> Parsed:
        """Check a validated body against this server; the library's own input errors (e.g. from the
        tokenizer) become 400s."""
        try:
            return parse(body, self.state)
        except SpecdecError as e:
            raise bad(str(e)) from None

    async def parsed(self, parse: Callable[[Any, ServerState], Parsed], body: CommonRequest) -> Parsed:
        """`user_input` in a worker thread: tokenizing a long prompt (the tokenizer releases the GIL) does not
        hold up the event loop, which sends the running streams' tokens."""
        return await asyncio.to_thread(self.user_input, parse, body)

    def model_card(self) -> dict:
        return {"id": self.state.model_name, "object": "model", "created": self.state.created, "owned_by": "specdec"}

    async def run(self, request: HttpRequest, parsed: Parsed, chat: bool, tenant: str) -> Response:
        """Submit the request's choices to the scheduler; answer with JSON or an SSE stream. `tenant`: the
        caller's (authorize)."""
        scheduler = self.state.scheduler
        total = len(parsed.prompts) * parsed.n
        requests = [Request(parsed.prompts[k // parsed.n], parsed.max_tokens, sampling, parsed.stop,
                            prediction=parsed.prediction, tenant=tenant, logprobs=parsed.logprobs,
                            top_logprobs=parsed.top_logprobs, prompt_logprobs=parsed.logprobs and bool(parsed.echoes))
                    for k, sampling in enumerate(choice_sampling(parsed.sampling, total))]
        choices = Choices(Job.choices(requests, parsed.spec))
        try:
            for job in choices.jobs:
                scheduler.submit(job)
                choices.submitted += 1
        except QueueFull as e:
            choices.cancel(scheduler)
            raise ApiError(429, str(e), None, "rate_limit_exceeded") from None
        except Closed as e:
            choices.cancel(scheduler)
            raise ApiError(503, str(e), None, "server_shutting_down") from None
        outs = Responder.of(chat, self.state.model_name, parsed.include_usage, self.state.generator.tokenizer, parsed)
        watch = Watch(request)
        dones: dict[int, Done] = {}
        try:
            try:               # a stream's failure before its first event is an HTTP status, unless it is queued
                event = await watch.next_event(choices, STREAM_START_SECONDS if parsed.stream else math.inf)
            except StillWaiting:
                return self.streaming(request, choices, (), outs)     # headers now; a later failure is an error event
            if parsed.stream and not isinstance(event, Failed):
                return self.streaming(request, choices, (event,), outs)
            while True:
                if isinstance(event, Failed):
                    choices.cancel(scheduler)                          # the other choices stop too
                    raise ApiError(event.status, event.message, None, event.code)
                if isinstance(event, Done):
                    dones[event.choice] = event
                    if len(dones) == len(choices.jobs):
                        break
                event = await watch.next_event(choices)
        except ClientGone:
            choices.cancel(scheduler)
            log_refusal(request, 499, "the client closed the connection: request cancelled")
            self.count(request, 499)
            return Response(status_code=499)
        except asyncio.CancelledError:
            choices.cancel(scheduler)
            raise
        self.count(request, 200)
        return JSONResponse(Responder.full(outs, [dones[i] for i in range(len(outs))]))

    def streaming(self, request: HttpRequest, choices: "Choices", received: tuple[Event, ...],
                  outs: list[Responder]) -> Response:
        return StreamingResponse(self.stream(request, choices, received, outs), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @staticmethod
    async def next_or_keep_alive(choices: "Choices") -> Event | KeepAlive:
        """The choices' next event, or KeepAlive after KEEP_ALIVE_SECONDS without one."""
        try:
            return await asyncio.wait_for(choices.events.get(), KEEP_ALIVE_SECONDS)
        except asyncio.TimeoutError:
            return KeepAlive()

    async def stream(self, request: HttpRequest, choices: "Choices", received: tuple[Event, ...],
                     outs: list[Responder]) -> AsyncIterator[str]:
        """The SSE stream of a request's choices, starting with the events already `received` (none for a queued
        request); it ends once every choice is done."""
        status = 499                                 # unless the stream completes: the client went away
        dones: dict[int, Done] = {}
        try:
            for out in outs:
                for obj in out.head():
                    yield sse(obj)
            event = received[0] if received else await self.next_or_keep_alive(choices)
            while True:
                if isinstance(event, KeepAlive):
                    yield ": keep-alive\n\n"
                elif isinstance(event, TextPiece):
                    yield sse(outs[event.choice].chunk(event.text, None, logprobs=event.logprobs,
                                                       prompt_logprobs=event.prompt_logprobs))
                elif isinstance(event, Done):
                    for obj in outs[event.choice].finish(event):
                        yield sse(obj)
                    dones[event.choice] = event
                    if len(dones) == len(outs):
                        for obj in outs[0].usage_chunk([dones[i] for i in range(len(outs))]):
                            yield sse(obj)
                        status = 200
                        yield sse("[DONE]")
                        return
                else:
                    status = event.status
                    log_refusal(request, status, event.message, "(in the stream)")
                    yield sse(error_body(event.status, event.message, None, event.code))
                    return
                event = await self.next_or_keep_alive(choices)
        finally:
            if status != 200:
                choices.cancel(self.state.scheduler)            # the client went away, or one choice failed
            if status == 499:
                log_refusal(request, 499, "the client closed the connection: stream cancelled")
            self.count(request, status)


@dataclass
class Choices:
    """The jobs of one request's n choices (OpenAI's n), sharing one event queue."""
    jobs: list[Job]
    submitted: int = 0                       # of them, how many the scheduler took

    @property
    def events(self) -> asyncio.Queue:
        return self.jobs[0].events

    def cancel(self, scheduler: Scheduler) -> None:
        """Stop every submitted choice (finished ones stay as they are)."""
        for job in self.jobs[:self.submitted]:
            scheduler.cancel(job)


def choice_sampling(sampling: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of a request's n choices (all prompts' together): one choice keeps the request's seed,
    choice i of several samples with derive_seed(seed, i) (as `generate` samples prompt i of a list), so they
    differ."""
    if n == 1:
        return [sampling]
    return [replace(sampling, seed=derive_seed(sampling.seed, i)) for i in range(n)]


def log_refusal(request: HttpRequest, status: int, message: str, where: str = "") -> None:
    """One log line per refused request (info: a client's mistake; warning: the server's own trouble); a client's
    text may hold lone surrogates, which no log stream can encode: escaped."""
    line = f"{request.method} {request.url.path} -> {status}{' ' + where if where else ''} {message[:300]}"
    log.log(logging.INFO if status < 500 else logging.WARNING, "%s",
            line.encode("utf-8", "backslashreplace").decode("utf-8"))


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app serving `state`; its lifespan starts and stops the scheduler's worker.

    Run under uvicorn as it is, the worker loop gets a thread of its own; for speed, run the loop in the
    thread that loaded the model and uvicorn in another, as `specdec serve` does (cli_serve.run_server;
    why: server/scheduler.py)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.scheduler.start()
        try:
            yield
        finally:
            state.scheduler.stop()

    app = FastAPI(title="specdec", summary="OpenAI-compatible completions with lossless speculative decoding",
                  lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.add_middleware(BodyLimit, limit=state.config.max_body_bytes)
    if state.config.cors_origins:                # outermost: a preflight is answered before anything else
        app.add_middleware(CORSMiddleware, allow_origins=list(state.config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    routes = Routes(state)
    add_error_handlers(app, routes)
    add_routes(app, routes)
    return app


def add_error_handlers(app: FastAPI, routes: Routes) -> None:
    """Every error answers with OpenAI's error JSON (and is counted)."""

    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, e: ApiError) -> JSONResponse:
        return routes.error_response(request, e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HttpRequest, e: RequestValidationError) -> JSONResponse:
        err = validation_error(e, routes.state)
        return routes.error_response(request, err.status, err.message, err.param, err.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        detail = str(e.detail)
        if e.status_code == 404 and detail == "Not Found":                                   # Starlette's words
            detail = f"no such route: {request.method} {request.url.path} (see /docs)"
        if e.status_code == 405 and detail == "Method Not Allowed":
            allowed = (e.headers or {}).get("Allow")
            detail = f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
        if e.status_code == 400 and detail == "There was an error parsing the body":      # FastAPI's words
            detail = ("the request body could not be parsed: send one JSON object as UTF-8 text, uncompressed "
                      "(no Content-Encoding), nested less than 1000 levels deep")
        return routes.error_response(request, e.status_code, detail, None, code, e.headers)    # 405: Allow

    @app.exception_handler(Exception)
    async def internal_error(request: HttpRequest, e: Exception) -> JSONResponse:
        return routes.error_response(request, 500, f"internal error: {type(e).__name__}: {e}")


def add_routes(app: FastAPI, routes: Routes) -> None:
    """/health, /metrics, /v1/models, /v1/completions, /v1/chat/completions."""
    state = routes.state

    @app.head("/health", include_in_schema=False)          # monitors that probe with HEAD
    @app.get("/health")
    async def health(request: HttpRequest) -> Response:
        if not state.scheduler.alive:
            return routes.error_response(request, 503, "the generation worker is not running")
        routes.count(request, 200)
        return JSONResponse({"status": "ok", "model": state.model_name, "runtime": state.runtime})

    @app.get("/metrics")
    async def prometheus(request: HttpRequest) -> Response:
        routes.count(request, 200)
        return Response(generate_latest(routes.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    authorized = authorize(state.config.api_keys)
    auth = [Depends(authorized)]

    @app.get("/v1/models", dependencies=auth)
    async def models(request: HttpRequest) -> dict:
        routes.count(request, 200)
        return {"object": "list", "data": [routes.model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=auth)
    async def model(request: HttpRequest, model: str) -> dict:
        if not model:
            raise ApiError(404, "GET /v1/models/ names no model (GET /v1/models lists them)", None, "not_found")
        check_model(model, state)
        routes.count(request, 200)
        return routes.model_card()

    @app.post("/v1/completions")
    async def completions(request: HttpRequest, body: CompletionRequest, tenant: str = Depends(authorized)) -> Response:
        return await routes.run(request, await routes.parsed(parse_completion, body), False, tenant)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest, body: ChatCompletionRequest,
                               tenant: str = Depends(authorized)) -> Response:
        return await routes.run(request, await routes.parsed(parse_chat, body), True, tenant)
