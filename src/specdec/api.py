"""Public API: `load()` a target with a speculative method, then `generate` / `stream`."""
from __future__ import annotations

import gc
import logging
import math
import numbers
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Literal, Sequence as Seq

import torch

from .draft_length import MAX_DRAFT_TOKENS, POLICIES, make_policy
from .engine import Engine, Request, scratch_slots
from .logprobs import TokenLogprob, check_top_logprobs
from .metrics import Counters
from . import names
from .errors import SpecdecError
from .models.base import CausalLM
from .models.gguf_loader import check_gguf, load_gguf
from .models.registry import DEFAULT_MODEL, MODELS, resolve
from .models.tokenizer import Tokenizer
from .prefix_cache import PrefixCache
from .proposers.base import NoProposer, Proposer
from .proposers.draft_model import DraftModelProposer
from .proposers.ngram import NgramProposer
from .proposers.suffix import SuffixProposer
from .sampling import SamplingParams, as_integer, cut, derive_seed
from .tree import TreeShape

if TYPE_CHECKING:
    from .proposers.eagle import EagleProposer

WEIGHTS_DIR = Path(__file__).parent / "weights"
SHIPPED = {("smollm2-135m", "draft"): "draft-smollm2-135m.safetensors",
           ("smollm2-135m", "eagle"): "eagle-smollm2-135m.safetensors",
           ("smollm2-135m", "eagle3"): "eagle3-smollm2-135m.safetensors",
           ("smollm2-135m", "exit"): "exit-smollm2-135m.safetensors",
           ("smollm2-135m", "medusa"): "medusa-smollm2-135m.safetensors"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = names.DTYPES             # auto: the fastest mode this machine computes exactly (see choose_dtype);
                                          # q4: the GGUF's 4-bit blocks through torch's int4 kernel
# the draft `--method draft` (and the benchmark) uses when none is given: our distilled one, where shipped
DEFAULT_DRAFT = {m: str(WEIGHTS_DIR / f) for (m, kind), f in SHIPPED.items()
                 if kind == "draft" and (WEIGHTS_DIR / f).is_file()}

Prompt = str | list[int]


def _one_prompt(prompt: object) -> bool:
    """Whether `prompt` is one prompt: text, or a non-empty list of token ids (integers of any kind; checked
    when encoded)."""
    return isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and bool(prompt)
                                       and isinstance(prompt[0], numbers.Integral))


@dataclass
class Result:
    text: str                       # the output, up to (not including) a stop string that ended it
    tokens: list[int]               # generated token ids, up to the EOS or the token completing the stop string that
                                    # ended the text (so they may spell more than `text`); metrics count these
    metrics: dict
    finish_reason: str              # "stop" (EOS or stop string), "length"; "cancelled": a stream closed early
    prompt_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)   # one per token of `tokens` where asked, else empty
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)   # the prompt's tokens after its first, if asked


def empty_result() -> Result:
    """A Result of nothing generated yet (a new object each time: Results are the caller's to change)."""
    return Result("", [], Counters().as_dict(), "", 0)


TURN_WAIT_SECONDS = 0.5        # a call waiting for another's turn collects garbage this often (a dropped stream)


