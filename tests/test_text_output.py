"""Incremental detokenization equals a full decode; stop strings are found across step boundaries."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.detokenize import IncrementalDetokenizer
from specdec.engine import Engine, Request
from specdec.draft_length import make_policy
from specdec.proposers.base import NoProposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.text_output import TextOutput, find_stop, stop_prefix_length

from helpers import tiny_model

TEXT = ("Speculative decoding — naïve café, straße, Größe. 推测解码在一次前向中验证多个草稿。 "
        "Ελληνικά, русский, emoji 🚀🔥👩‍💻 and tabs\tand\nnew lines.  Double  spaces, 1234567.")


def byte_decode(ids: list[int]) -> str:
    """A byte-level tokenizer: token i is byte i (multi-byte characters span several tokens)."""
    return bytes(ids).decode("utf-8", errors="replace")


def sentencepiece_decode(ids: list[int]) -> str:
    """A tokenizer whose decode drops the leading space of its first piece (as SentencePiece does)."""
    words = ["▁the", "▁cat", "s", "▁sat", ".", "▁on", "▁mat", "▁é", "t", "é"]
    return "".join(words[i] for i in ids).replace("▁", " ").removeprefix(" ")


def chunks(ids: list[int], seed: int, most: int = 5) -> list[list[int]]:
    """`ids` cut into random steps of 0..most tokens (a speculative step commits several at once)."""
    r, out, i = random.Random(seed), [], 0
    while i < len(ids):
        n = r.randint(0, most)
        out.append(ids[i:i + n])
        i += n
    return out


def streamed(decode, steps: list[list[int]]) -> tuple[str, list[str]]:
    det = IncrementalDetokenizer(decode)
    pieces = [det.push(step) for step in steps]
    pieces.append(det.flush())
    return "".join(pieces), pieces


@pytest.mark.parametrize("seed", range(5))
def test_byte_level_stream_equals_full_decode_and_holds_partial_characters(seed):
    ids = list(TEXT.encode())
    text, pieces = streamed(byte_decode, chunks(ids, seed))
    assert text == TEXT
    assert all("\ufffd" not in p for p in pieces)           # a character is emitted only once complete


def test_text_before_an_incomplete_character_is_emitted_at_once():
    det = IncrementalDetokenizer(byte_decode)
    assert det.push(list("ab".encode()) + list("é".encode())[:1]) == "ab"
    assert det.push(list("é".encode())[1:]) == "é"


def test_an_incomplete_character_at_the_end_is_flushed_as_a_full_decode_shows_it():
    ids = list("ok 🚀".encode())[:-2]
    det = IncrementalDetokenizer(byte_decode)
    assert det.push(ids) == "ok "
    assert "ok " + det.flush() == byte_decode(ids)


@pytest.mark.parametrize("seed", range(3))
def test_left_context_dependent_decoder_stream_equals_full_decode(seed):
    ids = [0, 1, 2, 3, 4, 5, 0, 6, 7, 8, 9, 0, 1]
    assert streamed(sentencepiece_decode, chunks(ids, seed, 3))[0] == sentencepiece_decode(ids)


WORDS = {256: "▁the", 257: "▁cat", 258: "s", 259: "▁é"}


def byte_fallback_decode(ids: list[int]) -> str:
    """A sentencepiece vocabulary with byte-fallback tokens 0-255, decoded as tokenizers' ByteFallback decoder
    does: a run of byte tokens is one UTF-8 string, or, if not valid as a whole, one U+FFFD per byte."""
    out, run = [], []
    for t in ids + [-1]:
        if 0 <= t < 256:
            run.append(t)
            continue
        if run:
            try:
                out.append(bytes(run).decode("utf-8"))
            except UnicodeDecodeError:
                out.append("\ufffd" * len(run))
            run = []
        out.append(WORDS.get(t, ""))
    return "".join(out).replace("▁", " ")


def test_a_byte_run_that_turns_invalid_is_shown_as_one_decode_shows_it():
    """ "é" as two byte tokens, then a character cut short, then a word: one decode turns all three bytes into
    U+FFFD; the stream may not show "é" before it knows."""
    ids = [0xC3, 0xA9, 0xE3, 257]
    for seed in range(3):
        det = IncrementalDetokenizer(byte_fallback_decode, frozenset(range(256)))
        pieces = [det.push(step) for step in chunks(ids, seed, 2)] + [det.flush()]
        assert "".join(pieces) == byte_fallback_decode(ids) == "\ufffd" * 3 + " cat"


@pytest.mark.parametrize("seed", range(20))
def test_byte_fallback_stream_equals_full_decode(seed):
    r = random.Random(seed)
    pool = list("héllo あ🙂".encode()) + [0xE3, 0x81, 0xFF, 0x80] + list(WORDS)
    ids = [r.choice(pool) for _ in range(r.randint(1, 30))]
    det = IncrementalDetokenizer(byte_fallback_decode, frozenset(range(256)))
    pieces = [det.push(step) for step in chunks(ids, seed, 4)] + [det.flush()]
    assert "".join(pieces) == byte_fallback_decode(ids)


def test_a_stop_string_in_a_byte_run_ends_the_output_at_the_token_completing_it():
    """ "é" as two byte tokens: the stop string is complete at its second byte; the output ends there, not at
    the token that happens to end the run (usage counts the tokens up to the one completing a stop)."""
    out = TextOutput(byte_fallback_decode, ("é",), frozenset(range(256)))
    assert out.feed([257, 0xC3, 0xA9, 0xC3, 0xA9, 258], final=False) == (" cat", 3) and out.stopped
    one_by_one = TextOutput(byte_fallback_decode, ("é",), frozenset(range(256)))
    assert [one_by_one.feed([t], final=False) for t in (257, 0xC3, 0xA9)] == [(" cat", 1), ("", 1), ("", 1)]
    assert one_by_one.stopped
    cut = TextOutput(byte_fallback_decode, ("é",), frozenset(range(256)))   # an incomplete character: not yet
    assert cut.feed([257, 0xC3], final=False) == (" cat", 2) and not cut.stopped


@pytest.mark.parametrize("seed", range(20))
def test_a_stop_ends_the_output_at_the_first_token_whose_decode_holds_it(seed):
    """The token that ends the output is the first n with the stop string in decode(ids[:n]) (the text a
    sequence ended there would have), whatever the byte runs and however the tokens arrive."""
    r = random.Random(seed)
    pool = list("héllo あ🙂".encode()) + [0xE3, 0xFF] + list(WORDS)
    ids = [r.choice(pool) for _ in range(r.randint(1, 30))]
    stop = r.choice(["é", "あ", "🙂", "l", " cat", "s é", "o"])
    expected = next((n for n in range(1, len(ids) + 1) if stop in byte_fallback_decode(ids[:n])), len(ids))
    out = TextOutput(byte_fallback_decode, (stop,), frozenset(range(256)))
    used, text = 0, ""
    for step in chunks(ids, seed, 4):
        piece, n = out.feed(step, final=False)
        used, text = used + n, text + piece
        if out.stopped:
            break
    assert used == expected
    if out.stopped:
        assert text == byte_fallback_decode(ids[:used]).split(stop)[0]


@pytest.mark.integration
@pytest.mark.parametrize("most", [1, 3])
def test_gemma_byte_tokens_stream_equals_full_decode(most):
    from specdec.models.registry import resolve
    from specdec.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(resolve("gemma3-270m")[1])
    assert len(tok.byte_ids) == 256
    r = random.Random(most)
    pool = sorted(tok.byte_ids) + tok.encode(" a cat sat on the mat, 東京", chat=False)[1:]
    for seed in range(200):
        ids = [r.choice(pool) for _ in range(r.randint(1, 12))]
        det = IncrementalDetokenizer(tok.decode, tok.byte_ids)
        pieces = [det.push(step) for step in chunks(ids, seed, most)] + [det.flush()]
        assert "".join(pieces) == tok.decode(ids), ids


@pytest.mark.integration
@pytest.mark.parametrize("most", [1, 3, 6])
def test_real_tokenizer_stream_equals_full_decode(most):
    from specdec.models.registry import resolve
    from specdec.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(resolve("smollm2-135m")[1])
    ids = tok.encode(TEXT * 3, chat=True)
    assert any("\ufffd" in tok.decode([t]) for t in ids)    # some characters span several tokens
    for seed in range(4):
        text, pieces = streamed(tok.decode, chunks(ids, seed, most))
        assert text == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces)


def test_find_stop_and_held_prefix():
    assert find_stop("abcSTOPx", 0, ("STOP",)) == 3
    assert find_stop("abcSTOPx", 5, ("STOP",)) == 3               # starts before `scanned`, ends after it
    assert find_stop("abcdef", 3, ("STOP",)) == 6                 # none: len(text)
    assert find_stop("xxENDyySTOP", 0, ("STOP", "END")) == 2      # the first of several
    assert stop_prefix_length("the ST", ("STOP",)) == 2
    assert stop_prefix_length("the S", ("STOP", "SO")) == 1
    assert stop_prefix_length("the", ("STOP",)) == 0


def feed_text(pieces_of_text: list[str], stops: tuple[str, ...]) -> tuple[list[str], TextOutput]:
    """Feed text (one byte per token) in the given steps; the last step ends the sequence."""
    out = TextOutput(byte_decode, stops)
    emitted = []
    for i, piece in enumerate(pieces_of_text):
        emitted.append(out.feed(list(piece.encode()), final=i == len(pieces_of_text) - 1)[0])
        if out.stopped:
            break
    return emitted, out


def test_stop_string_straddling_steps_is_found_and_held_back():
    emitted, out = feed_text(["Hello ST", "O", "P and more"], ("STOP",))
    assert emitted == ["Hello ", "", ""] and out.stopped          # "ST", "STO" held: they may begin STOP
    emitted, out = feed_text(["Hello ST", "O", "W and more"], ("STOP",))
    assert "".join(emitted) == "Hello STOW and more" and not out.stopped
    assert emitted[:2] == ["Hello ", ""]


def test_stop_string_inside_a_multi_byte_split():
    emitted, out = feed_text(["naïve ", "caf", "é", " end"], ("fé ",))
    assert "".join(emitted) == "naïve ca" and out.stopped


def test_first_of_several_stop_strings_across_steps():
    emitted, out = feed_text(["one EN", "D two STOP"], ("STOP", "END"))
    assert "".join(emitted) == "one " and out.stopped


def test_final_step_flushes_held_prefix():
    emitted, out = feed_text(["abc S", "T"], ("STOP",))
    assert emitted == ["abc ", "ST"] and not out.stopped


class ByteTokenizerEngine:
    """An engine over a 256-token tiny model whose tokens are bytes."""

    @staticmethod
    def run(prompt: list[int], stop: tuple[str, ...], max_new: int = 60, draft: bool = False,
            ) -> tuple[str, list[int], str]:
        """draft: speculate with the target itself as the draft (K = 4, every draft accepted)."""
        target = tiny_model(seed=3, vocab=256)
        proposer = DraftModelProposer(target) if draft else NoProposer()
        eng = Engine(target, proposer, make_policy("fixed", 4 if draft else 1), byte_decode, frozenset())
        eng.allocate(1, len(prompt) + max_new + 8)
        seq = eng.add(Request(prompt, max_new, stop=stop))
        pieces = []
        with torch.inference_mode():
            while eng.busy:
                pieces += [p for _, p in eng.step()]
        return "".join(pieces), seq.generated, seq.finish_reason


def test_engine_text_equals_full_decode_and_cuts_at_a_stop_string():
    prompt = list(b"The engine")
    text, tokens, reason = ByteTokenizerEngine.run(prompt, ())
    assert text == byte_decode(tokens) and reason == "length"
    stop = next(text[i:i + 2] for i in range(5, len(text)) if "\ufffd" not in text[i:i + 2])
    cut, _, reason = ByteTokenizerEngine.run(prompt, (stop,))
    assert reason == "stop" and cut == text[:text.find(stop)]


def test_feed_reports_the_token_that_completes_a_stop_string():
    out = TextOutput(byte_decode, ("STOP",))
    text, used = out.feed(list(b"Hi STOP and more"), final=False)
    assert (text, used) == ("Hi ", 7) and out.stopped
    out = TextOutput(byte_decode, ("STOP",))
    assert out.feed(list(b"no stop here"), final=True) == ("no stop here", 12)


def test_a_stop_string_ends_speculation_at_plain_decodings_token():
    """Several tokens committed in one step: those after the stop string's last token are dropped, so the
    tokens (and the completion count) equal plain decoding's."""
    prompt = list(b"The engine")
    text, tokens, _ = ByteTokenizerEngine.run(prompt, ())
    for i in (5, 9, 14):
        stop = next(text[j:j + 2] for j in range(i, len(text)) if "\ufffd" not in text[j:j + 2])
        plain = ByteTokenizerEngine.run(prompt, (stop,))
        spec = ByteTokenizerEngine.run(prompt, (stop,), draft=True)
        assert spec == plain and plain[2] == "stop"
        assert byte_decode(plain[1]).find(stop) == len(byte_decode(plain[1])) - len(stop)


