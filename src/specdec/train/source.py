"""Which model's tokenizer wrote a data folder: `model.json` beside its shards.

Shards hold token ids, which mean something only under the tokenizer that wrote them. `train data` and
`train magpie` record the writing model's name and a fingerprint of its tokenizer (its vocabulary size and the
ids of a fixed probe text); training refuses a folder written under another tokenizer, which the id range alone
does not catch where the other vocabulary is the smaller one. Folders without the file (older data) are
checked by their ids' range only.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecdecError

SOURCE = "model.json"
PROBE = "Speculative decoding, 2026:\n\tdef f(x): return x**2  # ünïcödé 漢字 🙂 <b>done</b>"


def fingerprint(model: str, tokenizer) -> dict:
    """What identifies the token ids `tokenizer` writes (a `Tokenizer`), with the model's name."""
    return {"model": model, "vocab_size": len(tokenizer.vocab), "probe": tokenizer.encode_text(PROBE)}


def _file(data: Path) -> Path:
    return (data if data.is_dir() else data.parent) / SOURCE


def recorded(data: Path) -> dict | None:
    """The fingerprint recorded for the folder `data` (or a file's folder); None for a folder without one."""
    f = _file(data)
    if not f.is_file():
        return None
    try:
        rec = json.loads(f.read_text(encoding="utf-8"))
        if not (isinstance(rec, dict) and {"model", "vocab_size", "probe"} <= rec.keys()):
            raise ValueError("keys model, vocab_size, probe expected")
    except (OSError, ValueError) as e:
        raise SpecdecError(f"{f} does not say which model wrote the data ({e}); remove it or fix it") from None
    return rec


def check(data: Path, model: str, tokenizer) -> None:
    """A one-line error where the data in `data` was written under another tokenizer than `model`'s."""
    rec = recorded(data)
    if rec is None:
        return
    mine = fingerprint(model, tokenizer)
    if rec["vocab_size"] != mine["vocab_size"] or rec["probe"] != mine["probe"]:
        raise SpecdecError(f"{data} holds token ids written by {rec['model']}, whose tokenizer is not {model}'s "
                           f"(see {_file(data)}): train on data written by {model} (train data / train magpie "
                           f"--model {model})")


def record(out: Path, model: str, tokenizer) -> None:
    """Record in the folder `out` that `model` writes its shards; a one-line error where another tokenizer's
    shards are there already (checked before any work)."""
    check(out, model, tokenizer)
    f = _file(out)
    if not f.is_file():
        f.write_text(json.dumps(fingerprint(model, tokenizer), ensure_ascii=False) + "\n", encoding="utf-8")
