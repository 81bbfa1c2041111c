"""The request bodies of /v1/completions and /v1/chat/completions as pydantic models, and their
validation errors as one-line messages.

FastAPI validates every body with these models (strictly: no type coercion, unknown fields refused)
and publishes them as the OpenAPI schema (/docs). Fields OpenAI defines that the server does not
implement are accepted only with their neutral values (what the `openai` client may send); `null`
means "absent" for every field. What depends on the server (its model, limits, drafts, tokenizer) is
checked after validation, in app.py.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Callable, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, GetPydanticSchema, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from ..api import METHODS
from ..logprobs import MAX_TOP_LOGPROBS
from ..names import AUTO_METHOD

MAX_STOP = 4
MAX_CHOICES = 128                           # OpenAI's bound on n (a server's --max-batch + --max-waiting may be lower)
ROLES = ("system", "user", "assistant", "developer")
UNSUPPORTED = "unsupported_parameter"       # the error type (and OpenAI error code) of a neutral-only field
SURROGATE = "lone_surrogate"                # the error type of a string that is not valid Unicode


def one_of(expected: str) -> GetPydanticSchema:
    """A union's error: one line saying what is expected, instead of one error per member type."""
    def schema(source: Any, handler: Callable[[Any], dict]) -> dict:
        core = handler(source)
        core["custom_error_type"] = "union_type"
        core["custom_error_message"] = expected
        return core
    return GetPydanticSchema(schema)


def neutral(*allowed: Any) -> AfterValidator:
    """A field the server does not implement: only its neutral values (or null; none given: null alone) are
    accepted."""
    def check(value: Any, info: ValidationInfo) -> Any:
        if not any(type(value) is type(a) and value == a for a in allowed):
            values = "".join(f"{json.dumps(a)} or " for a in allowed)
            raise PydanticCustomError(UNSUPPORTED, "{field}={value} is not supported (only {allowed}null)",
                                      {"field": info.field_name, "value": shown(value), "allowed": values})
        return value
    return AfterValidator(check)


NullOnly = Annotated[Any, neutral()] | None         # an OpenAI field with no neutral value but null


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(Body):
    type: Literal["text"]
    text: str


Content = Annotated[str | list[TextPart], one_of("a string or a list of text parts")]
NonEmpty = Annotated[str, Field(min_length=1)]
Stop = Annotated[NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP)],
                 one_of(f"a non-empty string or a list of up to {MAX_STOP} non-empty strings")]
Prompt = Annotated[str | list[int] | list[str] | list[list[int]],
                   one_of("a non-empty string or a non-empty list of token ids")]


class Prediction(Body):
    """OpenAI's predicted output: text the answer is expected to resemble (it drafts; the output stays exact)."""
    type: Literal["content"]
    content: Content


class StreamOptions(Body):
    include_usage: bool | None = None
    include_obfuscation: Annotated[bool, neutral(False)] | None = None


class Speculative(Body):
    """The extension choosing this request's speculation (absent: the server's default)."""
    method: Literal[(AUTO_METHOD, *METHODS)] | None = None
    num_draft_tokens: int | None = Field(None, ge=1, description="draft length K (at most the server's bound)")


class Message(Body):
    role: Literal[ROLES]
    content: Content
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$",
                               description="the participant's name, given to the chat template "
                                           "(which may ignore it)")] | None = None
    # what a client sends back when it appends a response's message to the history (`message.model_dump()`)
    refusal: Annotated[str, neutral("")] | None = None
    tool_calls: Annotated[list[Any], neutral([])] | None = None
    annotations: Annotated[list[Any], neutral([])] | None = None
    function_call: NullOnly = None
    audio: NullOnly = None


def surrogate_paths(value: Any) -> list[str]:
    """The paths of the strings in a JSON value (keys included) that hold a lone surrogate (U+D800-U+DFFF):
    valid JSON (\\ud800), but not Unicode, so no tokenizer or UTF-8 encoder takes them. Walked with a stack
    of its own, so a deeply nested body costs no recursion."""
    found, todo = [], [(value, "")]
    while todo:
        item, path = todo.pop()
        if isinstance(item, str):
            if any("\ud800" <= c <= "\udfff" for c in item):
                found.append(path or "body")
        elif isinstance(item, dict):
            for k, v in reversed(list(item.items())):
                todo.append((v, f"{path}.{k}" if path else str(k)))
                todo.append((k, path or "body"))
        elif isinstance(item, list):
            todo.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))
    return found


