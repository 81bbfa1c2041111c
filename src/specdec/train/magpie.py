"""Self-generated conversations, Magpie-style: the target writes the users' questions too.

Given only the chat template's opening of a user turn (after a system prompt that steers the
category), the instruct target writes a question, then answers it; some chats get a follow-up
question written the same way and a second answer. Categories with a document in the prompt
(summarization, RAG, translation of given text) are seeded from data-wheel rows the benchmark does
not use. Questions that repeat or nearly repeat a kept one, or share an 8-word run with any
benchmark prompt, are dropped. Rows are stored as token ids in compressed shards
(`magpie-NNNN.npz`, numpy arrays only, no pickle) that later runs extend, never regenerate;
features are recomputed from the ids.
"""
from __future__ import annotations

import io
import random
import re
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..errors import Interrupted, SpecdecError, terminate_as_interrupt
from . import source
from .data import _benchmark_fingerprints, overlaps, training_prompts

CATEGORIES = ("chat", "code", "math", "qa", "summarization", "rag", "translation")
WEIGHTS = (0.34, 0.16, 0.12, 0.10, 0.10, 0.08, 0.10)          # a chat workload, Spec-Bench-like mix
MAGPIE_SHARE = {"chat": 0.9, "code": 0.7, "math": 0.6, "qa": 0.6, "summarization": 0.0, "rag": 0.0,
                "translation": 0.3}
SYSTEMS = {
    "chat": ["You are a helpful assistant. The user asks for creative writing: stories, poems, letters, essays.",
             "You are a helpful assistant. The user asks you to role-play a character or a situation.",
             "You are a helpful assistant. The user asks a reasoning puzzle or a question that needs careful thought.",
             "You are a helpful assistant. The user asks about science, technology or engineering.",
             "You are a helpful assistant. The user asks about history, philosophy, art or society.",
             "You are a helpful assistant. The user asks for advice about everyday life, work or health.",
             "You are a helpful assistant. The user asks you to extract or organise information from a text.",
             "You are a helpful AI assistant."],
    "code": ["You are an expert Python programmer. The user asks you to write or explain a function.",
             "You are a helpful coding assistant. The user asks programming questions about algorithms, "
             "data structures, debugging or Python libraries."],
    "math": ["You are a math tutor. The user asks a math word problem; solve it step by step.",
             "You are a helpful assistant good at arithmetic and algebra. The user asks math questions."],
    "qa": ["You are a knowledgeable assistant. The user asks short factual questions about the world.",
           "You answer trivia questions about people, places, films, sports and history."],
    "translation": ["You are a translator. The user gives an English sentence and asks for its French translation."],
}
SEEDED = {"summarization": ("Summarize the following article",), "rag": ("Based on the passage",),
          "translation": ("Translate into French",), "code": ("Write a Python function",),
          "math": ("Solve this math word problem",), "qa": ("Answer the question", "Answer this medical")}
FOLLOW_UP_SHARE = 0.5                    # chats that get a second user turn
MAX_QUESTION, MAX_ANSWER, MAX_TOKENS = 96, 256, 1280
QSEP = "\x1e"                            # joins a row's questions in a shard


@dataclass
class Conversation:
    category: str
    messages: list[dict]
    tokens: list[int]                    # the whole chat as the target reads it
    answer_mask: list[int]               # 1 where the target wrote an answer token


def seeded_prompts(seed: int) -> dict[str, list[str]]:
    """Wheel-row prompts (never benchmark rows) by category, from `training_prompts`."""
    out: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    for p in training_prompts(seed):
        for cat, marks in SEEDED.items():
            if any(m in p for m in marks):
                out[cat].append(p)
                break
    return out


