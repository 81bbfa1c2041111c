"""Training prompts never contain benchmark prompts; the check has teeth; train CLI refuses bad input."""
from __future__ import annotations

import pytest

from specdec.bench import suites
from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.train.data import _benchmark_fingerprints, overlaps, training_prompts


def test_no_benchmark_prompt_in_training_data():
    fp = _benchmark_fingerprints()
    prompts = training_prompts()
    assert len(prompts) > 5000
    assert not [p for p in prompts if overlaps(p, fp)]
    bench = {t for p in suites.load_suite("full") for t in p.turns}
    assert not bench & set(prompts)


def test_leak_check_catches_a_benchmark_prompt():
    fp = _benchmark_fingerprints()
    caught = 0
    for p in suites.load_suite("mini"):
        if len(p.turns[0].split()) >= 12:
            caught += overlaps("Please help: " + p.turns[0], fp)
            assert overlaps("Please help: " + p.turns[0], fp), p.id
    assert caught >= 10


@pytest.mark.parametrize("argv, msg", [
    (["train", "eagle", "--model", "gpt-5", "--out", "x.safetensors"], "unknown target"),
    (["train", "draft", "--model", "gpt-5", "--out", "x.safetensors"], "unknown target"),
    (["train", "eagle3", "--model", "smollm2-135", "--out", "x.safetensors"], "did you mean 'smollm2-135m'?"),
    (["train", "draft", "--out", "x.safetensors", "--layers", "first,last"], "comma-separated layer numbers"),
    (["train", "eagle", "--out", "x.safetensors", "--minutes", "0"], "--minutes must be > 0"),
    (["train", "medusa", "--out", "x.safetensors", "--heads", "-1"], "--heads must be > 0"),
    (["train", "medusa", "--out", "x.safetensors", "--heads", "8", "--window", "8"], "no position for head 8"),
    (["train", "eagle3", "--out", "x.safetensors", "--init", "/tmp"], "--init /tmp is a folder (an export?)"),
    (["train", "draft", "--out", "x.safetensors", "--max-rows", "-5"], "--max-rows must be >= 0"),
    (["train", "data", "--batch", "0"], "--batch must be > 0"),
    (["train", "eagle3", "--out", "x.safetensors", "--target-temperature", "0"], "--target-temperature must be > 0"),
    (["train", "eagle3", "--out", "x.safetensors", "--prompt-weight", "-1"], "--prompt-weight must be >= 0"),
    (["train", "eagle3", "--out", "x.safetensors", "--mlp-width", "-5"], "--mlp-width must be >= 0"),
    (["train", "eagle3", "--out", "x.safetensors", "--threads", "-2"], "argument --threads: must be an integer >= 0, got -2"),
    (["train", "eagle3", "--out", "/proc/nope/x.safetensors"], "cannot write the folder of --out"),
    (["train", "eagle", "--out", "/"], "--out / is a directory; give a file path"),
    (["train", "eagle3", "--out", "x.safetensors", "--features", "/proc/nope"], "cannot write --features"),
    (["train", "data", "--out", "/proc/nope"], "cannot write --out"),
    (["train", "eagle3", "--out", "x.safetensors", "--window", "1"], "--window must be >= 4"),
    (["train", "eagle3", "--out", "x.safetensors", "--max-seq", "1"], "--max-seq must be >= 4"),
    (["train", "eagle3", "--out", "x.safetensors", "--window", "5"], "leaves no position for draft position 4"),
    (["train", "eagle", "--out", "x.safetensors", "--window", "2"], "--window must be >= 4"),
    (["train", "eagle3", "--out", "x.safetensors", "--minutes", "inf"], "--minutes must be > 0 and finite, got inf"),
    (["train", "eagle3", "--out", "x.safetensors", "--bogus"], "unrecognized arguments: --bogus (see specdec train eagle3 --help)"),
])
def test_train_cli_errors(argv, msg, capsys):
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


