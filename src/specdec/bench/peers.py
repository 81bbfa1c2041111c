"""Peers run side by side with our methods: transformers (and llama.cpp when installed) on the same GGUF.

Every peer is a runner *system* (``name``, ``kind = "peer"``, ``description``,
``generate(ids, max_new_tokens, params)``), fed the same prompt token ids and budgets, greedy:

* ``transformers``: plain ``generate`` (float32, the GGUF dequantized by transformers);
* ``transformers-lookup``: its prompt lookup decoding (``prompt_lookup_num_tokens=10``);
* ``transformers-assisted``: its assisted generation with the same draft as our ``draft`` method
  (``self:N`` = a copy of the transformers target truncated to its first N layers; a registered name
  or .gguf path is loaded from its GGUF) and the same fixed draft length K (constant schedule, no
  confidence cut-off), so the algorithm is ours and only the implementation differs;
* ``llama.cpp`` (llama-cpp-python's ``Llama.generate``), ``llama.cpp-loop`` (llama.cpp's own decode loop
  through the low-level API: one ``llama_decode`` per token, argmax of the last logits in numpy) and
  ``llama.cpp-lookup`` (its prompt-lookup draft, 10 tokens) through ``llama_cpp`` - only if that optional
  extra is importable (``pip install specdec[llamacpp]``). Every llama.cpp peer runs on torch's thread count
  (prefill too). The two plain ones are *yardsticks*: the report compares every method with the faster.
"""
from __future__ import annotations

import copy
import importlib.util
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..errors import SpecdecError
from ..models.registry import resolve
from ..sampling import SamplingParams
from .runner import Generation

PEERS = ("transformers", "llamacpp")
LOOKUP_TOKENS = 10
LLAMACPP_CTX = 4096


def parse_peers(text: str | Sequence[str] | None) -> list[str]:
    """``transformers[,llamacpp]`` -> validated peer family names ('' or None: no peers)."""
    if not text:
        return []
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    for item in items:
        if item not in PEERS:
            raise SpecdecError(f"unknown peer {item!r}; choose from: {', '.join(PEERS)}")
    if "llamacpp" in items and importlib.util.find_spec("llama_cpp") is None:
        raise SpecdecError("peer 'llamacpp' needs llama-cpp-python, which is not installed; "
                           "install it with: pip install 'specdec[llamacpp]' (it compiles for a few minutes)")
    return list(dict.fromkeys(items))


def _check_greedy(params: SamplingParams) -> None:
    if params.temperature != 0:
        raise SpecdecError("peers run greedy only (temperature 0)")


# --------------------------------------------------------------------------- transformers


class TransformersPeer:
    """transformers ``generate`` on one prompt; ``assistant`` / ``lookup`` select its speculative modes."""

    kind = "peer"
    yardstick = False

    def __init__(self, name: str, description: str, model, eos_ids: frozenset[int], pad_id: int,
                 lookup: int = 0, assistant=None) -> None:
        self.name, self.description, self.model = name, description, model
        self.eos_ids, self.pad_id, self.lookup, self.assistant = sorted(eos_ids), pad_id, lookup, assistant

    def _options(self) -> dict:
        if self.lookup:
            return {"prompt_lookup_num_tokens": self.lookup}
        if self.assistant is not None:
            return {"assistant_model": self.assistant}
        return {}

    def forget(self) -> None:
        pass                                                      # every call starts afresh

    def generate(self, ids: list[int], max_new_tokens: int, params: SamplingParams,
                 prediction: str = "") -> Generation:
        """Plain greedy decoding (a prediction is not used)."""
        _check_greedy(params)
        inp = torch.tensor([ids])
        start = time.perf_counter()
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new_tokens,
                                      do_sample=False, eos_token_id=self.eos_ids or None,
                                      pad_token_id=self.pad_id, **self._options())
        seconds = time.perf_counter() - start
        return Generation(out[0, len(ids):].tolist(), seconds, None)


def load_transformers(path: Path):
    """The GGUF at ``path`` as a float32 transformers causal LM."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for unsupported GGUFs
        raise SpecdecError(f"transformers cannot load {path}: {type(e).__name__}: {e}") from None
    return model.eval().requires_grad_(False)


def truncated_copy(model, n_layers: int):
    """A copy of a transformers decoder keeping its first ``n_layers`` (the ``self:N`` draft)."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:n_layers]
    draft.config.num_hidden_layers = n_layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:n_layers]
    return draft


