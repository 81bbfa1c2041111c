"""A sequence's emitted text: decoded incrementally, cut at the first stop string.

Each step looks at the new text only. Text that could still begin a stop string (a proper prefix of
one at the end) is held back until the next tokens decide; a stop string may straddle the boundary
between what was held and what is new, so the search starts len(stop) - 1 characters before it.
The text of a run of byte-fallback tokens is held back by the detokenizer until the run ends; a stop
string is still found at the byte token that completes it, in the run's text as it would stand if the
sequence ended there.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

from .detokenize import IncrementalDetokenizer


def find_stop(text: str, scanned: int, stops: tuple[str, ...]) -> int:
    """The first index of a stop string in `text`, where text[:scanned] held none; len(text) if none."""
    found = len(text)
    for stop in stops:
        at = text.find(stop, max(0, scanned - len(stop) + 1))
        if 0 <= at < found:
            found = at
    return found


def stop_prefix_length(text: str, stops: tuple[str, ...]) -> int:
    """The longest end of `text` that is a proper prefix of a stop string (0: none)."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return hold


class TextOutput:
    """The text of one sequence's new tokens, piece by piece, up to its first stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...],
                 byte_ids: frozenset[int] = frozenset(), context: Sequence[int] = ()) -> None:
        """context: the prompt's tokens, after which the new ones are decoded (see IncrementalDetokenizer)."""
        self.detokenizer = IncrementalDetokenizer(decode, byte_ids, context)
        self.stops = stops
        self.held = ""                 # decoded, not emitted: it may begin a stop string
        self.stopped = False           # a stop string was found: the text ends before it

    def feed(self, ids: list[int], final: bool) -> tuple[str, int]:
        """The text to emit for the new tokens `ids` (`final`: the sequence ends with them, nothing held) and
        how many of them it used: all, or those up to the one whose text completes a stop string. Tokens are
        read one at a time, so the output ends at the same token however many a step committed (plain
        decoding commits one per step, speculation several)."""
        pieces = []
        for n, token in enumerate(ids, 1):
            pieces.append(self._feed([token], final and n == len(ids)))
            if self.stopped:
                return "".join(pieces), n
        if not ids:
            pieces.append(self._feed([], final))
        return "".join(pieces), len(ids)

    def _feed(self, ids: list[int], final: bool) -> str:
        new = self.detokenizer.push(ids)
        if final:
            new += self.detokenizer.flush()
        text = self.held + new
        at = find_stop(text, len(self.held), self.stops)
        if self.stops and at == len(text) and not final and self.detokenizer.in_byte_run:
            ahead = text + self.detokenizer.peek()     # a stop spelled in the run's bytes ends the output here
            in_run = find_stop(ahead, len(text), self.stops)
            if in_run < len(ahead):
                text, at = ahead, in_run
        if at < len(text):
            self.stopped, self.held = True, ""
            return text[:at]
        hold = 0 if final else stop_prefix_length(text, self.stops)
        self.held = text[len(text) - hold:]
        return text[:len(text) - hold]