def test_counters_keep_only_the_drafts_of_tokens_the_output_keeps():
    """A stop string inside a step that accepted every draft: the dropped tokens take their accepted drafts
    with them, so accepted drafts never outnumber the tokens returned (each forward adds at most one)."""
    prompt = list(b"The engine")
    text, _, _ = ByteTokenizerEngine.run(prompt, ())
    for i in (3, 5, 9, 14):
        stop = next(text[j:j + 2] for j in range(i, len(text)) if "\ufffd" not in text[j:j + 2])
        target = tiny_model(seed=3, vocab=256)
        eng = Engine(target, DraftModelProposer(target), make_policy("fixed", 4), byte_decode, frozenset())
        eng.allocate(1, len(prompt) + 68)
        seq = eng.add(Request(prompt, 60, stop=(stop,)))
        with torch.inference_mode():
            while eng.busy:
                eng.step()
        c = seq.counters
        assert seq.finish_reason == "stop" and c.new_tokens == len(seq.generated)
        assert c.accepted < c.new_tokens and c.new_tokens - c.accepted <= c.target_forwards
        assert sum(c.accepted_at) == c.accepted and sum(c.drafted_at) == c.drafted
        assert c.accepted == c.drafted                 # every draft kept was accepted (the draft is the target)
        assert all(c.drafted_at) and c.as_dict()["acceptance_per_position"] == [1.0] * len(c.drafted_at)