def unicode_text(text: str, what: str) -> str:
    """`text`, refused where it holds a lone surrogate (undecodable bytes of a command line, "\\ud800" of JSON):
    no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SpecdecError(f"the {what} is not valid UTF-8 text (it holds undecodable bytes or a lone surrogate)") from None
    return text


def parse_dtype(dtype: str) -> str:
    """A dtype name as given (auto, float32, bfloat16), or a clear error."""
    if dtype not in DTYPE_CHOICES:
        raise SpecdecError(names.unknown("dtype", dtype, DTYPE_CHOICES))
    return dtype


def choose_dtype(dtype: str, device: torch.device) -> tuple[torch.dtype, bool]:
    """(torch dtype of the weights and activations, 4-bit kernels) for a requested mode name.

    `auto`: q4 on a CPU where torch's int4 kernel runs, else bfloat16 where the CPU computes it
    natively (AVX-512-BF16, AMX, AVX-NE-CONVERT), else float32 (and on CUDA, whose GEMMs are not
    row-invariant by any measurement here). q4 keeps bfloat16 activations where oneDNN has them,
    float32 elsewhere. An explicit mode this machine cannot compute is an error naming what is missing."""
    from .machine import bf16_unavailable_reason, probe

    m = probe()
    cpu = device.type == "cpu"
    if dtype == "q4":
        if not (cpu and m.int4_kernel):
            raise SpecdecError("dtype q4 needs torch's CPU int4 kernel (device cpu); use --dtype float32 (or auto)")
        return (torch.bfloat16 if m.native_bf16 else torch.float32), True
    if dtype == "auto":
        if cpu and m.int4_kernel:
            return choose_dtype("q4", device)
        return (torch.bfloat16 if cpu and m.native_bf16 else torch.float32), False
    if DTYPES[dtype] == torch.bfloat16 and cpu:
        why = bf16_unavailable_reason(m)
        if why:
            raise SpecdecError(f"dtype bfloat16 is not available: {why}; use --dtype float32 (or auto)")
    return DTYPES[dtype], False


def parse_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise SpecdecError(f"unknown device {device!r}; use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecdecError("device cuda requested but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise SpecdecError(f"unsupported device {device!r}; use cpu or cuda[:N]")
    return dev


def load_model(name_or_path: str, dtype: str = "auto", device: str = "cpu") -> tuple[CausalLM, Tokenizer, str]:
    """A lean decoder and its tokenizer from a registered name or a GGUF path, in `dtype` (auto, float32,
    bfloat16), its kernels checked for exactness on this machine (`model.self_check`).

    Where a narrow dtype chosen by `auto` fails the self-check, the model is loaded in float32 instead
    (a warning says so); an explicitly asked dtype that fails it loads with a warning that speculative
    output may differ from plain decoding in that dtype."""
    from .models.selfcheck import self_check

    dev = parse_device(device)
    dt, int4 = choose_dtype(parse_dtype(dtype), dev)
    name, path = resolve(name_or_path)
    check_gguf(Path(path))                                   # a wrong file: its error alone, before the note
    logging.getLogger("specdec").info("loading %s (%s) and checking its kernels ...", name,
                                      "q4" if int4 else str(dt).removeprefix("torch."))
    model = load_gguf(path, dt, dev, name=name, int4=int4)
    model.self_check = self_check(model)
    if not model.self_check.passed and (dt != torch.float32 or int4):
        if dtype == "auto":
            warnings.warn(f"{model.self_check.summary()}: loading float32 instead", stacklevel=2)
            model = load_gguf(path, torch.float32, dev, name=name)
            model.self_check = self_check(model)
    if not model.self_check.passed:
        warnings.warn(f"{model.self_check.summary()}: speculative output may differ from plain decoding "
                      "in the last bits on this machine", stacklevel=2)
    return model, Tokenizer.from_gguf(Path(path)), name


def kernel_labels(target: CausalLM) -> str:
    """What the target's layer linears and LM head run on, e.g. "layers: native 4-bit x 8-bit; LM head: ..."
    (each kernel's `label`)."""
    layers = sorted({k.label for layer in getattr(target, "layers", []) for k in getattr(layer, "packed", {}).values()})
    head = getattr(target, "packed", {}).get("lm_head")
    return f"layers: {', '.join(layers) or 'torch default'}; LM head: {head.label if head is not None else 'torch default'}"


def runtime_info(target: CausalLM) -> dict:
    """The machine, the target's dtype and kernels, and the self-check's result (for --json, /health, info)."""
    from .machine import probe

    from .models import native

    m = probe()
    check = getattr(target, "self_check", None)
    packed = bool(getattr(target, "packed", None))
    device = getattr(target, "device", torch.device("cpu"))
    return {"cpu": m.cpu, "torch_capability": m.torch_capability, "isa_limit": m.isa_limit or None,
            "dtype": getattr(target, "compute", str(getattr(target, "dtype", "")).removeprefix("torch.")),
            "kernels": kernel_labels(target) if packed else "torch default",
            "attention": native.describe(device),
            "layers": native.describe_loop(target),
            "self_check": check.as_dict() if check is not None else None}


class Generator:
    """A target model, a proposer and a draft-length policy, ready to generate. It runs one generation at a time
    (its proposer keeps per-generation state): calls from several threads take turns; for concurrent requests,
    batch them in one call or serve them (`specdec serve` batches across requests)."""

    def __init__(self, target: CausalLM, tokenizer: Tokenizer, proposer: Proposer,
                 policy_name: str = names.DEFAULT_POLICY, num_draft_tokens: int = 4, name: str = "model") -> None:
        make_policy(policy_name, num_draft_tokens)          # validate early
        self.target, self.tokenizer, self.proposer = target, tokenizer, proposer
        self.policy_name, self.num_draft_tokens, self.name = policy_name, int(num_draft_tokens), name
        self.method = proposer.name
        self._turn = threading.Lock()          # one generation at a time: the proposer's state is per generator
        self._running_in = 0                   # the thread id of the generation running (0: none)
        self._progress = 0.0                   # time.monotonic() of the running generation's last step
        # per thread: its last stream's or single-prompt generate's Result (a thread's entry goes with it; keyed by
        # the Thread object, not its id, which a new thread may reuse)
        self._last: weakref.WeakKeyDictionary[threading.Thread, Result] = weakref.WeakKeyDictionary()
        self._last_lock = threading.Lock()

    @property
    def last_result(self) -> Result:
        """This thread's last stream's or single-prompt generate's Result (a stream's so far while it runs;
        empty from the start of such a call that then raised); each thread sees its own calls' only, and a
        call with a list of prompts leaves it as it was."""
        with self._last_lock:
            found = self._last.get(threading.current_thread())
        return found if found is not None else empty_result()

    @last_result.setter
    def last_result(self, result: Result) -> None:
        self._keep_last(threading.current_thread(), result)

    def _keep_last(self, thread: threading.Thread, result: Result) -> None:
        """`result` as the last one of `thread` (kept while the thread object lives)."""
        with self._last_lock:
            self._last[thread] = result

    def __repr__(self) -> str:
        dtype = getattr(self.target, "compute", str(getattr(self.target, "dtype", "")).removeprefix("torch."))
        return (f"Generator({self.name!r}, method={self.method!r}, draft_policy={self.policy_name!r}, "
                f"num_draft_tokens={self.num_draft_tokens}, dtype={dtype!r})")

    # ---- input handling -------------------------------------------------------------
    @staticmethod
    def _prompts(prompt: Prompt | Seq[Prompt]) -> tuple[list[Prompt], bool]:
        """(the prompts, whether a single one was given): text or token ids is one prompt, a list of those a batch."""
        if _one_prompt(prompt):
            return [prompt], True
        if not isinstance(prompt, (list, tuple)):
            raise SpecdecError("prompt must be a string, a list of token ids, or a list of those; "
                               f"got {type(prompt).__name__}")
        if not prompt:
            raise SpecdecError("empty prompt list")
        for i, p in enumerate(prompt):
            if not _one_prompt(p) and not (isinstance(p, (list, tuple)) and not p):
                raise SpecdecError(f"prompt {i} of the list must be a string or a list of token ids; "
                                   f"got {type(p).__name__}")
        return list(prompt), False

    def _encode(self, prompt: Prompt, chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:                             # white space is text (the server takes it too)
                raise SpecdecError("empty prompt")
            ids = self.tokenizer.encode(unicode_text(prompt, "prompt"), chat)
            if not ids:
                raise SpecdecError("empty prompt: the text encodes to no tokens")
            return ids
        if not prompt:
            raise SpecdecError("empty prompt")
        refusal = f"token ids must be integers in [0, {self.target.vocab_size}) (not booleans)"
        ids = [as_integer(t, refusal) for t in prompt]
        if not all(0 <= t < self.target.vocab_size for t in ids):
            raise SpecdecError(refusal)
        return ids

    def prediction_ids(self, prediction: str) -> tuple[int, ...]:
        """The token ids of a predicted output (checked: a string that fits the context)."""
        if not isinstance(prediction, str):
            raise SpecdecError(f"prediction must be a string (the expected output), got {type(prediction).__name__}")
        unicode_text(prediction, "prediction")
        ids = tuple(self.tokenizer.encode_text(prediction)) if prediction else ()
        if len(ids) > self.target.max_seq_len:
            raise SpecdecError(f"prediction of {len(ids)} tokens is longer than the context "
                               f"({self.target.max_seq_len} tokens)")
        return ids

    @staticmethod
    def _predictions(prediction: str | Seq[str], n: int, single: bool) -> list[str]:
        """One prediction per prompt ("" = none): a string for a single prompt; for a list of prompts a list of
        strings, one per prompt (or "" for none)."""
        if single or isinstance(prediction, str):
            if not isinstance(prediction, str):
                raise SpecdecError("prediction must be a string, the expected output (for a list of prompts: a list "
                                   f"of strings, one per prompt), got {type(prediction).__name__}")
            if prediction and not single:
                raise SpecdecError("one prediction for a list of prompts: give a list of strings, one per prompt")
            return [prediction] * n
        if not isinstance(prediction, (list, tuple)) or not all(isinstance(p, str) for p in prediction):
            raise SpecdecError("prediction for a list of prompts must be a list of strings, one per prompt; "
                               f"got {type(prediction).__name__}")
        if len(prediction) != n:
            raise SpecdecError(f"{len(prediction)} predictions for {n} prompts; give one string per prompt")
        return list(prediction)

    @staticmethod
    def _stops(stop: str | Seq[str]) -> tuple[str, ...]:
        """Stop strings: one string or a list of them; () for none (None is refused, not read as none)."""
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise SpecdecError(f"stop must be a string or a list of strings (() for none), got {type(stop).__name__}")
        if any(not isinstance(s, str) or not s for s in stop):
            raise SpecdecError("stop strings must be non-empty strings")
        return tuple(unicode_text(s, "stop string") for s in stop)

    def _requests(self, prompts: list[Prompt], max_new_tokens: int, params: list[SamplingParams],
                  stop: Seq[str], chat: bool, truncate: bool, predictions: list[str]) -> list[Request]:
        """One request per prompt, prompt i sampled with params[i] (and predicted by predictions[i])."""
        refusal = f"max_new_tokens must be a positive integer, got {cut(repr(max_new_tokens))}"
        max_new_tokens = as_integer(max_new_tokens, refusal)
        if max_new_tokens <= 0:
            raise SpecdecError(refusal)
        stop = self._stops(stop)
        limit = self.target.max_seq_len - max_new_tokens - 1
        if limit <= 0:
            raise SpecdecError(f"max_new_tokens={max_new_tokens} leaves no room in the context of {self.target.max_seq_len}")
        reqs = []
        for i, (p, sampling, pred) in enumerate(zip(prompts, params, predictions)):
            try:
                reqs.append(Request(self._prompt_ids(p, chat, limit, truncate, max_new_tokens), max_new_tokens,
                                    sampling, stop, prediction=self.prediction_ids(pred)))
            except SpecdecError as e:
                if len(prompts) == 1:
                    raise
                raise SpecdecError(f"prompt {i} of the list: {e}") from None
        return reqs

    def _prompt_ids(self, p: Prompt, chat: bool, limit: int, truncate: bool, max_new_tokens: int) -> list[int]:
        """A prompt's token ids, within `limit` (cut at the front, BOS kept, where `truncate`)."""
        ids = self._encode(p, chat)
        if len(ids) > limit:
            if not truncate:
                room = self.target.max_seq_len - 1 - len(ids)          # the most new tokens this prompt leaves
                lower = f"lower max_new_tokens (at most {room} with this prompt), " if room >= 1 else ""
                raise SpecdecError(f"prompt of {len(ids)} tokens is longer than the {max(limit, 0)} the context "
                                   f"window ({self.target.max_seq_len}) allows with max_new_tokens={max_new_tokens}; "
                                   f"{lower}shorten it or ask for truncation (truncate=True / --truncate)")
            keep = 1 if ids[0] == self.tokenizer.bos_id else 0     # the BOS a model needs stays in front
            ids = ids[:keep] + ids[len(ids) - limit + keep:]
        return ids

    def engine(self, rows: int, slots: int, prefix_cache: PrefixCache | None = None,
               prefill_budget: int = 512) -> Engine:
        """An engine for `rows` sequences of up to `slots` tokens (see Engine for the prefill options; no
        prefix cache given: a disabled one of the engine's own)."""
        policy = make_policy(self.policy_name, self.num_draft_tokens) if self.method != "none" else make_policy("fixed", 1)
        eng = Engine(self.target, self.proposer, policy, self.tokenizer.decode, self.tokenizer.eos_ids,
                     prefix_cache, prefill_budget, self.tokenizer.byte_ids)
        eng.allocate(rows, min(slots, self.target.max_seq_len))
        return eng

    def _prepare(self, prompts: list[Prompt], single: bool, max_new_tokens: int, params: list[SamplingParams],
                 stop: Seq[str], chat: bool | Literal["auto"], truncate: bool,
                 prediction: str | Seq[str]) -> tuple[list[Request], int]:
        """Check every argument and build the requests (no model work): the requests and the cache slots."""
        if chat not in (True, False, "auto") or not isinstance(chat, (bool, str)):
            raise SpecdecError(f'chat must be True, False or "auto", got {chat!r}')
        if not isinstance(truncate, bool):
            raise SpecdecError(f"truncate must be True or False, got {truncate!r}")
        chat = self.tokenizer.has_chat_template if chat == "auto" else chat
        reqs = self._requests(prompts, max_new_tokens, params, stop, chat, truncate,
                              self._predictions(prediction, len(prompts), single))
        return reqs, max(len(r.prompt) + r.max_new_tokens for r in reqs) + scratch_slots(self.num_draft_tokens)

    def _run(self, reqs: list[Request], slots: int) -> Iterator[tuple[int, str, Engine, list]]:
        """Generate `reqs` in an engine of `slots` cache slots, yielding (request index, text piece, engine,
        sequences) after every piece; one generation at a time per generator."""
        me = threading.get_ident()
        if self._running_in == me and self._turn.locked():
            gc.collect()                       # a stream dropped inside a reference cycle: its close frees the turn
            if self._running_in == me and self._turn.locked():
                raise SpecdecError("this generator is already generating in this thread (a stream started here, "
                                   "not yet finished or closed): finish or close it first, or load another generator")
        while not self._turn.acquire(timeout=TURN_WAIT_SECONDS):   # calls from other threads wait for their turn
            if time.monotonic() - self._progress > TURN_WAIT_SECONDS:
                gc.collect()                   # ... unless the turn is held by a dropped stream nobody can close
                                               # (one that still steps is not: a collection would only slow it)
        try:
            self._running_in = me
            self._progress = time.monotonic()
            eng = self.engine(len(reqs), slots)
            seqs = [eng.add(r) for r in reqs]
            index = {id(s): i for i, s in enumerate(seqs)}
            while eng.busy:
                with torch.inference_mode():           # per step: a suspended stream must not leave its
                    pieces = eng.step()                # consumer's thread (or, collected, another) in inference mode
                self._progress = time.monotonic()
                for seq, piece in pieces:
                    yield index[id(seq)], piece, eng, seqs
        finally:
            self._running_in = 0               # (a stale marker without the lock held is ignored above)
            self._turn.release()

    # ---- public -----------------------------------------------------------------------
    def generate(self, prompt: Prompt | list[Prompt], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop: Seq[str] = (),
                 chat: bool | Literal["auto"] = "auto", truncate: bool = False,
                 prediction: str | Seq[str] = "", logprobs: bool = False, top_logprobs: int = 0,
                 prompt_logprobs: bool = False) -> Result | list[Result]:
        """One prompt (text or token ids) -> Result; a list of prompts -> list of Results.

        `stop`: a string or a list of strings (() for none; None is refused).
        `chat`: wrap a text prompt in the model's chat template; "auto" (the default): where it has one.
        `prediction`: the output you expect (e.g. the text being edited), a string; for a list of prompts a
        list of strings, one per prompt. It is drafted from wherever it matches, for any method, `none`
        included; the output is still exactly the target's.
        `logprobs`: give each generated token's log-probability under the target's distribution (before
        temperature, top-k and top-p) in `Result.logprobs`, with the `top_logprobs` (0-20) most likely tokens
        at its position; the same numbers for every method as for `none`. `prompt_logprobs`: the same for the
        prompt's tokens from its second on (`Result.prompt_logprobs`; scoring a text: its tokens' log-likelihood).

        A single prompt is sampled with `seed`; prompt i of a list with derive_seed(seed, i), so
        equal prompts in one list get different samples. The sampled output of a prompt depends on
        its seed only: not on the rest of the batch, nor, for methods that draft point masses, on the draft
        length or policy: it equals method `none`'s. Methods that sample their drafts (`draft` and `self`, and
        the EAGLE chains of eagle, eagle3 and hybrid at temperatures where `sample_drafts` is on) are exact in
        distribution, but their output for a seed depends on the draft length: it repeats only with the `fixed`
        draft policy (`auto` picks lengths from timings)."""
        prompts, single = self._prompts(prompt)
        if single:
            self.last_result = empty_result()
        params = SamplingParams(temperature, top_k, top_p, seed)
        per_prompt = [params] if single else [replace(params, seed=derive_seed(seed, i)) for i in range(len(prompts))]
        seqs: list = []
        reqs, slots = self._prepare(prompts, single, max_new_tokens, per_prompt, stop, chat, truncate, prediction)
        reqs = self._with_logprobs(reqs, logprobs, top_logprobs, prompt_logprobs)
        for _, _, _, seqs in self._run(reqs, slots):
            pass
        results = [self._result(s) for s in seqs]
        if single:
            self.last_result = results[0]
        return results[0] if single else results

    def stream(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int = 0, stop: Seq[str] = (), chat: bool | Literal["auto"] = "auto",
               truncate: bool = False, prediction: str = "", logprobs: bool = False,
               top_logprobs: int = 0, prompt_logprobs: bool = False) -> Iterator[str]:
        """Yield text pieces as tokens are committed. `last_result` holds the Result so far (all of it once the
        stream is exhausted; closed early: what was committed, finish_reason "cancelled").

        Bad arguments raise SpecdecError here, at the call, before the first piece.
        A stream holds this generator until it ends or is closed: calls from other threads wait for it, a call
        from the thread that started it is refused (it would wait for itself). A stream dropped without
        `close()` is closed when Python collects it (a waiting call makes it collect)."""
        self.last_result = empty_result()
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise SpecdecError("empty prompt")
        if not _one_prompt(prompt):
            raise SpecdecError(f"stream takes one prompt (a string or a list of token ids), got "
                               f"{type(prompt).__name__}; generate takes a list of prompts")
        params = SamplingParams(temperature, top_k, top_p, seed)
        reqs, slots = self._prepare([prompt], True, max_new_tokens, [params], stop, chat, truncate, prediction)
        reqs = self._with_logprobs(reqs, logprobs, top_logprobs, prompt_logprobs)
        return self._stream(reqs, slots)               # bad arguments raised above, before the first piece

    def _stream(self, reqs: list[Request], slots: int) -> Iterator[str]:
        owner = threading.current_thread()     # the thread iterating; a dropped stream may be closed in another
        seqs: list = []
        try:
            for _, piece, eng, seqs in self._run(reqs, slots):
                self._keep_last(owner, self._result(seqs[0]))
                if piece:
                    yield piece
        except (GeneratorExit, KeyboardInterrupt):     # closed early or Ctrl-C: what was committed, "cancelled",
            if seqs and not seqs[0].done:              # timed until now
                eng.cancel(seqs[0])
                seqs[0].counters.wall_seconds = time.perf_counter() - seqs[0].started
                self._keep_last(owner, self._result(seqs[0]))
            raise

    @staticmethod
    def _with_logprobs(reqs: list[Request], logprobs: bool, top_logprobs: int, prompt: bool) -> list[Request]:
        """The requests, asking for log-probabilities where `logprobs` (of the output) or `prompt` (of the prompt)."""
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt)):
            if not isinstance(value, bool):
                raise SpecdecError(f"{name} must be True or False, got {cut(repr(value))}")
        top = check_top_logprobs(top_logprobs)
        if top and not (logprobs or prompt):
            raise SpecdecError("top_logprobs needs logprobs=True or prompt_logprobs=True")
        return [replace(r, logprobs=logprobs, top_logprobs=top, prompt_logprobs=prompt) for r in reqs]

    def _result(self, s) -> Result:
        return Result(s.text, s.generated, s.counters.as_dict(), s.finish_reason,
                      len(s.request.prompt), list(s.logprobs), list(s.prompt_logprobs))