class CommonRequest(Body):
    """The fields both endpoints share."""

    @model_validator(mode="before")
    @classmethod
    def valid_unicode(cls, data: Any) -> Any:
        bad = surrogate_paths(data)
        if bad:
            raise PydanticCustomError(SURROGATE, "{path} holds a lone surrogate (\\ud800-\\udfff): not valid Unicode",
                                      {"path": bad[0].encode("utf-8", "backslashreplace").decode()})
        return data
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1 << 20, description="extension: sample from the k most likely (0: all)")
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="choices, each sampled with a seed of its own")
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: Stop | None = None
    user: str | None = None
    presence_penalty: Annotated[float, neutral(0.0)] | None = None
    frequency_penalty: Annotated[float, neutral(0.0)] | None = None
    logit_bias: Annotated[dict[str, float], neutral({})] | None = None
    prediction: Prediction | None = None
    speculative: Speculative | None = None


class CompletionRequest(CommonRequest):
    """POST /v1/completions."""
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "the log-probability of each completion token and of the N most likely tokens at its position"))
    echo: bool | None = Field(None, description="put the prompt before the completion (with logprobs: its tokens' too)")
    best_of: Annotated[int, neutral(1)] | None = None
    suffix: Annotated[str, neutral("")] | None = None


class ChatCompletionRequest(CommonRequest):
    """POST /v1/chat/completions."""
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, description="the log-probability of each completion token")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "with logprobs: the N most likely tokens at each position too"))
    response_format: Annotated[dict[str, Any], neutral({"type": "text"})] | None = None
    tools: Annotated[list[Any], neutral([])] | None = None
    tool_choice: Annotated[str | dict[str, Any], neutral("none")] | None = None
    store: Annotated[bool, neutral(False)] | None = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[Any], neutral([])] | None = None
    function_call: Annotated[str | dict[str, Any], neutral("none")] | None = None
    modalities: Annotated[list[str], neutral(["text"])] | None = None
    service_tier: Annotated[str, neutral("auto", "default")] | None = None
    metadata: dict[str, str] | None = Field(None, description="kept by OpenAI with stored completions; unused here")
    prompt_cache_key: str | None = Field(None, description="a cache hint; the server's prefix cache needs none")
    safety_identifier: str | None = None
    audio: NullOnly = None
    reasoning_effort: NullOnly = None
    verbosity: NullOnly = None
    web_search_options: NullOnly = None


# ---- validation errors as one line ----------------------------------------------------------
EXPECTED = {"float_type": "a number", "int_type": "an integer", "bool_type": "true or false",
            "string_type": "a string", "list_type": "a list", "dict_type": "an object", "model_type": "an object",
            "model_attributes_type": "an object", "string_too_short": "a non-empty string",
            "string_pattern_mismatch": "1-64 letters, digits, _ or -", "finite_number": "a finite number"}
BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
BOUND_KEYS = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}


def shown(value: Any, limit: int = 60) -> str:
    """A value as JSON, cut to `limit` characters (an error message stays one short line)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
        text.encode("utf-8")
    except UnicodeEncodeError:                                  # a lone surrogate: escaped as JSON writes it
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def field_path(loc: tuple) -> str:
    """("messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe(error: dict) -> tuple[str, str | None, str | None]:
    """One pydantic error of a request body (loc starting with "body") -> (message, param, code)."""
    loc = tuple(error["loc"])[1:] if tuple(error["loc"])[:1] == ("body",) else tuple(error["loc"])
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind == SURROGATE:                                  # its path names the field: messages[0].content -> messages
        field = re.match(r"[A-Za-z_]+", ctx.get("path", ""))
        return error["msg"], field.group(0) if field and ctx["path"] != "body" else None, None
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {ctx.get('error', error['msg'])}", None, None
    if not loc or not isinstance(loc[0], str):
        return "the request body must be a JSON object (Content-Type: application/json)", None, None
    path, param = field_path(loc), loc[0]
    if kind == "extra_forbidden":
        return (f"unsupported field: {path}" if len(loc) == 1 else f"{path} is not supported"), param, UNSUPPORTED
    if kind == "missing":
        return f"{path} is required", param, None
    if kind == UNSUPPORTED:                                # "tool_calls=..." -> "messages[1].tool_calls=..."
        return path + error["msg"][len(str(loc[-1])):], param, UNSUPPORTED
    if kind == "union_type" or kind in EXPECTED:
        expected = error["msg"] if kind == "union_type" else EXPECTED[kind]
        return f"{path} must be {expected}, got {shown(value)}", param, None
    if kind in BOUNDS:
        return f"{path} must be {BOUNDS[kind]} {ctx[BOUND_KEYS[kind]]}, got {shown(value)}", param, None
    if kind == "literal_error":
        return f"{path} must be one of {ctx['expected']}, got {shown(value)}", param, None
    if kind == "too_short":
        return f"{path} must not be empty", param, None
    if kind == "too_long":
        return f"{path} has {ctx['actual_length']} items, more than {ctx['max_length']}", param, None
    return f"{path}: {error['msg']}", param, None