def test_positions_only_a_dropped_step_drafted_leave_the_per_position_rates():
    """A first step of 6 drafts cut to 3 kept tokens: positions 4-6 were never drafted for the output, so the
    per-position list ends at position 3 instead of reporting 0.0 there (a rate of nothing)."""
    from specdec.metrics import Counters

    c = Counters()
    c.record_step(6, 6, 7)
    c.drop_last(4)
    assert (c.drafted, c.accepted, c.new_tokens) == (3, 3, 3)
    assert c.as_dict()["acceptance_per_position"] == [1.0, 1.0, 1.0]
    c.record_step(2, 1, 2)
    assert c.as_dict()["acceptance_per_position"] == [1.0, 0.5, 1.0]


def test_prediction_drafts_are_counted_apart_and_follow_a_dropped_step():
    """Steps that drafted from the request's prediction are the prediction's in `own()` and in the
    *_prediction counts, also after the last one is cut; merging keeps them apart too."""
    from specdec.metrics import Counters

    c = Counters()
    c.record_step(3, 1, 2)                             # the method's own: 3 drafted, 1 accepted
    c.record_step(8, 8, 9, predicted=True)             # the prediction's: 8 drafted, all accepted
    assert c.own() == ([1, 1, 1], [1, 0, 0])
    assert (c.accepted_prediction, c.rejected_prediction) == (8, 0)
    c.drop_last(5)                                     # 4 kept: the prediction's positions 5-8 are gone
    assert c.own() == ([1, 1, 1], [1, 0, 0])
    assert (c.accepted_prediction, c.rejected_prediction, c.drafted_at) == (4, 0, [2, 2, 2, 1])
    d = Counters()
    d.record_step(6, 2, 3, predicted=True)
    d.record_step(2, 2, 3)
    c.merge(d)
    assert c.own() == ([2, 2, 1], [2, 1, 0])
    assert (c.accepted_prediction, c.rejected_prediction) == (6, 4)
    assert c.predicted_at == [2, 2, 2, 2, 1, 1] and c.accepted_predicted_at == [2, 2, 1, 1, 0, 0]