DraftSource = str | CausalLM | None
"""What a method drafts with: for `draft` a draft model (loaded, a registered name or GGUF path, `self:N`
layers of the target, or a distilled `.safetensors`; `staged` likewise); for `eagle`, `eagle3`, `hybrid`,
`medusa` a head's weights file, for `self` an exit's; for `lookahead` its shape "W,N,G"; None: the one shipped
for the target (lookahead: its default shape). (The public flag keeps its name: `draft_model`.)"""


@dataclass(frozen=True)
class ProposerInputs:
    """Everything a method's builder may use."""
    target: CausalLM
    tokenizer: Tokenizer
    source: DraftSource
    dtype: str
    device: str
    tree: TreeShape
    sample_from: float = math.inf     # eagle, eagle3, hybrid: rows sampling at this temperature or above draw drafts from q


SAMPLED_HEADS = ("eagle", "eagle3", "hybrid")   # methods whose EAGLE chains may sample drafts from q (sample_drafts)
AUTO_SAMPLE_FROM = names.AUTO_SAMPLE_FROM   # `auto` samples the EAGLE chains' drafts from this temperature up


def sample_drafts_from(setting: str, method: str, tree: TreeShape = TreeShape()) -> float:
    """The lowest temperature at which `method`'s rows draw their drafts from its own q (math.inf: none) for
    the setting `sample_drafts` (names.SAMPLE_DRAFTS): `on` every row that samples, for the chains of eagle,
    eagle3 and hybrid (an error for any other method or a tree); `off` none (point masses: the head's argmax);
    `auto` (the default) where it was measured to pay: the EAGLE chains' rows (eagle, eagle3, hybrid) at AUTO_SAMPLE_FROM
    and above. Greedy rows draft point masses whatever the setting."""
    if setting not in names.SAMPLE_DRAFTS:
        raise SpecdecError(names.unknown("sample_drafts setting", setting, names.SAMPLE_DRAFTS))
    applies = method in SAMPLED_HEADS and tree.topk == 1
    if setting == "on" and not applies:
        raise SpecdecError(f"sample_drafts='on' (--sample-drafts on) applies to the EAGLE chains of "
                           f"{', '.join(SAMPLED_HEADS[:-1])} and {SAMPLED_HEADS[-1]} (methods 'draft' and 'self' "
                           f"sample their drafts always), not {method!r}"
                           + (f" with a tree ({tree})" if tree.topk != 1 else ""))
    if not applies or setting == "off":
        return math.inf
    return 0.0 if setting == "on" else AUTO_SAMPLE_FROM


