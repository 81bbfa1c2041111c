"""Peers run side by side with our methods: transformers (and llama.cpp when installed) on the same GGUF.

Every peer is a runner *system* (``name``, ``kind = "peer"``, ``description``,
``generate(ids, max_new_tokens, params)``), fed the same prompt token ids and budgets, greedy:

* ``transformers``: plain ``generate`` (float32, the GGUF dequantized by transformers);
* ``transformers-lookup``: its prompt lookup decoding (``prompt_lookup_num_tokens=10``);
* ``transformers-assisted``: its assisted generation with the same draft as our ``draft`` method
  (``self:N`` = a copy of the transformers target truncated to its first N layers; a registered name
  or .gguf path is loaded from its GGUF) and the same fixed draft length K (constant schedule, no
  confidence cut-off), so the algorithm is ours and only the implementation differs;
* ``llama.cpp`` and ``llama.cpp-lookup`` (its prompt-lookup draft, 10 tokens) through
  ``llama_cpp`` - only if that optional extra is importable (``pip install specdec[llamacpp]``).
"""
from __future__ import annotations

import copy
import importlib.util
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

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
        if not n.isdigit() or not 1 <= int(n) < target.config.num_hidden_layers:
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


class LlamaCppPeer:
    """llama.cpp (llama-cpp-python) greedy decoding, optionally with its prompt-lookup draft."""

    kind = "peer"

    def __init__(self, name: str, description: str, path: Path, eos_ids: frozenset[int], threads: int,
                 lookup: int = 0) -> None:
        from llama_cpp import Llama

        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        self.name, self.description, self.eos_ids = name, description, eos_ids
        # with a draft, llama-cpp-python keeps the scores of every position it verifies (logits_all);
        # without it, a verification of 11 tokens overflows its score buffer
        self.llm = Llama(model_path=str(path), n_ctx=LLAMACPP_CTX, n_threads=threads, draft_model=draft,
                         logits_all=draft is not None, verbose=False)

    def forget(self) -> None:
        pass                                                      # every call starts afresh

    def generate(self, ids: list[int], max_new_tokens: int, params: SamplingParams,
                 prediction: str = "") -> Generation:
        """Plain greedy decoding (a prediction is not used)."""
        _check_greedy(params)
        self.llm.reset()                                          # no KV reuse across calls
        tokens: list[int] = []
        start = time.perf_counter()
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            tokens.append(int(token))
            if token in self.eos_ids or len(tokens) >= max_new_tokens:
                break
        return Generation(tokens, time.perf_counter() - start, None)


def llamacpp_peers(path: Path, eos_ids: frozenset[int]) -> list[LlamaCppPeer]:
    threads = torch.get_num_threads()
    return [
        LlamaCppPeer("llama.cpp", "llama.cpp (llama-cpp-python, GGUF as is)", path, eos_ids, threads),
        LlamaCppPeer("llama.cpp-lookup", f"llama.cpp prompt lookup ({LOOKUP_TOKENS} tokens)", path, eos_ids,
                     threads, lookup=LOOKUP_TOKENS),
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
