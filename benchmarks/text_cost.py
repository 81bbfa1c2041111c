"""The engine's text path per step (EOS and length check, detokenization, stop strings) over a long output.

Real text with multi-byte characters (accents, CJK, Greek, emoji) is tokenized with the smollm2 tokenizer
and committed to one sequence N tokens at a time, as decoding steps would; each step runs the engine's end
check and text emission. A cost that grows with the output's length shows as a gap between the first and
the last 100 steps.

    .venv/bin/python benchmarks/text_cost.py [--tokens 2000] [--per-step 1 4]
"""
from __future__ import annotations

import argparse
import time

from specdec.draft_length import make_policy
from specdec.engine import Engine, Request, SequenceState
from specdec.models.config import ModelConfig
from specdec.models.decoder import Transformer
from specdec.models.registry import resolve
from specdec.models.tokenizer import Tokenizer
from specdec.proposers.base import NoProposer
from specdec.text_output import TextOutput

TEXT = ("Speculative decoding drafts tokens cheaply and verifies them in one pass. "
        "Les modèles génèrent du texte — naïvement, token par token. 推测解码在一次前向中验证多个草稿。 "
        "Ελληνικά κείμενα, emoji 🚀🔥 and ümlauts: straße, Größe.\n")
STOPS = ("<|stop|>", "THE END")


def run(eng: Engine, decode, ids: list[int], per_step: int) -> tuple[float, float, float]:
    """(seconds in all, seconds per step over the first 100 steps, over the last 100)."""
    req = Request([1], len(ids), stop=STOPS)
    seq = SequenceState(req, 0, TextOutput(decode, req.stop), [1], read=1)
    marks, pieces = [], []
    for i in range(0, len(ids), per_step):
        marks.append(time.perf_counter())
        seq.tokens.extend(ids[i:i + per_step])
        eng._check_end(seq, len(seq.tokens) - len(ids[i:i + per_step]))
        pieces.append(eng._emit(seq))
    marks.append(time.perf_counter())
    assert "".join(pieces) == decode(ids), "the streamed text differs from a full decode"
    return marks[-1] - marks[0], (marks[100] - marks[0]) / 100, (marks[-1] - marks[-101]) / 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--per-step", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    tok = Tokenizer.from_gguf(resolve("smollm2-135m")[1])
    ids = tok.encode(TEXT * (a.tokens // 40 + 1), chat=False)[:a.tokens]
    stub = Transformer(ModelConfig(vocab_size=49152, dim=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8,
                                   hidden_dim=8, max_seq_len=a.tokens + 16))      # the engine needs a target
    eng = Engine(stub, NoProposer(), make_policy("fixed", 1), tok.decode, tok.eos_ids)
    for n in a.per_step:
        total, first, last = min(run(eng, tok.decode, ids, n) for _ in range(a.repeats))
        print(f"{n} token(s) per step: {total * 1e3:.0f} ms per {len(ids):,}-token output; per step: "
              f"first 100 {first * 1e6:.0f} us, last 100 {last * 1e6:.0f} us")


if __name__ == "__main__":
    main()