def serve_sample_drafts(setting: str, method: str) -> str:
    """A server's `setting` for its engines of `method`: as given for the SAMPLED_HEADS methods, and `on` is `off` for
    the methods it does not apply to (a server runs several; requests choose theirs)."""
    return "off" if setting == "on" and method not in SAMPLED_HEADS else setting


DRAFT_FILES = {"draft": "a registered model, a .gguf file, self:N or a distilled draft (.safetensors)",
               "eagle": "an EAGLE head (.safetensors)", "eagle3": "an EAGLE-3 head (.safetensors or an export's folder)",
               "hybrid": "an EAGLE-3 head (.safetensors or an export's folder)",
               "medusa": "Medusa heads (.safetensors)", "self": "an exit (.safetensors) or self:N"}
DRAFT_FILES["staged"] = DRAFT_FILES["draft"]


def refuse_model(method: str, source: DraftSource) -> None:
    """A loaded model given to a method that drafts with weights of another kind (a head, an exit) or none."""
    if source is not None and not isinstance(source, str):
        takes = DRAFT_FILES.get(method, "its shape W,N,G (e.g. '2,3,2')")
        raise SpecdecError(f"method {method!r} takes {takes} as draft_model, not a loaded model")


def check_draft_source(method: str, source: str) -> None:
    """Refuse, before anything loads, a draft named by a string that cannot be one: a file that is not there
    (lookahead: a shape that does not parse)."""
    if method == "lookahead":
        from .proposers.lookahead import LookaheadShape

        LookaheadShape.parse(source)
        return
    if method not in DRAFT_FILES:
        return
    if source.startswith("self:") and method in ("draft", "staged", "self"):
        n = source.split(":", 1)[1]
        if not n.isdecimal() or int(n) < 1:                  # the upper bound needs the target's layer count
            raise SpecdecError(f"self:N needs a whole number of layers N >= 1, got {source!r}")
        return
    if source in MODELS and method in ("draft", "staged"):
        return
    if not Path(source).expanduser().exists():
        raise SpecdecError(f"draft {source!r} of method {method!r} not found: it takes {DRAFT_FILES[method]}")