def test_a_step_that_ends_on_its_recovered_eos_keeps_every_draft_it_verified():
    """Drafts all rejected, the last step's recovered token the EOS: nothing follows it, so the counters are
    those of the same tokens ended by max_new_tokens with the drafts uncut (K per step)."""
    from helpers import Stateless
    from specdec.verify import Draft

    class Wrong(Stateless):
        name = "wrong"

        def propose(self, batch, k):                   # a token the target never writes after this prompt
            return Draft(torch.full((len(batch.rows), k), 96, dtype=torch.long))

    target = tiny_model(seed=3)
    eng = Engine(target, NoProposer(), make_policy("fixed", 4), lambda ids: "", frozenset())
    eng.allocate(1, 64)
    plain = eng.add(Request([3, 5, 7], 12))
    with torch.inference_mode():
        while eng.busy:
            eng.step()
    eos = plain.generated[6]
    assert eos not in plain.generated[:6] and 96 not in plain.generated[:7]
    eng = Engine(target, Wrong(), make_policy("fixed", 4), lambda ids: "", frozenset({eos}))
    eng.allocate(1, 64)
    seq = eng.add(Request([3, 5, 7], 12))
    with torch.inference_mode():
        while eng.busy:
            eng.step()
    c = seq.counters
    assert seq.finish_reason == "stop" and seq.generated == plain.generated[:7]
    assert c.target_forwards == 7 and c.accepted == 0
    assert c.drafted == 6 * 4 and c.drafted_at == [6, 6, 6, 6]     # 6 steps after the prefill, 4 drafts each


