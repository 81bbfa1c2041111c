"""Log-probabilities of the generated tokens under the target's own distribution.

Verification computes the target's logits for every position it commits (the pending token's row decides the
first new token, each accepted draft's row the next), so reporting a token's log-probability costs a
log-softmax over that one row. It is the model's distribution, before temperature, top-k and top-p (what
`logprobs` means in OpenAI's API and vLLM's): the same numbers whichever tokens were sampled with.

Each row is taken alone: the target's rows keep their bits whatever the row count of the forward that
scored them, so a token's log-probability is the same bits under every method, draft length and batch as
under plain decoding (tests/test_logprobs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import SpecdecError
from .names import MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id, its log-probability, and the most likely tokens at its position."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]       # (id, log-probability), most likely first; as many as asked


def token_text(raw: bytes) -> str:
    """A token's bytes as the text logprobs show: the text, or `bytes:\\xe6\\x97` where they are not whole
    UTF-8 (a piece of a character), as OpenAI writes such tokens, so that pieces stay apart."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def check_top_logprobs(top: object, name: str = "top_logprobs") -> int:
    """`top` as the number of alternatives to report, refused unless an integer in [0, MAX_TOP_LOGPROBS]."""
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise SpecdecError(f"{name} must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}")
    return top


def most_likely(lp: Tensor, top: int) -> tuple[tuple[int, float], ...]:
    """lp [V] -> the `top` most likely (id, log-probability), most likely first and, among equal values, the lowest
    id first (as greedy decoding's argmax picks; 4-bit models tie often)."""
    floor = torch.topk(lp, top).values[-1]
    ids = (lp >= floor).nonzero()[:, 0]                                        # [>= top] ascending ids
    order = torch.sort(lp[ids], descending=True, stable=True).indices[:top]   # ties keep ascending ids
    return tuple(zip(ids[order].tolist(), lp[ids[order]].tolist()))


def token_logprobs(logits: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits [n, V]: the target's rows that decided `tokens` (n of them) -> each token's log-probability and
    its position's `top` most likely tokens."""
    out = []
    for row, token in zip(logits, tokens):
        lp = torch.log_softmax(row.float(), -1)                               # [V] one row alone
        alts = ()
        if top:
            alts = most_likely(lp, top)
        out.append(TokenLogprob(token, float(lp[token]), alts))
    return out