def check_same_tokenizer(model: str, draft: str) -> None:
    """`staged` drafts for its draft model in the target's tokens: a GGUF draft (a registered name or a file) with
    another tokenizer is refused from the two tokenizers (converted once and cached), before the models load."""
    from .models.registry import resolve

    if not (draft in MODELS or draft.endswith(".gguf")) or draft == model:
        return
    if Tokenizer.from_gguf(resolve(draft)[1]).vocab != Tokenizer.from_gguf(resolve(model)[1]).vocab:
        raise SpecdecError(f"method 'staged' needs a draft with the target's tokenizer; {draft!r} has another "
                           "(method 'draft' takes it)")


def make_proposer(method: str, target: CausalLM, target_tok: Tokenizer, source: DraftSource,
                  dtype: str, device: str, tree: TreeShape = TreeShape(),
                  sample_drafts: str = names.DEFAULT_SAMPLE_DRAFTS) -> Proposer:
    """The proposer of `method` for `target`, drafting with `source` (see DraftSource); `sample_drafts`: see
    sample_drafts_from."""
    build = PROPOSER_BUILDERS.get(method)
    if build is None:
        raise SpecdecError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    sample_from = sample_drafts_from(sample_drafts, method, tree)
    return build(ProposerInputs(target, target_tok, source, dtype, device, tree, sample_from))