def _norm_words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class Dedup:
    """Exact and near-duplicate questions (Jaccard of word 3-gram sets >= `threshold`), via an inverted index."""

    def __init__(self, threshold: float = 0.6) -> None:
        self.threshold = threshold
        self.sets: list[set] = []
        self.index: dict[tuple, list[int]] = {}
        self.leak = _benchmark_fingerprints()

    def _grams(self, text: str) -> set:
        w = _norm_words(text)
        return {tuple(w[i:i + 3]) for i in range(max(1, len(w) - 2))}

    def remember(self, text: str) -> None:
        """Index a question kept earlier (checked when it was admitted) without checking it again."""
        self._index(self._grams(text))

    def _index(self, g: set) -> None:
        for gram in g:
            self.index.setdefault(gram, []).append(len(self.sets))
        self.sets.append(g)

    def admit(self, text: str) -> bool:
        """True (and remembered) if `text` is new, not near a kept one and no benchmark overlap."""
        g = self._grams(text)
        if len(_norm_words(text)) < 3 or overlaps(text, self.leak):
            return False
        seen: set[int] = set()
        for gram in g:
            for j in self.index.get(gram, ()):
                if j in seen:
                    continue
                seen.add(j)
                other = self.sets[j]
                if len(g & other) / len(g | other) >= self.threshold:
                    return False
        self._index(g)
        return True


def user_turn_prefix(tok, messages: list[dict]) -> list[int]:
    """The token ids of `messages` followed by the opening of a user turn (template-agnostic: the chat
    is rendered with a marker as the next user message and cut at the marker)."""
    mark = "\u2063MAGPIE\u2063"
    text = tok.render_chat(messages + [{"role": "user", "content": mark}])
    return tok.encode_text(text[:text.index(mark)])


def prompt_mask(tokens: list[int], mask: list[int], prompt: list[int], ends: frozenset[int]) -> list[int]:
    """The answer mask over `prompt`, the conversation so far (`tokens`, answers marked in `mask`) encoded again
    from its text with the next question: where the encoding kept the earlier tokens, their mask; else (an
    answer's text encodes to other tokens than were generated) each earlier answer found again, from where its
    turn's prompt ended through its end-of-turn token."""
    if prompt[:len(tokens)] == tokens:
        return mask + [0] * (len(prompt) - len(tokens))
    out, i, j = [], 0, 0                                # i: in tokens/mask, j: in prompt
    while i < len(tokens):
        if not mask[i]:                                 # template and question tokens are encoded the same
            if j >= len(prompt) or prompt[j] != tokens[i]:
                break
            out.append(0)
            i, j = i + 1, j + 1
            continue
        while i < len(tokens) and mask[i]:              # the generated answer, up to its end-of-turn token
            i += 1
        end = next((k for k in range(j, len(prompt)) if prompt[k] in ends), len(prompt) - 1)
        out += [1] * (end + 1 - j)
        j = end + 1
    return out + [0] * (len(prompt) - len(out))


