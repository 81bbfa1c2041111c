"""Tokenizer and chat template from the same GGUF file.

The GGUF's vocabulary is converted once by transformers and saved as `tokenizer.json` plus the chat
template under the cache directory; every later load reads that with `tokenizers` and renders the
template with jinja2 as transformers does (sandboxed, trim_blocks, lstrip_blocks, the special tokens
as variables, its `tojson`, `strftime_now` and `{% generation %}`), without importing transformers (seconds of start-up).
`tests/test_tokenizer.py` checks encode, decode and chat against transformers' own tokenizer.
"""
from __future__ import annotations

import itertools
import json
import logging
import re
import secrets
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from ..errors import SpecdecError
from .registry import cache_dir, file_digest, file_mode, file_sha256, sweep_stale

# tokens that end a generation besides the eos_token (llama.cpp's end-of-generation set holds them too)
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>")
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")                 # a byte-fallback token's spelling
HEX_DIGITS = "0123456789ABCDEFabcdef"


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes (GPT-2's table, which byte-level vocabularies are written in): printable
    Latin-1 bytes stand for themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_LEVEL = _byte_level_alphabet()                               # character -> the byte it spells


def _raise(message: str) -> None:
    raise SpecdecError(f"chat template: {message}")


def _tojson(x, ensure_ascii: bool = False, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson` filter for templates (no HTML escaping; its options)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_tag():
    """`{% generation %}...{% endgeneration %}` (templates that mark the assistant's text for training, as
    transformers parses them): rendered as its body."""
    import jinja2.ext

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


class Tokenizer:
    def __init__(self, backend, chat_template: str, special: dict[str, str]) -> None:
        """backend: a `tokenizers.Tokenizer`; chat_template: jinja source ("" if none); special: the
        special tokens by role (bos_token, eos_token, ...)."""
        self.backend, self.special = backend, special
        # looked up one by one: the whole vocabulary as a dict took 40-100 ms of every start
        def ids_of(texts: Iterable[str]) -> set[int]:
            return {i for i in map(backend.token_to_id, texts) if i is not None}

        self.eos_ids = frozenset(ids_of([special.get("eos_token", ""), *END_OF_TURN]))
        self.bos_id = min(ids_of([special.get("bos_token", "")]), default=-1)   # -1: the model has none
        # byte-fallback tokens (`<0xE3>`, any case): the decoder spells a run of them as one UTF-8 string, so their
        # text may change with the tokens after them (detokenize.py holds it back until the run ends)
        self.byte_ids = frozenset(ids_of(f"<0x{a}{b}>" for a, b in itertools.product(HEX_DIGITS, repeat=2)))
        self._control = sorted((t.content for t in backend.get_added_tokens_decoder().values() if t.special and t.content),
                               key=len, reverse=True)                           # control tokens' texts, longest first
        self._literal = None                       # a copy that encodes control tokens' texts as plain text
        self.has_chat_template = bool(chat_template)
        self._template = None
        self._bytes: dict[int, bytes] = {}         # token id -> its bytes, filled as asked (token_bytes)
        if chat_template:
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols, _generation_tag()])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(chat_template)
            except jinja2.TemplateError as e:
                raise SpecdecError(f"the model's chat template does not compile: {type(e).__name__}: {e}") from None

    @staticmethod
    def from_gguf(path: Path) -> "Tokenizer":
        """The tokenizer of a GGUF file (converted by transformers on first use, then cached)."""
        saved = saved_dir(path)
        if not intact(saved):
            discard(saved)
            logging.getLogger("specdec").info("converting the tokenizer of %s (once; kept in %s) ...", path.name,
                                              saved.parent)
            convert_gguf_tokenizer(path, saved)
        return Tokenizer.from_dir(saved)

    @staticmethod
    def from_dir(saved: Path) -> "Tokenizer":
        """A tokenizer saved by transformers' `save_pretrained` (tokenizer.json and its config)."""
        from tokenizers import Tokenizer as Backend

        config = json.loads((saved / "tokenizer_config.json").read_text(encoding="utf-8"))
        template_file = saved / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.exists() else config.get("chat_template") or ""
        special = {k: _token_text(config[k]) for k in SPECIAL_KEYS if config.get(k)}
        return Tokenizer(Backend.from_file(str(saved / "tokenizer.json")), template, special)

    def render_chat(self, messages: list[dict]) -> str:
        """The chat template applied to `messages`, with the assistant's turn opened."""
        if self._template is None:
            raise SpecdecError("this model has no chat template; use --no-chat / chat=False")
        return self._template.render(messages=messages, add_generation_prompt=True, tools=None, documents=None,
                                     **self.special)

    def encode(self, text: str, chat: bool) -> list[int]:
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        return self._ids(text, True)

    def encode_text(self, text: str) -> list[int]:
        """`text`'s ids as a continuation: no special tokens added (a predicted output, a draft's text)."""
        return self._ids(text, False)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The rendered chat's token ids. Message text is plain text, as OpenAI's API treats it: a control
        token's text typed in it (`<|im_end|>`, `<|im_start|>system`) is encoded as ordinary text, never as the
        control token, so no message can open or close turns of its own; the template's own control tokens
        stay (a raw prompt, `encode(text, chat=False)`, keeps them too)."""
        found = [t for t in self._control if any(t in m["content"] for m in messages if isinstance(m.get("content"), str))]
        if not found:
            return self._ids(self.render_chat(messages), False)
        mark = f"\x00{secrets.token_hex(8)}:"                      # stands for a control text inside a message
        pattern = re.compile("|".join(re.escape(t) for t in found))
        marked = [{**m, "content": pattern.sub(lambda x: f"{mark}{found.index(x.group(0))}\x00", m["content"])}
                  if isinstance(m.get("content"), str) else m for m in messages]
        pieces = re.split(re.escape(mark) + r"(\d+)\x00", self.render_chat(marked))   # text, index, text, ...
        if self._literal is None:
            from tokenizers import Tokenizer as Backend

            literal = Backend.from_str(self.backend.to_str())
            literal.encode_special_tokens = True
            self._literal = literal                 # set whole: another thread may encode meanwhile
        ids = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids += self._literal.encode_batch([found[int(piece)]], add_special_tokens=False)[0].ids
            elif piece:
                ids += self._ids(piece, False)
        return ids

    def _ids(self, text: str, special: bool) -> list[int]:
        """`text`'s token ids, through `encode_batch`: it releases the GIL while it runs (`encode` holds it: a
        megabyte of text stalled a server's streams for about a second)."""
        return self.backend.encode_batch([text], add_special_tokens=special)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 bytes one token spells by itself (a leading space included; a piece of a character: its
        bytes alone; a control token: its text), as OpenAI's logprobs give them."""
        found = self._bytes.get(token)
        if found is not None:
            return found
        piece = self.backend.id_to_token(token) or ""
        byte = BYTE_TOKEN.fullmatch(piece)
        decoder = self.backend.decoder
        if byte:
            out = bytes([int(byte.group(1), 16)])
        else:
            text = decoder.decode(["a", piece])[1:] if decoder is not None and piece else piece  # "a": keeps a lead space
            if "\ufffd" in text and piece and all(c in BYTE_LEVEL for c in piece):
                out = bytes(BYTE_LEVEL[c] for c in piece)                             # a byte-level piece of a character
            else:
                out = text.encode("utf-8")
        self._bytes[token] = out
        return out

    @property
    def vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)


def saved_dir(path: Path) -> Path:
    """Where the converted tokenizer of the GGUF file `path` is kept: keyed by the file's SHA-256, so a file
    rewritten in place gets its own, and copies or links of one file share one."""
    digest = file_sha256(path)[:16]
    folder = cache_dir() / "tokenizers"
    same = sorted(p for p in folder.glob(f"*-{digest}") if not p.name.startswith(".")) if folder.is_dir() else []
    return same[0] if same else folder / f"{path.stem}-{digest}"


MANIFEST = "manifest.json"       # in a converted tokenizer's folder: the sha256 of each file written with it


def intact(saved: Path) -> bool:
    """Whether the converted tokenizer in `saved` is whole: every file its manifest lists, with its bytes."""
    try:
        listed = json.loads((saved / MANIFEST).read_text(encoding="utf-8"))
        return (isinstance(listed, dict) and "tokenizer.json" in listed
                and all(file_digest(saved / name) == sha for name, sha in listed.items()))
    except (OSError, ValueError):
        return False


def discard(saved: Path) -> None:
    """Move a damaged or unverifiable converted tokenizer out of the way (another process may do so too)."""
    import shutil
    import uuid

    if saved.exists():
        aside = saved.with_name(f".tmp-{uuid.uuid4().hex}")
        try:
            saved.rename(aside)
        except OSError:
            return
        shutil.rmtree(aside, ignore_errors=True)


def _token_text(entry) -> str:
    return entry["content"] if isinstance(entry, dict) else str(entry)


def convert_gguf_tokenizer(path: Path, saved: Path) -> None:
    """Convert a GGUF's tokenizer with transformers and save it to `saved` (written whole, then renamed)."""
    import shutil
    import tempfile

    def cannot_write(e: BaseException) -> SpecdecError:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return SpecdecError(f"cannot write the converted tokenizer to {saved.parent} (the cache: $SPECDEC_CACHE): {why}")

    try:                                  # the folder first: no conversion (seconds) where nothing can be kept
        saved.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale(saved.parent)
        tmp = Path(tempfile.mkdtemp(dir=saved.parent, prefix=".tmp-"))
        tmp.chmod(file_mode(0o777))                   # as mkdir would make it (mkdtemp: owner only)
    except OSError as e:
        raise cannot_write(e) from None
    try:
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except Exception as e:
            raise SpecdecError(f"cannot read the tokenizer of {path}: {type(e).__name__}: {e}") from None
        try:
            hf.save_pretrained(tmp)
        except Exception as e:            # OSError, or the tokenizers library's own error for a full disk
            raise cannot_write(e) from None
        if not (tmp / "tokenizer.json").exists():
            raise SpecdecError(f"the tokenizer of {path} has no fast (tokenizers) form")
        listed = {f.name: file_digest(f) for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / MANIFEST).write_text(json.dumps(listed, indent=1), encoding="utf-8")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise cannot_write(e) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(saved)
    except OSError:                       # another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