def _draft_proposer(x: ProposerInputs) -> Proposer:
    if isinstance(x.source, str) and not x.source.endswith(".safetensors") and not x.source.startswith("self:"):
        draft, draft_tok, _ = load_model(x.source, x.dtype, x.device)
        if draft_tok.vocab != x.tokenizer.vocab:                # another tokenizer: token-level intersection
            from .proposers.cross_vocab import CrossVocabProposer

            prop = CrossVocabProposer(draft, draft_tok, x.tokenizer, x.target.vocab_size)
            logging.getLogger("specdec").info("draft %s with another tokenizer: %s", x.source, prop.map.describe())
            return prop
        return DraftModelProposer(draft)
    draft = load_draft(x)
    if draft.vocab_size != x.target.vocab_size:
        raise SpecdecError(f"draft vocabulary ({draft.vocab_size}) differs from the target's ({x.target.vocab_size})")
    if _params(draft) > _params(x.target):
        warnings.warn("the draft model is larger than the target: speculation will likely be slower", stacklevel=4)
    return DraftModelProposer(draft)


def _staged_proposer(x: ProposerInputs) -> Proposer:
    from .proposers.staged import StagedProposer

    draft = _draft_proposer(x)
    if not isinstance(draft, DraftModelProposer):         # a draft with another tokenizer (cross-vocabulary)
        raise SpecdecError(f"method 'staged' needs a draft with the target's tokenizer; {x.source!r} has another "
                           "(method 'draft' takes it)")
    return StagedProposer(draft)


SELF_MIN_CONFIDENCE = 0.1   # the exit stops drafting below this top probability per token (the EAGLE chain: 0.3, cumulative)


def _self_proposer(x: ProposerInputs) -> Proposer:
    """The target's first N layers and a trained exit (`.safetensors` from `specdec train exit`; default: the one
    shipped); `self:N` gives N layers and an untrained exit (the target's own final norm and head)."""
    from .models.decoder import Transformer
    from .models.early_exit import EarlyExitDraft

    if not isinstance(x.target, Transformer):
        raise SpecdecError("method 'self' needs a lean GGUF target")
    if isinstance(x.source, str) and x.source.startswith("self:"):
        proposer = DraftModelProposer(early_exit_draft(x.target, x.source))
        proposer.name = "self"                     # reported as the method asked for (its class drafts for draft)
        return proposer
    if x.source is not None and not isinstance(x.source, str):
        raise SpecdecError("method 'self' takes an exit's weights file or self:N, not a model")
    from .proposers.self_spec import SelfProposer

    path = Path(x.source) if x.source else shipped(x.target.config.name, "exit")
    return SelfProposer(EarlyExitDraft.load(path, x.target), SELF_MIN_CONFIDENCE)


def _lookahead_proposer(x: ProposerInputs) -> Proposer:
    from .proposers.lookahead import LookaheadProposer, LookaheadShape

    if x.source is not None and not isinstance(x.source, str):
        raise SpecdecError("method 'lookahead' takes its shape W,N,G as draft_model (e.g. '2,3,2'), not a model")
    return LookaheadProposer(LookaheadShape.parse(x.source) if x.source else LookaheadShape())


def train_hint(model: str, kind: str, extra: str = "") -> str:
    """How to get `kind` weights for `model`: the training command where `specdec train` takes the model."""
    from .train import DATA_COMMAND, has_default_data

    if model in MODELS:
        train = f"train them (`specdec train {kind} --model {model} --out FILE.safetensors{extra}`)"
        if has_default_data(model, kind):
            return train
        return f"write training data first (`specdec train {DATA_COMMAND[kind]} --model {model}`), then {train}"
    return f"`specdec train` trains them for a registered model ({', '.join(MODELS)}), not for {model!r}"


def no_draft_for(model: str) -> SpecdecError:
    return SpecdecError(f"methods 'draft' and 'staged' need a draft model for {model!r}: --draft-model "
                        "NAME|PATH.gguf|self:N (draft_model=...; staged: one with the target's tokenizer); "
                        + train_hint(model, "draft"))


def load_draft(x: ProposerInputs) -> CausalLM:
    """The draft model `x.source` names (or is), or the distilled draft shipped for the target."""
    source = x.source
    if source is None:
        if getattr(x.target, "config", None) is None or (x.target.config.name, "draft") not in SHIPPED:
            raise no_draft_for(getattr(getattr(x.target, "config", None), "name", "MODEL"))
        source = str(shipped(x.target.config.name, "draft"))
    if not isinstance(source, str):
        return source                                         # a loaded model
    if source.endswith(".safetensors"):
        from .models.decoder import Transformer
        from .models.distilled import DistilledDraft

        if not isinstance(x.target, Transformer):
            raise SpecdecError("a distilled draft (.safetensors) needs a lean GGUF target")
        return DistilledDraft.load(Path(source), x.target)
    if source.startswith("self:"):
        return early_exit_draft(x.target, source)
    draft, draft_tok, _ = load_model(source, x.dtype, x.device)
    if draft_tok.vocab != x.tokenizer.vocab:
        raise SpecdecError(f"draft model {source!r} has a different vocabulary than the target; "
                           "a draft must share the target's tokenizer")
    return draft


def _hybrid_proposer(x: ProposerInputs) -> Proposer:
    from .proposers.hybrid import HybridProposer

    return HybridProposer(hybrid_head(x.target, x.source, TreeShape(), x.sample_from), NgramProposer())