class MagpieWriter:
    """Writes shards of conversations with generator `gen` (method none)."""

    def __init__(self, gen, out: Path, batch: int, seed: int) -> None:
        self.gen, self.out, self.batch, self.seed = gen, out, batch, seed
        self.tok = gen.tokenizer
        self.dedup = Dedup()
        self.seeded = seeded_prompts(seed)
        files = shard_files(out)
        if files:
            print(f"indexing the questions of {len(files)} shards in {out} (new ones must differ from them)",
                  file=sys.stderr, flush=True)
        for f in files:                                        # questions already kept stay kept
            with open_shard(f) as z:
                for qs in z["questions"]:
                    for q in str(qs).split(QSEP):
                        self.dedup.remember(q)

    def _questions(self, prefixes: list[list[int]], rng: random.Random) -> list[str]:
        res = self.gen.generate(prefixes, max_new_tokens=MAX_QUESTION, temperature=1.0, top_p=0.95,
                                seed=rng.randrange(1 << 30), chat=False)
        return [r.text.strip() if r.finish_reason == "stop" else "" for r in res]

    def _answer(self, convs: list[Conversation], rng: random.Random) -> None:
        temp = 0.0 if rng.random() < 0.7 else 0.7
        prompts = [self.tok.encode_chat(c.messages) for c in convs]
        res = self.gen.generate(prompts, max_new_tokens=MAX_ANSWER, temperature=temp, top_p=0.95,
                                seed=rng.randrange(1 << 30), chat=False)
        for c, p, r in zip(convs, prompts, res):
            c.messages.append({"role": "assistant", "content": r.text})
            c.answer_mask = prompt_mask(c.tokens, c.answer_mask, p, self.tok.eos_ids) + [1] * len(r.tokens)
            c.tokens = p + r.tokens

    def batch_of(self, category: str, rng: random.Random) -> list[Conversation]:
        """Up to `batch` new conversations of one category (fewer if questions were dropped)."""
        n_magpie = sum(rng.random() < MAGPIE_SHARE[category] for _ in range(self.batch)) if category in SYSTEMS else 0
        convs: list[Conversation] = []
        if n_magpie:
            systems = [[{"role": "system", "content": rng.choice(SYSTEMS[category])}] for _ in range(n_magpie)]
            for s, q in zip(systems, self._questions([user_turn_prefix(self.tok, s) for s in systems], rng)):
                if q and self.dedup.admit(q):
                    convs.append(Conversation(category, s + [{"role": "user", "content": q}], [], []))
        pool = self.seeded.get(category, [])
        for _ in range(self.batch - n_magpie if pool else 0):
            q = rng.choice(pool)
            if self.dedup.admit(q):
                convs.append(Conversation(category, [{"role": "user", "content": q}], [], []))
        if not convs:
            return []
        self._answer(convs, rng)
        if category == "chat":
            more = [c for c in convs if rng.random() < FOLLOW_UP_SHARE and len(c.tokens) < MAX_TOKENS // 2]
            if more:
                qs = self._questions([user_turn_prefix(self.tok, c.messages) for c in more], rng)
                kept = [c for c, q in zip(more, qs) if q and self.dedup.admit(q)]
                for c, q in zip(more, qs):
                    if c in kept:
                        c.messages.append({"role": "user", "content": q})
                if kept:
                    self._answer(kept, rng)
        return [c for c in convs if len(c.tokens) <= MAX_TOKENS]

    def write_shard(self, index: int, rows: int, bar: tqdm) -> Path:
        rng = random.Random(self.seed * 1_000_003 + index)
        convs: list[Conversation] = []
        t0, tokens0 = time.perf_counter(), 0
        path = self.out / f"magpie-{index:04d}.npz"
        try:
            while len(convs) < rows:
                cat = rng.choices(CATEGORIES, WEIGHTS)[0]
                got = self.batch_of(cat, rng)
                convs += got
                tokens0 += sum(len(c.tokens) for c in got)
                bar.update(len(got))
                bar.set_postfix(shard=index, tokens_per_s=f"{tokens0 / (time.perf_counter() - t0):.0f}")
        except KeyboardInterrupt:                  # Ctrl-C or SIGTERM: the conversations so far, as a smaller shard
            bar.close()
            if convs:
                save_shard(path, convs)
                raise Interrupted(f"kept {len(convs)} conversations in {path}; the next run appends after it") from None
            raise
        return save_shard(path, convs[:rows])


def save_shard(path: Path, convs: list[Conversation]) -> Path:
    """Token ids (uint16 or int32), per-token answer mask, row offsets and categories; atomic."""
    toks = np.concatenate([np.asarray(c.tokens, dtype=np.int64) for c in convs])
    dtype = np.uint16 if toks.max() < 65536 else np.int32
    offsets = np.cumsum([0] + [len(c.tokens) for c in convs]).astype(np.int64)
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, tokens=toks.astype(dtype), answer_mask=np.concatenate(
        [np.asarray(c.answer_mask, dtype=np.uint8) for c in convs]), offsets=offsets,
        category=np.asarray([c.category for c in convs]),
        questions=np.asarray([QSEP.join(m["content"] for m in c.messages if m["role"] == "user") for c in convs]))
    tmp.replace(path)                                        # a shard is whole or absent
    return path


@dataclass(frozen=True)
class Row:
    tokens: list[int]
    answer_mask: list[int]
    category: str
    key: str                             # shard name and row number: stable across runs

    @property
    def validation(self) -> bool:
        """Every 20th row (by a hash of its key) is held out for validation."""
        import zlib

        return zlib.crc32(self.key.encode()) % 20 == 0


SHARD_NAME = re.compile(r"magpie-(\d+)\.npz")     # magpie-0007.npz (not a writer's magpie-0007.tmp.npz)


def shard_files(path: Path) -> list[Path]:
    """The shard files in `path`, by number."""
    found = [f for f in Path(path).glob("magpie-*.npz") if SHARD_NAME.fullmatch(f.name)]
    return sorted(found, key=lambda f: int(SHARD_NAME.fullmatch(f.name)[1]))


def next_shard(path: Path) -> int:
    """The number of the next shard written to `path`: after the last one (gaps are never filled)."""
    kept = shard_files(path)
    return int(SHARD_NAME.fullmatch(kept[-1].name)[1]) + 1 if kept else 0


