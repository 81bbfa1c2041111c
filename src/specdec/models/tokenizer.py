"""Tokenizer and chat template from the same GGUF file (via transformers' GGUF conversion, cached)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from ..errors import SpecdecError
from .registry import cache_dir

END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")


class Tokenizer:
    def __init__(self, hf) -> None:
        self.hf = hf
        vocab = hf.get_vocab()
        ids = {hf.eos_token_id} if hf.eos_token_id is not None else set()
        ids |= {vocab[t] for t in END_OF_TURN if t in vocab}
        self.eos_ids = frozenset(ids)
        self.has_chat_template = bool(getattr(hf, "chat_template", None))

    @staticmethod
    def from_gguf(path: Path) -> "Tokenizer":
        from transformers import AutoTokenizer

        st = path.stat()
        key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        saved = cache_dir() / "tokenizers" / f"{path.stem}-{key}"
        if (saved / "tokenizer_config.json").exists():
            return Tokenizer(AutoTokenizer.from_pretrained(saved, local_files_only=True))
        try:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except Exception as e:
            raise SpecdecError(f"cannot read the tokenizer of {path}: {type(e).__name__}: {e}") from None
        hf.save_pretrained(saved)
        return Tokenizer(hf)

    def encode(self, text: str, chat: bool) -> list[int]:
        if chat:
            if not self.has_chat_template:
                raise SpecdecError("this model has no chat template; use --no-chat / chat=False")
            out = self.hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        return list(self.hf(text)["input_ids"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if not self.has_chat_template:
            raise SpecdecError("this model has no chat template")
        out = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)

    @property
    def vocab(self) -> dict[str, int]:
        return self.hf.get_vocab()