@pytest.mark.integration
def test_gemma_stop_string_spelled_in_byte_tokens_ends_at_its_last_byte():
    from specdec.models.registry import resolve
    from specdec.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(resolve("gemma3-270m")[1])
    ids = tok.encode_text(" 𐀀𐀁𐀂 x")                          # no BOS
    assert all(t in tok.byte_ids for t in ids[1:13])             # " ", three 4-byte characters, " x"
    out = TextOutput(tok.decode, ("𐀀",), tok.byte_ids)
    assert out.feed(ids, final=False) == (" ", 5) and out.stopped



def llama_sentencepiece():
    """A tokenizers tokenizer with the decoder transformers builds for Llama-style SentencePiece GGUFs: its
    Strip drops the leading space of a decoded text's first piece."""
    from tokenizers import Tokenizer, decoders, models

    pieces = ["<unk>", "The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", ",", "▁a", "▁city", "."] + \
        [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return (lambda ids: tok.decode(ids, skip_special_tokens=False)), frozenset(range(11, 11 + 256))


@pytest.mark.parametrize("seed", range(4))
def test_new_tokens_are_decoded_after_the_prompt_as_the_whole_sequence_decodes(seed):
    """A decoder that strips the leading space of a text's first piece (Llama-style SentencePiece) took the space
    before the first new word: the text must be decode(prompt + new) minus decode(prompt), streamed or not, and a
    stop string that begins with that space must match."""
    decode, byte_ids = llama_sentencepiece()
    prompt, new = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    want = decode(prompt + new)[len(decode(prompt)):]
    assert want == " Paris, a city." and decode(new) == "Paris, a city."          # the decoder strips, alone
    out = TextOutput(decode, (), byte_ids, prompt)
    assert "".join(out.feed(step, final=False)[0] for step in chunks(new, seed, 3)) + out.feed([], final=True)[0] == want
    stopped = TextOutput(decode, (" Paris",), byte_ids, prompt)
    assert stopped.feed(new, final=False) == ("", 1)
    det = IncrementalDetokenizer(sentencepiece_decode, context=[0, 1])
    assert "".join(det.push(step) for step in chunks([3, 4, 5, 0, 6], seed, 2)) + det.flush() == " sat. on the mat"


def test_a_prompt_ending_in_byte_tokens_or_a_cut_character_is_no_context():
    """Their text may change with the new tokens, so the new tokens are decoded alone (as before)."""
    decode, byte_ids = llama_sentencepiece()
    det = IncrementalDetokenizer(decode, byte_ids, context=[1, 11 + 0xC3])          # "The" then half of "é"
    assert det.push([6]) + det.flush() == "Paris"
    det = IncrementalDetokenizer(byte_decode, context=list("é".encode())[:1])
    assert det.push(list("ab".encode())) + det.flush() == "ab"
