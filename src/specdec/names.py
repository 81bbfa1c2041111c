"""The names the command line and the API accept, importable without torch (so `specdec --help` is fast).

The modules that act on them keep their own tables (api.PROPOSER_BUILDERS, draft_length.POLICY_BUILDERS,
bench.peers.PEERS, export.FORMATS); tests/test_cli.py checks that these names equal them."""
from __future__ import annotations

import difflib
from collections.abc import Iterable

METHODS: tuple[str, ...] = ("none", "ngram", "draft", "eagle", "eagle3", "medusa", "staged", "lookahead", "self",
                            "suffix", "hybrid")
# the default method: the best lossless method for the model (api.best_method), with the `auto` draft policy
AUTO_METHOD = "auto"
METHOD_CHOICES: tuple[str, ...] = (AUTO_METHOD, *METHODS)
DEFAULT_POLICY = "auto"
# methods that draft from the context alone (and from a prediction, as every method does): no draft_model
DRAFTLESS: tuple[str, ...] = ("none", "ngram", "suffix")
POLICIES: tuple[str, ...] = ("fixed", "heuristic", "auto")
# whether the EAGLE chains (eagle, eagle3, hybrid's) draw a sampling row's drafts from the head's own distribution:
# auto (the default) where that was measured to pay (api.sample_drafts_from), on, off (point masses, the head's argmax)
SAMPLE_DRAFTS: tuple[str, ...] = ("auto", "on", "off")
DEFAULT_SAMPLE_DRAFTS = "auto"
# `auto` samples the EAGLE chains' drafts for rows at this temperature or above. Measured on the mini suite
# (smollm2-135m, both shipped heads, top-p 1; docs/benchmarks.md, Sampled drafts): a sampled first draft's
# expected acceptance exceeded the head's argmax's by 0.03 at 0.7, 0.035-0.043 at 0.85 and 0.095-0.12 at 1.0;
# at 0.3 and 0.5 the two were equal within 0.006, and point masses keep plain sampling's tokens for the seed
AUTO_SAMPLE_FROM = 0.7
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "q4")
MAX_DRAFT_TOKENS = 64
MAX_TOP_LOGPROBS = 20                 # the most alternatives per token's log-probability (OpenAI chat's bound)
PEERS: tuple[str, ...] = ("transformers", "llamacpp")
EXPORT_FORMATS: tuple[str, ...] = ("vllm", "sglang")
BENCH_FALLBACK_DRAFT = "self:10"


def did_you_mean(word: object, options: Iterable[str]) -> str:
    """"did you mean 'x'? " for the closest of `options` to a mistyped `word`, else ""."""
    if not isinstance(word, str):
        return ""                                     # ['none'] is not a typo of 'none'
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def unknown(kind: str, word: object, options: Iterable[str]) -> str:
    """One line for an unknown name: "unknown method 'eagel'; did you mean 'eagle'? choose one of: ..."."""
    options = list(options)
    return f"unknown {kind} {word!r}; {did_you_mean(word, options)}choose one of: {', '.join(options)}"
