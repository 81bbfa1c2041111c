"""Text of a growing token sequence, decoded incrementally (constant work per new token).

Decoding every token again at every step costs O(n) per step, O(n^2) per output. Instead only a
window of recent tokens is decoded, the way vLLM's and transformers' text streamers do it: the text
of the new tokens is decode(window + new) minus decode(window), where the window is the tokens of
the previous emission. A tokenizer whose pieces depend on their left context (a leading space
dropped at the start, say) gives both decodes the same start, so the difference is exact. Text
ending in U+FFFD (bytes of a character still incomplete) is held back until the character
completes; `flush` gives whatever is left as a full decode shows it.

Byte-fallback tokens (`<0xE3>`, sentencepiece vocabularies such as Gemma's) break "decode(window + new)
starts with decode(window)": the decoder spells a run of them as one UTF-8 string and, if the run is not
valid UTF-8 as a whole, every byte of it as U+FFFD, characters already valid included. So the text of a
trailing run of byte tokens is held back until a token that is not a byte token ends the run (or `flush`):
the run is then decoded whole, as one decode of everything decodes it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

REPLACEMENT = "\ufffd"      # what a decoder shows for the bytes of an incomplete character
CONTEXT = 4                 # tokens of the context that start the window (a decoder's left context is short)


class IncrementalDetokenizer:
    """Decodes tokens as they arrive; the concatenated output equals one decode of all of them."""

    def __init__(self, decode: Callable[[list[int]], str], byte_ids: frozenset[int] = frozenset(),
                 context: Sequence[int] = ()) -> None:
        """byte_ids: the tokenizer's byte-fallback tokens (see the module's docstring). context: the tokens
        before the first new one (a prompt), whose last few start the window, so the first new token is decoded
        after them as in a decode of the whole sequence (a tokenizer that drops the leading space of a text's
        first piece keeps it there). A context ending in a byte-fallback token or an incomplete character is
        not used: its text could change with the new tokens."""
        self.decode, self.byte_ids = decode, byte_ids
        tail = list(context[-CONTEXT:])
        if tail and (tail[-1] in byte_ids or decode(tail).endswith(REPLACEMENT)):
            tail = []
        self.ids: list[int] = tail
        self.prefix_offset = 0          # the window: ids[prefix_offset:read_offset], emitted already
        self.read_offset = len(tail)    # ids from here on are (partly) new
        self.shown = 0                  # characters after the window's text emitted already (before a
                                        # character still incomplete)

    def push(self, ids: list[int]) -> str:
        """Add tokens; the text they complete (a character still incomplete at the end is held back)."""
        self.ids.extend(ids)
        return self._advance(hold_partial=True)

    def flush(self) -> str:
        """The text of every token not emitted yet, an incomplete character shown as U+FFFD."""
        return self._advance(hold_partial=False)

    @property
    def in_byte_run(self) -> bool:
        """The last token is a byte-fallback token: the text of its run is held back."""
        return bool(self.ids) and self.ids[-1] in self.byte_ids

    def peek(self) -> str:
        """The text `flush` would give now, without giving it; "" where it holds U+FFFD (the bytes of a
        character still incomplete). Ending the sequence here makes exactly this text final."""
        if self.read_offset == len(self.ids):
            return ""
        window = self.decode(self.ids[self.prefix_offset:self.read_offset])
        rest = self.decode(self.ids[self.prefix_offset:])[len(window) + self.shown:]
        return "" if REPLACEMENT in rest else rest

    def _advance(self, hold_partial: bool) -> str:
        upto = len(self.ids)
        while hold_partial and upto > self.read_offset and self.ids[upto - 1] in self.byte_ids:
            upto -= 1                   # a run of byte tokens still open: its text may yet change
        if self.read_offset == upto:
            return ""
        window = self.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.decode(self.ids[self.prefix_offset:upto])
        start = len(window) + self.shown
        end = len(text.rstrip(REPLACEMENT)) if hold_partial else len(text)
        if end <= start:
            return ""                   # nothing visible yet, or only bytes of an incomplete character
        if end == len(text):            # everything decoded: the new tokens become the window
            self.prefix_offset, self.read_offset, self.shown = self.read_offset, upto, 0
        else:                           # text before an incomplete character: shown, the window stays
            self.shown = end - len(window)
        return text[start:end]