def test_train_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "head.safetensors"
    out.write_bytes(b"x")
    assert main(["train", "eagle", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_training_windows_are_aligned_slices_of_tokens_and_features():
    import random

    import torch

    from specdec.train.features import windows

    seqs = [list(range(10, 30)), list(range(100, 105))]                       # 20 and 5 tokens
    feats = [torch.arange(len(s) * 3, dtype=torch.bfloat16).view(len(s), 3) + 1 for s in seqs]
    toks, f, lens, starts = windows(seqs, feats, [0, 1], 8, random.Random(5), torch.bfloat16)
    assert toks.shape == (2, 8) and f.shape == (2, 8, 3) and f.dtype == torch.bfloat16
    assert lens.tolist() == [8, 5] and starts[1] == 0                        # a short sequence: all of it, padded
    for r, i in enumerate([0, 1]):
        a, m = int(starts[r]), int(lens[r])
        assert toks[r, :m].tolist() == seqs[i][a:a + m]
        assert torch.equal(f[r, :m], feats[i][a:a + m])
        assert not f[r, m:].any() and not toks[r, m:].any()
    again = windows(seqs, feats, [0, 1], 8, random.Random(5))                # the same rng: the same windows
    assert torch.equal(again[0], toks) and again[1].dtype == torch.float32 and torch.equal(again[1], f.float())


def test_a_held_out_split_leaves_rows_to_train_on():
    from specdec.errors import SpecdecError
    from specdec.train.features import split_heldout

    train, held = split_heldout(200)
    assert held == list(range(10)) and train == list(range(10, 200))
    with pytest.raises(SpecdecError, match="8 rows leave none to train on after the 8 held out"):
        split_heldout(8)


def test_exits_already_written_are_kept_on_a_re_run_and_refused_when_all_are(tmp_path, monkeypatch):
    """train exit with several layer counts: the overwrite check looks at the files it writes (OUT-N), a re-run
    keeps those already written and trains the others, and a re-run of a finished run is refused."""
    import specdec.train.exit as ex
    from specdec.errors import SpecdecError

    out = tmp_path / "x.safetensors"
    paths = ex.exit_paths(out, [6, 12])
    assert paths == {6: tmp_path / "x-6.safetensors", 12: tmp_path / "x-12.safetensors"}
    started = []
    monkeypatch.setattr(ex, "begin", lambda *a, **kw: started.append(a) or (_ for _ in ()).throw(RuntimeError("stop")))
    paths[6].write_bytes(b"done")
    with pytest.raises(RuntimeError, match="stop"):                         # one left to train: the run goes on
        ex.train_exit("smollm2-135m", tmp_path, out, 1.0, [6, 12], 8192, 8, 1e-3, 64, overwrite=False)
    paths[12].write_bytes(b"done")
    with pytest.raises(SpecdecError, match="x-6.safetensors, .*x-12.safetensors exist; pass --overwrite"):
        ex.train_exit("smollm2-135m", tmp_path, out, 1.0, [6, 12], 8192, 8, 1e-3, 64, overwrite=False)
    with pytest.raises(SpecdecError, match="names a layer count twice"):
        ex.train_exit("smollm2-135m", tmp_path, out, 1.0, [6, 6], 8192, 8, 1e-3, 64, overwrite=True)
    assert len(started) == 1


def test_a_single_exit_at_out_does_not_block_a_run_of_several(tmp_path, monkeypatch):
    """`--layers 6` wrote OUT; `--layers 6,12` writes OUT-6 and OUT-12 and must not be refused because of OUT."""
    import specdec.api
    import specdec.train.exit as ex

    out = tmp_path / "x.safetensors"
    out.write_bytes(b"a single exit")
    monkeypatch.setattr(specdec.api, "load_model", lambda *a: (_ for _ in ()).throw(RuntimeError("got to loading")))
    with pytest.raises(RuntimeError, match="got to loading"):
        ex.train_exit("smollm2-135m", tmp_path, out, 1.0, [6, 12], 8192, 8, 1e-3, 64, overwrite=False)
    assert out.read_bytes() == b"a single exit"


@pytest.mark.integration
def test_a_larger_max_prompts_completes_a_partial_shard(tmp_path):
    import json

    from specdec.train.data import generate_data

    generate_data("smollm2-135m", tmp_path, 2, 2, 2, 1.0, 0)
    shard = tmp_path / "shard-0000.jsonl"
    first = shard.read_text().splitlines()
    generate_data("smollm2-135m", tmp_path, 3, 2, 2, 1.0, 0)
    rows = shard.read_text().splitlines()
    assert len(first) == 2 and len(rows) == 3 and rows[:2] == first          # completed, what was there kept
    assert [json.loads(r)["prompt"] for r in rows] == training_prompts(0)[:3]
    generate_data("smollm2-135m", tmp_path, 2, 2, 2, 1.0, 0)                 # fewer than written: nothing to do
    assert shard.read_text().splitlines() == rows


def test_new_shards_go_after_the_last_one_and_unfinished_files_are_not_shards(tmp_path):
    """Numbering after a gap never lands on an existing shard (it counted the files: magpie-0002 was replaced),
    and a writer's temporary file is neither counted nor read."""
    import numpy as np

    from specdec.errors import SpecdecError
    from specdec.train.magpie import next_shard, read_shards, shard_files

    assert next_shard(tmp_path) == 0
    for i in (0, 2):
        np.savez(tmp_path / f"magpie-{i:04d}.npz", tokens=np.arange(4), answer_mask=np.ones(4, np.uint8),
                 offsets=np.array([0, 4]), category=np.array(["chat"]), questions=np.array(["q"]))
    (tmp_path / "magpie-0003.tmp.npz").write_bytes(b"half")
    assert [f.name for f in shard_files(tmp_path)] == ["magpie-0000.npz", "magpie-0002.npz"]
    assert next_shard(tmp_path) == 3 and len(read_shards(tmp_path)) == 2
    (tmp_path / "magpie-0004.npz").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(SpecdecError, match="magpie-0004.npz is not a readable shard"):
        read_shards(tmp_path)


def _shards(path, seed: int, n: int = 6):
    """`n` made-up conversations in one magpie shard under `path`."""
    import random

    from specdec.train.magpie import Conversation, save_shard

    g = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    convs = [Conversation("chat", [{"role": "user", "content": f"q{seed} {i}"}], toks, [0, 0] + [1] * (len(toks) - 2))
             for i in range(n) for toks in [[g.randrange(90) for _ in range(g.randrange(8, 20))]]]
    save_shard(path / "magpie-0000.npz", convs)


def test_exit_features_are_cached_per_data_and_overwrite_drops_every_exits_checkpoint(tmp_path, monkeypatch):
    """Other data under the same shard names gets its own features (the cache name holds a digest of the rows'
    tokens), the same data reads them back; --overwrite discards the interrupted run of every exit (OUT-N.ckpt)."""
    import specdec.train.exit as ex
    from helpers import tiny_model

    target = tiny_model(layers=4)
    extracted, trained = [], []
    monkeypatch.setattr(ex, "begin", lambda *a, **kw: (target, "tiny", __import__("random").Random(0)))
    real_extract = ex.extract_aux
    monkeypatch.setattr(ex, "extract_aux", lambda *a: extracted.append(1) or real_extract(*a))
    monkeypatch.setattr(ex, "_train_one", lambda *a: trained.append(a[3]) or {})
    feats = tmp_path / "feats"
    _shards(tmp_path / "a", seed=1)
    _shards(tmp_path / "b", seed=2)
    for data, runs in (("a", 1), ("b", 2), ("a", 2)):
        ex.train_exit("tiny", tmp_path / data, tmp_path / "x.safetensors", 1.0, [2, 3], 64, 8, 1e-3, 64,
                      overwrite=True, features=feats)
        assert len(extracted) == runs
    assert len(list(feats.glob("features-exit2-3-*.pt"))) == 2
    paths = ex.exit_paths(tmp_path / "x.safetensors", [2, 3])
    for p in paths.values():
        p.with_suffix(".ckpt").write_bytes(b"an interrupted run")
    ex.train_exit("tiny", tmp_path / "a", tmp_path / "x.safetensors", 1.0, [2, 3], 64, 8, 1e-3, 64, overwrite=True,
                  features=feats)
    assert not any(p.with_suffix(".ckpt").exists() for p in paths.values())


class FakeAnswerer:
    """`specdec.load`'s generator as `train data` uses it: answers name the batch's temperature and seed; its
    `stop_at`-th batch is interrupted (Ctrl-C)."""

    def __init__(self, stop_at: int) -> None:
        self.calls, self.stop_at = 0, stop_at
        self.tokenizer, self.name, self.vocab = self, "tiny", {"a": 0}

    def encode(self, text, chat):
        return [len(text) % 50, 1]

    def encode_text(self, text):
        return self.encode(text, False)

    def generate(self, ids, max_new_tokens, temperature, seed, **kw):
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        return [type("R", (), {"tokens": [int(temperature * 10), seed % 97]})() for _ in ids]


def test_an_interrupted_data_run_keeps_its_answers_and_continues(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) during `train data`: the answers so far are written; the same command continues and
    says so; once every prompt is answered a rerun loads no model."""
    import specdec
    from specdec.errors import Interrupted
    from specdec.train.data import generate_data, read_data

    monkeypatch.setattr(specdec, "load", lambda *a, **kw: FakeAnswerer(stop_at=3))
    with pytest.raises(Interrupted, match="4 of 10 answers"):
        generate_data("tiny", tmp_path, 10, 4, 2, 1.0, seed=0, shard_size=10)
    assert len(read_data(tmp_path)) == 4
    monkeypatch.setattr(specdec, "load", lambda *a, **kw: FakeAnswerer(stop_at=0))
    capsys.readouterr()
    generate_data("tiny", tmp_path, 10, 4, 2, 1.0, seed=0, shard_size=10)
    rows = read_data(tmp_path)
    assert len(rows) == 10 and len({r["prompt"] for r in rows}) == 10
    assert f"continuing: 4 of 10 prompts are answered in {tmp_path}" in capsys.readouterr().err
    monkeypatch.setattr(specdec, "load", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("loaded")))
    generate_data("tiny", tmp_path, 10, 4, 2, 1.0, seed=0, shard_size=10)
    assert f"all 10 prompts are answered in {tmp_path} already" in capsys.readouterr().err


def test_a_resumed_data_run_writes_what_an_uninterrupted_one_writes(tmp_path, monkeypatch):
    """Each batch's greedy-or-sampled choice and seed depend on the batch alone: a run interrupted and continued
    gives the rows of one that never stopped; a damaged shard is a one-line error."""
    import specdec
    from specdec.errors import Interrupted, SpecdecError
    from specdec.train.data import generate_data, read_data

    monkeypatch.setattr(specdec, "load", lambda *a, **kw: FakeAnswerer(stop_at=0))
    generate_data("tiny", tmp_path / "whole", 12, 4, 2, 0.5, seed=0, shard_size=6)
    monkeypatch.setattr(specdec, "load", lambda *a, **kw: FakeAnswerer(stop_at=5))
    with pytest.raises(Interrupted):
        generate_data("tiny", tmp_path / "resumed", 12, 4, 2, 0.5, seed=0, shard_size=6)
    monkeypatch.setattr(specdec, "load", lambda *a, **kw: FakeAnswerer(stop_at=0))
    generate_data("tiny", tmp_path / "resumed", 12, 4, 2, 0.5, seed=0, shard_size=6)
    whole, resumed = read_data(tmp_path / "whole"), read_data(tmp_path / "resumed")
    assert len(whole) == 12 and resumed == whole
    assert len({r["temperature"] for r in whole}) == 2
    shard = tmp_path / "whole" / "shard-0001.jsonl"
    shard.write_text(shard.read_text()[:-20])
    with pytest.raises(SpecdecError, match="shard-0001.jsonl, line 6: not a JSON row"):
        read_data(tmp_path / "whole")


def test_a_follow_up_keeps_the_first_answer_marked_where_its_text_encodes_to_other_tokens():
    """The second turn's prompt is the chat encoded again from its text: the first answer (generated as 3 tokens
    and EOS 2) may come back as other tokens, and its mask follows it, through its end-of-turn token."""
    from specdec.train.magpie import prompt_mask

    tokens, mask = [9, 9, 5, 30, 31, 32, 2], [0, 0, 0, 1, 1, 1, 1]          # prompt 9 9 5, answer 30 31 32 EOS
    reencoded = [9, 9, 5, 40, 41, 2, 7, 8, 5]                                # answer as 40 41, then the next turn
    assert prompt_mask(tokens, mask, reencoded, frozenset({2})) == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    kept = tokens + [7, 8, 5]                                                # encoded the same: the mask as it was
    assert prompt_mask(tokens, mask, kept, frozenset({2})) == mask + [0, 0, 0]
    longer = [9, 9, 5, 40, 41, 42, 43, 44, 2, 7, 5]
    assert prompt_mask(tokens, mask, longer, frozenset({2})) == [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]


def test_an_interrupted_magpie_run_keeps_its_conversations_as_a_shard(tmp_path, monkeypatch):
    from tqdm import tqdm

    from specdec.errors import Interrupted
    from specdec.train.magpie import Conversation, MagpieWriter, read_shards

    writer = MagpieWriter(type("G", (), {"tokenizer": None})(), tmp_path, 2, 0)
    batches = iter([[Conversation("chat", [{"role": "user", "content": "a b c"}], [1, 2, 3], [0, 1, 1])] * 2])

    def batch_of(category, rng):
        return next(batches)                     # then StopIteration... stands in for Ctrl-C below

    def interrupted(category, rng):
        try:
            return batch_of(category, rng)
        except StopIteration:
            raise KeyboardInterrupt from None
    monkeypatch.setattr(writer, "batch_of", interrupted)
    with pytest.raises(Interrupted, match="kept 2 conversations"):
        writer.write_shard(0, 16, tqdm(disable=True))
    assert len(read_shards(tmp_path)) == 2


def _shard(path, **arrays) -> None:
    import numpy as np

    base = dict(tokens=np.array([1, 2, 3, 4, 5], dtype=np.uint16), answer_mask=np.array([0, 0, 1, 1, 1], dtype=np.uint8),
                offsets=np.array([0, 2, 5], dtype=np.int64), category=np.array(["chat", "code"]))
    np.savez(path, **{**base, **arrays})


@pytest.mark.parametrize("arrays, msg", [
    (dict(offsets=__import__("numpy").array([0, 2])), "offsets must be one integer array of rows \\+ 1 = 3"),
    (dict(offsets=__import__("numpy").array([0, 4, 2])), "offsets must rise from 0 to the 5 tokens"),
    (dict(offsets=__import__("numpy").array([0, 2, 9])), "offsets must rise from 0 to the 5 tokens"),
    (dict(tokens=__import__("numpy").array([1.0, 2, 3, 4, 5])), "tokens must be one array of non-negative integer"),
    (dict(tokens=__import__("numpy").array([1, -2, 3, 4, 5])), "tokens must be one array of non-negative integer"),
    (dict(answer_mask=__import__("numpy").array([0, 1])), "answer_mask has 2 entries for 5 tokens"),
])
def test_a_malformed_shard_is_one_clear_error(arrays, msg, tmp_path):
    """Shards whose arrays do not fit together raised IndexError deep in the reader (or were read wrongly)."""
    from specdec.errors import SpecdecError
    from specdec.train.magpie import read_shards

    _shard(tmp_path / "magpie-0000.npz", **arrays)
    with pytest.raises(SpecdecError, match=f"magpie-0000.npz is not a readable shard .*{msg}"):
        read_shards(tmp_path)


def test_a_shard_that_is_one_array_and_data_of_another_vocabulary_are_clear_errors(tmp_path):
    import numpy as np

    from specdec.errors import SpecdecError
    from specdec.train.features import vocab_subset
    from specdec.train.magpie import read_shards

    _shard(tmp_path / "magpie-0000.npz")
    assert [r.tokens for r in read_shards(tmp_path)] == [[1, 2], [3, 4, 5]]
    with open(tmp_path / "magpie-0001.npz", "wb") as f:
        np.save(f, np.arange(4))
    with pytest.raises(SpecdecError, match="magpie-0001.npz is not a readable shard .*one array"):
        read_shards(tmp_path)
    with pytest.raises(SpecdecError, match=r"token ids outside the target's vocabulary \[0, 97\)"):
        vocab_subset([[1, 2], [5000]], 8, 97)


def test_data_that_is_missing_or_a_file_is_named_as_such(tmp_path):
    from specdec.train.magpie import no_shards

    assert str(no_shards(tmp_path / "nope")) == f"--data {tmp_path / 'nope'} not found"
    (tmp_path / "f.npz").write_bytes(b"")
    assert "is a file; give the folder" in str(no_shards(tmp_path / "f.npz"))
    assert "no magpie-*.npz shards in" in str(no_shards(tmp_path))


def test_a_failed_training_run_leaves_no_empty_folders(tmp_path):
    """--out and --features folders made for a run that then fails (here: no data) are removed again."""
    from specdec.cli import main

    out, feats = tmp_path / "new" / "runs" / "x.safetensors", tmp_path / "feat" / "s"
    assert main(["train", "eagle3", "--out", str(out), "--features", str(feats), "--data", str(tmp_path / "none")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == []


class _Tok:
    """A stand-in tokenizer: a vocabulary size and an id per character."""

    def __init__(self, size: int, shift: int) -> None:
        self.vocab = {str(i): i for i in range(size)}
        self.shift = shift

    def encode_text(self, text: str) -> list[int]:
        return [(ord(c) + self.shift) % len(self.vocab) for c in text]


def test_data_records_its_tokenizer_and_training_under_another_is_refused(tmp_path):
    """Shards are token ids: a folder written under one tokenizer and trained on under another (a smaller
    vocabulary's ids all fit the larger one, so the id range did not catch it) is refused; data without a
    record is left to the id-range check; a folder is written by one tokenizer only."""
    from specdec.train import source

    mine, other, same_size = _Tok(500, 0), _Tok(900, 0), _Tok(500, 7)
    source.record(tmp_path, "a", mine)
    source.check(tmp_path, "a", mine)
    source.check(tmp_path / "shard-0000.jsonl", "a-copy", mine)     # a file of the folder, another name, same ids
    for tok in (other, same_size):
        with pytest.raises(SpecdecError, match=f"{tmp_path} holds token ids written by a, whose tokenizer is not b's"):
            source.check(tmp_path, "b", tok)
        with pytest.raises(SpecdecError, match="written by a"):
            source.record(tmp_path, "b", tok)
    (tmp_path / "elsewhere").mkdir()
    source.check(tmp_path / "elsewhere", "b", other)                 # no record: not refused here
    (tmp_path / source.SOURCE).write_text("{}")
    with pytest.raises(SpecdecError, match="does not say which model wrote the data"):
        source.check(tmp_path, "a", mine)


@pytest.mark.integration
def test_the_shipped_data_is_smollm2s_and_gemma3_cannot_train_on_it():
    from pathlib import Path

    from specdec.models.registry import resolve
    from specdec.models.tokenizer import Tokenizer
    from specdec.train import source

    data = Path(__file__).resolve().parents[1] / "data" / "smollm2-135m"
    for name, refused in (("smollm2-135m", False), ("gemma3-270m", True)):
        _, path = resolve(name)
        tok = Tokenizer.from_gguf(Path(path))
        if refused:
            with pytest.raises(SpecdecError, match="written by smollm2-135m, whose tokenizer is not gemma3-270m's"):
                source.check(data, name, tok)
        else:
            source.check(data, name, tok)