def transformers_draft(target, draft: str, num_draft_tokens: int):
    """The transformers twin of our draft spec (``self:N`` or a registered name / .gguf path), drafting a
    fixed ``num_draft_tokens`` per step like our fixed policy."""
    if draft.startswith("self:"):
        n = draft.split(":", 1)[1]
        if not n.isdecimal() or not 1 <= int(n) < target.config.num_hidden_layers:
            raise SpecdecError(f"self:N needs 1 <= N < {target.config.num_hidden_layers}, got {draft!r}")
        assistant = truncated_copy(target, int(n))
    else:
        assistant = load_transformers(resolve(draft)[1])
    config = assistant.generation_config
    config.num_assistant_tokens = num_draft_tokens
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
    return assistant


def transformers_peers(path: Path, draft: str | None, num_draft_tokens: int, eos_ids: frozenset[int], pad_id: int,
                       notes: list[str]) -> list[TransformersPeer]:
    """Plain generate, prompt lookup and (with a usable draft) assisted generation on the GGUF at ``path``."""
    print(f"specdec: loading the transformers peers (importing transformers, converting {path.name} to float32) ...",
          file=sys.stderr, flush=True)
    model = load_transformers(path)
    peers = [
        TransformersPeer("transformers", "transformers generate (float32)", model, eos_ids, pad_id),
        TransformersPeer("transformers-lookup", f"transformers prompt lookup ({LOOKUP_TOKENS} tokens, float32)",
                         model, eos_ids, pad_id, lookup=LOOKUP_TOKENS),
    ]
    if draft is None:
        return peers
    try:
        assistant = transformers_draft(model, draft, num_draft_tokens)
    except SpecdecError as e:
        notes.append(f"transformers-assisted skipped: no transformers twin of draft {draft!r} ({e})")
        return peers
    peers.append(TransformersPeer("transformers-assisted", f"transformers assisted generation, draft {draft}, "
                                  f"K={num_draft_tokens} (float32)", model, eos_ids, pad_id, assistant=assistant))
    return peers


# --------------------------------------------------------------------------- llama.cpp


def llamacpp_version() -> str:
    """The installed llama-cpp-python's version."""
    from importlib.metadata import version

    return version("llama-cpp-python")


def load_llama(path: Path, threads: int, lookup: int = 0):
    """A ``llama_cpp.Llama`` on the GGUF at ``path``: ``threads`` for decoding and prefill alike, optionally with
    its prompt-lookup draft of ``lookup`` tokens."""
    from llama_cpp import Llama

    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
    # with a draft, llama-cpp-python keeps the scores of every position it verifies (logits_all);
    # without it, a verification of 11 tokens overflows its score buffer
    return Llama(model_path=str(path), n_ctx=LLAMACPP_CTX, n_threads=threads, n_threads_batch=threads,
                 draft_model=draft, logits_all=draft is not None, verbose=False)


class LlamaCppPeer:
    """llama.cpp's high-level greedy generation (``Llama.generate``), optionally with its prompt-lookup draft."""

    kind = "peer"

    def __init__(self, name: str, description: str, llm, eos_ids: frozenset[int], yardstick: bool) -> None:
        self.name, self.description, self.llm, self.eos_ids = name, description, llm, eos_ids
        self.yardstick = yardstick

    def forget(self) -> None:
        pass                                                      # every call starts afresh

    def generate(self, ids: list[int], max_new_tokens: int, params: SamplingParams,
                 prediction: str = "") -> Generation:
        """Plain greedy decoding (a prediction is not used)."""
        _check_greedy(params)
        self.llm.reset()                                          # no KV reuse across calls
        tokens: list[int] = []
        start = time.perf_counter()
        if max_new_tokens > 0:
            for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
                tokens.append(int(token))
                if token in self.eos_ids or len(tokens) >= max_new_tokens:
                    break
        return Generation(tokens, time.perf_counter() - start, None)


class Decoder(Protocol):
    """The llama.cpp calls a greedy decode loop makes, on one sequence (seq 0) of one context."""

    n_batch: int                  # most tokens one decode call takes

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions of the KV cache (0: empty it)."""
        ...

    def decode(self, tokens: Sequence[int], start: int, every_row: bool = False) -> None:
        """One ``llama_decode`` of ``tokens`` at positions ``start``...; logits of the last (or of every) row."""
        ...

    def last_logits(self) -> np.ndarray:
        """The last decoded row's logits, (vocab,) float32 (a view: valid until the next decode)."""
        ...