def open_shard(f: Path):
    """np.load of a shard (read whole: a shard is small, and np.load left a file it could not parse open), or a
    one-line error naming it (truncated, not a shard)."""
    try:
        return np.load(io.BytesIO(f.read_bytes()), allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise unreadable(f, e) from None


def unreadable(f: Path, e: Exception) -> SpecdecError:
    return SpecdecError(f"{f} is not a readable shard ({type(e).__name__}: {e}); move it away or delete it")


def shard_defect(toks: np.ndarray, mask: np.ndarray, off: np.ndarray, cat: np.ndarray) -> str:
    """What makes a shard's arrays not a shard ("" where nothing does): the layout `write_shard` writes."""
    if toks.ndim != 1 or not np.issubdtype(toks.dtype, np.integer) or (toks.size and int(toks.min()) < 0):
        return "tokens must be one array of non-negative integer ids"
    if mask.shape != toks.shape:
        return f"answer_mask has {mask.size} entries for {toks.size} tokens"
    if cat.ndim != 1 or off.ndim != 1 or not np.issubdtype(off.dtype, np.integer) or len(off) != len(cat) + 1:
        return f"offsets must be one integer array of rows + 1 = {len(cat) + 1} entries, got {off.shape}"
    if len(off) and (int(off[0]) != 0 or int(off[-1]) != toks.size or bool((np.diff(off) < 0).any())):
        return f"offsets must rise from 0 to the {toks.size} tokens"
    return ""


def no_shards(data: Path) -> SpecdecError:
    """The error for --data that holds no shards: not there, not a folder, or a folder without them."""
    if not data.exists():
        return SpecdecError(f"--data {data} not found")
    if not data.is_dir():
        return SpecdecError(f"--data {data} is a file; give the folder of magpie-*.npz shards")
    return SpecdecError(f"no magpie-*.npz shards in {data}; write some with `specdec train magpie`")


def read_shards(path: Path) -> list[Row]:
    """Every row of the `magpie-*.npz` shards in `path` (none: an empty list)."""
    rows: list[Row] = []
    for f in shard_files(Path(path)):
        z = open_shard(f)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise unreadable(f, ValueError("one array, not an .npz archive of tokens, answer_mask, offsets, category"))
        with z:
            try:
                toks, mask, off, cat = z["tokens"], z["answer_mask"], z["offsets"], z["category"]
            except (KeyError, ValueError, OSError, zipfile.BadZipFile) as e:
                raise unreadable(f, e) from None
        why = shard_defect(toks, mask, off, cat)
        if why:
            raise unreadable(f, ValueError(why))
        toks = toks.astype(np.int64)
        for i in range(len(cat)):
            a, b = int(off[i]), int(off[i + 1])
            rows.append(Row(toks[a:b].tolist(), mask[a:b].tolist(), str(cat[i]), f"{f.stem}/{i}"))
    return rows


def generate_magpie(model: str, out: Path, shards: int, rows_per_shard: int, batch: int, seed: int,
                    threads: int = 0) -> Path:
    """Append `shards` new shards of `rows_per_shard` conversations to `out` (resumes after the last one)."""
    import torch

    import specdec

    if threads > 0:
        torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    gen = specdec.load(model, method="none", dtype="auto")
    if not gen.tokenizer.has_chat_template:
        raise SpecdecError(f"{model} has no chat template: Magpie-style data needs an instruct model")
    source.record(out, gen.name, gen.tokenizer)
    writer = MagpieWriter(gen, out, batch, seed)
    first = next_shard(out)
    bar = tqdm(total=shards * rows_per_shard, desc="conversations", unit="conv")
    with terminate_as_interrupt():
        for i in range(first, first + shards):
            path = writer.write_shard(i, rows_per_shard, bar)
            tqdm.write(f"wrote {path}", file=sys.stderr)
    bar.close()
    return out


def summary(path: Path) -> dict:
    """Rows, tokens and answer tokens per category of the shards in `path`."""
    rows = read_shards(path)
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        d = out.setdefault(r.category, {"rows": 0, "tokens": 0, "answer_tokens": 0, "validation_rows": 0})
        d["rows"] += 1
        d["tokens"] += len(r.tokens)
        d["answer_tokens"] += sum(r.answer_mask)
        d["validation_rows"] += r.validation
    return out