def _medusa_proposer(x: ProposerInputs) -> Proposer:
    from .models.decoder import Transformer
    from .models.medusa import MedusaHeads
    from .proposers.medusa import MedusaProposer

    if not isinstance(x.target, Transformer):
        raise SpecdecError("method 'medusa' needs a lean GGUF target")
    refuse_model("medusa", x.source)
    path = x.source if isinstance(x.source, str) else shipped(x.target.config.name, "medusa")
    return MedusaProposer(MedusaHeads.load(Path(path), x.target))


PROPOSER_BUILDERS: dict[str, Callable[[ProposerInputs], Proposer]] = {
    "none": lambda x: NoProposer(),
    "ngram": lambda x: NgramProposer(),
    "draft": _draft_proposer,
    "eagle": lambda x: eagle_proposer(x.target, x.source, x.tree, x.sample_from),
    "eagle3": lambda x: eagle3_proposer(x.target, x.source, x.tree, x.sample_from),
    "medusa": _medusa_proposer,
    "staged": _staged_proposer,
    "lookahead": _lookahead_proposer,
    "self": _self_proposer,
    "suffix": lambda x: SuffixProposer(),
    "hybrid": _hybrid_proposer,
}
METHODS = tuple(PROPOSER_BUILDERS)


# an EAGLE chain stops drafting where the head's cumulative confidence falls below this: a draft pays where its
# chance of acceptance exceeds what it costs (a drafting step and a verification row) over a plain step's cost,
# about (0.85 + 1.3) / 7.4 = 0.29 for smollm2-135m in q4 on an AMD EPYC Zen 4 at 1 thread. Mini suite there, 24
# prompts, greedy, 1 thread (docs/benchmarks.md, "The EAGLE chain's confidence cut"): `eagle3` at K = 4 0.97x /
# 1.01x / 0.95x over `none` at 0.1 / 0.3 / 0.5, `eagle3@auto` 0.98x / 1.00x / 0.98x
EAGLE_CHAIN_MIN_CONFIDENCE = 0.3


def eagle_proposer(target: CausalLM, head: DraftSource, tree: TreeShape, sample_from: float = math.inf) -> EagleProposer:
    """The EAGLE proposer for a lean target: the head whose weights file is `head`, or the one we ship."""
    from .models.decoder import Transformer
    from .models.eagle import EagleHead
    from .proposers.eagle import EagleProposer

    if not isinstance(target, Transformer):
        raise SpecdecError("EAGLE drafting (method 'eagle') needs a lean GGUF target")
    refuse_model("eagle", head)
    path = head if isinstance(head, str) else shipped(target.config.name, "eagle")
    return EagleProposer(EagleHead.load(Path(path), target), tree.topk, MAX_DRAFT_TOKENS, tree.budget,
                         EAGLE_CHAIN_MIN_CONFIDENCE, sample_from=sample_from)


def eagle3_proposer(target: CausalLM, head: DraftSource, tree: TreeShape, sample_from: float = math.inf) -> EagleProposer:
    """The EAGLE-3 proposer for a lean target (an engine with it asks the target's forwards for the head's
    feature layers too)."""
    from .models.decoder import Transformer
    from .models.eagle3 import Eagle3Head
    from .proposers.eagle import EagleProposer

    if not isinstance(target, Transformer):
        raise SpecdecError("EAGLE-3 drafting (methods 'eagle3', 'hybrid') needs a lean GGUF target")
    refuse_model("eagle3", head)
    path = Path(head) if isinstance(head, str) else shipped(target.config.name, "eagle3")
    if path.is_dir():                                      # a vLLM / SGLang export
        from .export import import_eagle3

        h = import_eagle3(path, target)
    else:
        h = Eagle3Head.load(path, target)
    return EagleProposer(h, tree.topk, MAX_DRAFT_TOKENS, tree.budget, EAGLE_CHAIN_MIN_CONFIDENCE, name="eagle3",
                         sample_from=sample_from)


# the head `hybrid` drafts with where prompt lookup has no match: the one with the better mini-suite
# speedup (docs/benchmarks.md, "hybrid's head": EAGLE-3 1.10x over `none` at K = 4 against EAGLE's 0.98x,
# AMD EPYC Zen 4, 1 thread)
hybrid_head = eagle3_proposer


WEIGHTS_OF = {"draft": "draft", "staged": "draft", "self": "exit", "eagle": "eagle", "eagle3": "eagle3",
              "hybrid": "eagle3", "medusa": "medusa"}      # method -> the kind of shipped weights it drafts with


OWN_FILE = "--draft-model FILE, draft_model=FILE"      # how generate, serve and load name a draft's file


def check_shipped(model: str, method: str, own_file: str = OWN_FILE) -> None:
    """Refuse, before anything loads, a method that would draft with shipped weights the registered `model` lacks
    (`own_file`: how the caller's user names a file instead)."""
    kind = WEIGHTS_OF.get(method, "")
    if kind and model in MODELS and not has_shipped(model, kind):
        raise no_draft_for(model) if kind == "draft" else SpecdecError(missing(model, kind, own_file))


def has_shipped(model: str, kind: str) -> bool:
    name = SHIPPED.get((model, kind))
    return name is not None and (WEIGHTS_DIR / name).is_file()


def missing(model: str, kind: str, own_file: str = OWN_FILE) -> str:
    """Why (model, kind) has no weights, the training command that makes them and how to draft with a file."""
    hint = train_hint(model, kind, " --layers N" if kind == "exit" else "")
    return f"no shipped {kind} weights for {model!r}; {hint}; draft with a file ({own_file})"


def shipped(model: str, kind: str) -> Path:
    """The weights we ship for (model, kind), or a clear error naming the training command."""
    if not has_shipped(model, kind):
        raise SpecdecError(missing(model, kind))
    return WEIGHTS_DIR / SHIPPED[(model, kind)]