class LlamaCppDecoder:
    """:class:`Decoder` on a ``llama_cpp.Llama``'s context through llama-cpp-python's low-level API."""

    def __init__(self, llm) -> None:
        import llama_cpp

        self._api, self._llm, self._ctx = llama_cpp, llm, llm.ctx  # llm keeps the model and context alive
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self.n_batch, self.n_vocab = int(llm.n_batch), int(llm.n_vocab())
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)

    def __del__(self) -> None:
        batch, self._batch = getattr(self, "_batch", None), None
        if batch is not None:
            self._api.llama_batch_free(batch)

    def truncate(self, length: int) -> None:
        self._api.llama_memory_seq_rm(self._memory, 0, length, -1)

    def decode(self, tokens: Sequence[int], start: int, every_row: bool = False) -> None:
        if not 0 < len(tokens) <= self.n_batch:
            raise SpecdecError(f"a llama.cpp decode takes 1 to {self.n_batch} tokens, got {len(tokens)}")
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = every_row or i == len(tokens) - 1
        code = self._api.llama_decode(self._ctx, batch)
        if code != 0:
            raise SpecdecError(f"llama_decode failed with code {code} at position {start}")

    def synchronize(self) -> None:
        """Wait for the last decode's computation (for timing)."""
        self._api.llama_synchronize(self._ctx)

    def last_logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(self._api.llama_get_logits_ith(self._ctx, -1), shape=(self.n_vocab,))


def greedy_loop(decoder: Decoder, ids: Sequence[int], max_new_tokens: int, eos_ids: frozenset[int]) -> list[int]:
    """Greedy decoding as llama.cpp's own examples do it: the prompt in ``n_batch`` pieces, then one decode of one
    token per new token, each the argmax of the last logits; stops after an EOS (kept) or ``max_new_tokens``."""
    decoder.truncate(0)
    for i in range(0, len(ids), decoder.n_batch):
        decoder.decode(ids[i:i + decoder.n_batch], i)
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        token = int(np.argmax(decoder.last_logits()))
        tokens.append(token)
        if token in eos_ids or len(tokens) == max_new_tokens:
            break
        decoder.decode([token], len(ids) + len(tokens) - 1)
    return tokens


class LlamaCppLoopPeer:
    """llama.cpp's own greedy decode loop (:func:`greedy_loop`) through the low-level API."""

    kind = "peer"
    yardstick = True

    def __init__(self, name: str, description: str, decoder: Decoder, eos_ids: frozenset[int]) -> None:
        self.name, self.description, self.decoder, self.eos_ids = name, description, decoder, eos_ids

    def forget(self) -> None:
        pass                                                      # every call starts from an empty cache

    def generate(self, ids: list[int], max_new_tokens: int, params: SamplingParams,
                 prediction: str = "") -> Generation:
        """Plain greedy decoding, prefill included in the time (a prediction is not used)."""
        _check_greedy(params)
        start = time.perf_counter()
        tokens = greedy_loop(self.decoder, ids, max_new_tokens, self.eos_ids)
        return Generation(tokens, time.perf_counter() - start, None)


def llamacpp_peers(path: Path, eos_ids: frozenset[int]) -> list:
    """``llama.cpp`` (Llama.generate), ``llama.cpp-loop`` (its decode loop, on the same context) and
    ``llama.cpp-lookup``, all on torch's thread count."""
    threads = torch.get_num_threads()
    version = f"llama-cpp-python {llamacpp_version()}, GGUF as is, {threads} thread{'s' * (threads > 1)}"
    llm = load_llama(path, threads)
    return [
        LlamaCppPeer("llama.cpp", f"llama.cpp `Llama.generate` ({version})", llm, eos_ids, yardstick=True),
        LlamaCppLoopPeer("llama.cpp-loop", f"llama.cpp decode loop: one `llama_decode` per token, argmax in "
                         f"numpy ({version})", LlamaCppDecoder(llm), eos_ids),
        LlamaCppPeer("llama.cpp-lookup", f"llama.cpp prompt lookup ({LOOKUP_TOKENS} tokens; {version})",
                     load_llama(path, threads, LOOKUP_TOKENS), eos_ids, yardstick=False),
    ]


# --------------------------------------------------------------------------- all


def build_peers(names: Sequence[str], path: Path, draft: str | None, num_draft_tokens: int,
                eos_ids: frozenset[int], pad_id: int) -> tuple[list, list[str]]:
    """Peer systems for the validated family ``names`` on the target GGUF at ``path``, and notes on skipped ones."""
    peers: list = []
    notes: list[str] = []
    if "transformers" in names:
        peers += transformers_peers(path, draft, num_draft_tokens, eos_ids, pad_id, notes)
    if "llamacpp" in names:
        peers += llamacpp_peers(path, eos_ids)
    return peers, notes