def early_exit_draft(target: CausalLM, spec: str) -> CausalLM:
    """`self:N`: the target's first N layers (sharing its weights) as a draft with its own cache."""
    from .models.decoder import Transformer, truncated

    n = spec.split(":", 1)[1]
    if not isinstance(target, Transformer):
        raise SpecdecError("self:N drafts need a lean GGUF target")
    if not n.isdecimal() or not 1 <= int(n) < target.config.n_layers:
        raise SpecdecError(f"self:N needs 1 <= N < {target.config.n_layers} (the target's layers), got {spec!r}")
    return truncated(target, int(n))


def _params(m: CausalLM) -> int:
    return sum(p.numel() for p in m.parameters()) if isinstance(m, torch.nn.Module) else 0


def best_method(target: CausalLM) -> str:
    """The default method for a target: `suffix` (no weights: the context's and earlier outputs'
    continuations), with the `auto` draft policy drafting nothing where drafting does not pay. It was the
    fastest lossless method measured with the shipped heads too, or within noise of the fastest: on the mini
    suite `suffix@auto` 1.18x / 1.15x over `none` against `hybrid@auto`'s 1.10x / 1.10x (AMD EPYC Zen 4, 1 / 2
    threads; docs/benchmarks.md, "Mini suite with chains fed once")."""
    return "suffix"


def load(model: str | Path = DEFAULT_MODEL, method: str = names.AUTO_METHOD, dtype: str = "auto", device: str = "cpu",
         draft_model: str | CausalLM | None = None, num_draft_tokens: int = 4,
         draft_policy: str = names.DEFAULT_POLICY, tree: TreeShape | str = TreeShape(),
         sample_drafts: str = names.DEFAULT_SAMPLE_DRAFTS) -> Generator:
    """Load a target (registered name or .gguf path) with a speculative method.

    `method`: auto (the default: the best lossless method for the target, see best_method), one of METHODS,
    or none for plain decoding. `draft_policy`: auto (the default: K from measured acceptance and costs, 0
    where drafting does not pay), fixed (always `num_draft_tokens`) or heuristic.

    `dtype`: auto (the fastest mode this machine computes exactly: q4, else native bfloat16, else
    float32; see choose_dtype), float32, bfloat16 or q4.
    `draft_model`: what the method drafts with (see DraftSource); methods none, ngram and suffix take none.
    `tree` shapes the drafts of eagle and eagle3: a TreeShape or "TOPKxBUDGET" (e.g. "4x16" for a dynamic
    tree); the default (topk 1) is a chain, the fastest on our CPU measurements.
    `sample_drafts`: auto (the default), on or off (see sample_drafts_from): whether the EAGLE chains of eagle, eagle3 and hybrid
    draw the drafts of rows that sample from the head's own q; auto does so at temperatures of
    AUTO_SAMPLE_FROM and above, where it was measured to pay. A sampled draft is accepted with probability
    1 - TV(p, q) instead of p(argmax q); exact in distribution by the rejection rule, but such a row's output
    is not token-identical to `none`'s for the same seed (reproducible for a fixed seed and K: draft policy
    fixed). Greedy rows are unaffected (token-identical to `none`); `off` keeps seeded sampling equal to
    `none`'s at every temperature."""
    if not isinstance(model, (str, Path)):
        raise SpecdecError(f"model must be a registered name or a .gguf path, got {type(model).__name__}")
    if method not in names.METHOD_CHOICES:
        raise SpecdecError(names.unknown("method", method, names.METHOD_CHOICES))
    if draft_policy not in POLICIES:
        raise SpecdecError(names.unknown("draft policy", draft_policy, POLICIES))
    if not isinstance(sample_drafts, str) or sample_drafts not in names.SAMPLE_DRAFTS:
        raise SpecdecError(names.unknown("sample_drafts setting", sample_drafts, names.SAMPLE_DRAFTS))
    if draft_model is not None and method in names.DRAFTLESS:
        what = "decodes without drafts" if method == "none" else "drafts from the context"
        raise SpecdecError(f"method {method!r} {what} and takes no draft_model (--draft-model); "
                           "use method 'draft' for a draft model")
    if not isinstance(draft_model, (str, Path, torch.nn.Module, type(None))):
        raise SpecdecError(f"draft_model must be a name, a path or a loaded model, got {type(draft_model).__name__}")
    if isinstance(draft_model, torch.nn.Module) and not isinstance(getattr(draft_model, "vocab_size", None), int):
        raise SpecdecError(f"a loaded draft_model must be a causal LM with a vocab_size (e.g. "
                           f"specdec.api.load_model(...)[0]), got {type(draft_model).__name__}")
    if not isinstance(tree, (str, TreeShape)):
        raise SpecdecError(f'tree must be a TreeShape or "TOPKxBUDGET" (e.g. "4x16"), got {type(tree).__name__}')
    make_policy(draft_policy, num_draft_tokens)
    tree = TreeShape.parse(tree) if isinstance(tree, str) else tree
    if method == names.AUTO_METHOD and (draft_model is not None or tree != TreeShape()):
        raise SpecdecError("draft_model and tree belong to a named method: give method= too (e.g. 'draft', 'eagle')")
    if tree != TreeShape() and method not in ("eagle", "eagle3"):
        raise SpecdecError(f"a draft tree shape ({tree}) applies to methods 'eagle' and 'eagle3' only, not {method!r}")
    if method != names.AUTO_METHOD:
        sample_drafts_from(sample_drafts, method, tree)      # a setting that does not apply fails before loading
    if method not in ("draft", "staged", names.AUTO_METHOD):
        refuse_model(method, draft_model if isinstance(draft_model, torch.nn.Module) else None)
    if isinstance(draft_model, (str, Path)):
        check_draft_source(method, str(draft_model))
        if method == "staged":
            check_same_tokenizer(str(model), str(draft_model))
    if draft_model is None:
        check_shipped(str(model), method)                   # shipped weights it lacks: refused before loading too
    target, tok, name = load_model(str(model), dtype, device)
    if method == names.AUTO_METHOD:
        method = best_method(target)
    proposer = make_proposer(method, target, tok, str(draft_model) if isinstance(draft_model, Path) else draft_model,
                             dtype, device, tree, sample_drafts)
    return Generator(target, tok, proposer, draft_policy, num_draft_tokens, name)
