"""Bad input gets a clear error (SpecdecError / exit code 2 with a message), never a traceback or a silent change."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

import specdec
from specdec.api import make_proposer, parse_device, parse_dtype
from specdec.cli import main
from specdec.draft_length import make_policy
from specdec.errors import SpecdecError
from specdec.models.gguf_loader import load_gguf, open_gguf
from specdec.models.registry import resolve
from specdec.proposers.draft_model import DraftModelProposer

from helpers import tiny_generator, tiny_model


def test_unknown_model_lists_known():
    with pytest.raises(SpecdecError, match="known models: smollm2-135m, gemma3-270m"):
        resolve("llama-70b")


def test_missing_gguf(tmp_path):
    with pytest.raises(SpecdecError, match="not found"):
        resolve(str(tmp_path / "nope.gguf"))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(SpecdecError, match="not a readable GGUF"):
        open_gguf(bad)


def test_a_directory_or_another_file_is_no_gguf(tmp_path):
    with pytest.raises(SpecdecError, match="is a directory, not a GGUF file"):
        resolve(str(tmp_path))
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(SpecdecError, match="not a GGUF file: .*notes.gguf .it does not begin with the GGUF magic"):
        load_gguf(text, dtype=__import__("torch").float32)                 # refused before it is hashed


def test_a_file_that_is_no_gguf_is_one_line_before_any_loading_note(tmp_path, capsys):
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    assert main(["generate", "--prompt", "hi", "--model", str(text)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"specdec: error: not a GGUF file: {text} (it does not begin "
                                                    "with the GGUF magic bytes)"]


def _truncated_copies_are_named_so(whole: bytes, cuts: list[int], folder: Path) -> None:
    for n in cuts:
        cut = folder / f"cut-{n}.gguf"
        cut.write_bytes(whole[:n])
        with pytest.raises(SpecdecError, match=f"truncated GGUF file: .*cut-{n}.gguf .{n} bytes. ends before"):
            open_gguf(cut)


def test_a_truncated_gguf_says_so(tmp_path):
    """A copy cut short (an interrupted download) is named truncated, in the header, its metadata, its tensor
    list or the tensors' data (a small GGUF: every cut point)."""
    path = tmp_path / "whole.gguf"
    _llama_gguf(path, keys=True, embedding=True)
    whole = path.read_bytes()
    open_gguf(path)                                                          # whole, it opens
    _truncated_copies_are_named_so(whole, list(range(6, len(whole), 7)) + [len(whole) - 1], tmp_path)


@pytest.mark.slow
def test_a_truncated_real_gguf_says_so(tmp_path):
    """The same for the shipped model cut in its header, its tokenizer's metadata and its last tensor's data."""
    whole = resolve("smollm2-135m")[1].read_bytes()
    _truncated_copies_are_named_so(whole, [6, 1000, 5_000_000, len(whole) - 1], tmp_path)


def test_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SpecdecError, match="unsupported architecture 'gpt2'"):
        load_gguf(path, dtype=__import__("torch").float32)


def _llama_gguf(path, keys: bool, embedding: bool) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    if keys:
        w.add_block_count(1)
        w.add_context_length(64)
        w.add_embedding_length(8)
        w.add_feed_forward_length(16)
        w.add_head_count(2)
        w.add_layer_norm_rms_eps(1e-5)
    if embedding:
        w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:
        w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("keys, embedding, msg", [
    (False, True, "lacks the metadata key 'llama.attention.head_count'"),
    (True, False, "lacks the tensor 'token_embd.weight'"),
])
def test_a_gguf_missing_metadata_or_tensors_is_one_clear_error(keys, embedding, msg, tmp_path):
    path = tmp_path / "part.gguf"
    _llama_gguf(path, keys, embedding)
    with pytest.raises(SpecdecError, match=msg) as e:
        load_gguf(path, dtype=__import__("torch").float32, use_cache=False)
    assert str(path) in str(e.value)


def test_bad_dtype_and_device():
    with pytest.raises(SpecdecError, match="unknown dtype"):
        parse_dtype("float8")
    with pytest.raises(SpecdecError, match="unknown device"):
        parse_device("tpu:x")
    if not __import__("torch").cuda.is_available():
        with pytest.raises(SpecdecError, match="no CUDA device"):
            parse_device("cuda")


@pytest.mark.parametrize("kw, msg", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"), (dict(top_p=-0.01), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(stop=("",)), "stop strings"),
])
def test_bad_generation_arguments(kw, msg):
    gen = tiny_generator(tiny_model())
    with pytest.raises(SpecdecError, match=msg):
        gen.generate([1, 2, 3], **kw)


def test_empty_prompts():
    gen = tiny_generator(tiny_model())
    for bad in ("", [], [[]], " \n"):                  # (the tiny tokenizer spells white space as no tokens)
        with pytest.raises(SpecdecError, match="empty prompt"):
            gen.generate(bad)
    gen.tokenizer.encode = lambda text, chat: [3] * len(text)      # a real one spells it as tokens: a prompt
    assert len(gen.generate(" \n", max_new_tokens=2).tokens) == 2
    with pytest.raises(SpecdecError, match=r"token ids must be integers in \[0, 97\)"):
        gen.generate([1, 500])
    for booleans in ([True, False], [1, True], [[True]], ["1 2", [True]]):      # not ids 1 and 0
        with pytest.raises(SpecdecError, match=r"token ids must be integers in \[0, 97\) \(not booleans\)"):
            gen.generate(booleans, max_new_tokens=2)
        with pytest.raises(SpecdecError, match="token ids must be integers|stream takes one prompt"):
            gen.stream(booleans, max_new_tokens=2)          # at the call, not at the first piece


def test_numbers_of_any_kind_are_taken_and_numbers_too_large_refused_in_one_line():
    """numpy scalars are numbers (they were refused as "not a finite number >= 0" / "not a positive integer"); a
    temperature of 10**400 is refused as such (it raised OverflowError from math.isfinite)."""
    gen = tiny_generator(tiny_model())
    want = gen.generate([1, 2, 3], max_new_tokens=5, temperature=0.5, top_k=5, top_p=0.9, seed=7)
    got = gen.generate([np.int64(1), np.int32(2), np.uint8(3)], max_new_tokens=np.int64(5),
                       temperature=np.float32(0.5), top_k=np.int64(5), top_p=np.float64(0.9), seed=np.int64(7))
    assert got.tokens == want.tokens
    assert "".join(gen.stream([np.int64(1), 2, 3], max_new_tokens=np.int16(5), temperature=0.5, top_k=5, top_p=0.9,
                              seed=7)) == want.text
    for kw, msg in [(dict(temperature=10 ** 400), "temperature must be a finite number >= 0, got 1000000"),
                    (dict(temperature=np.bool_(True)), "temperature"), (dict(seed=np.float64(3.0)), "seed"),
                    (dict(max_new_tokens=np.float32(4)), "max_new_tokens must be a positive integer")]:
        with pytest.raises(SpecdecError, match=msg) as e:
            gen.generate([1, 2, 3], **kw)
        assert len(str(e.value)) < 120
    with pytest.raises(SpecdecError, match="empty prompt"):
        gen.stream([])


def test_each_thread_sees_its_own_last_result():
    """`last_result` is the calling thread's: a stream's Result stays its own while another thread generates
    (it was overwritten by, or reset for, the other thread's calls)."""
    import threading

    gen = tiny_generator(tiny_model())
    alone = gen.generate([5, 6, 7], max_new_tokens=12)
    stop, done = threading.Event(), [0]

    def other() -> None:
        while not stop.is_set():
            gen.generate([1, 2], max_new_tokens=3)
            assert gen.last_result.prompt_tokens == 2
            done[0] += 1

    t = threading.Thread(target=other)
    t.start()
    try:
        for _ in range(3):
            text = "".join(gen.stream([5, 6, 7], max_new_tokens=12))
            seen = done[0]
            deadline = time.monotonic() + 30
            while done[0] < seen + 2 and time.monotonic() < deadline:    # the other thread generated since
                time.sleep(0.01)
            r = gen.last_result
            assert (text, r.tokens, r.prompt_tokens) == (alone.text, alone.tokens, 3)
    finally:
        stop.set()
        t.join()


def test_a_top_k_beyond_64_bits_keeps_every_token():
    gen = tiny_generator(tiny_model())
    huge = gen.generate([1, 2, 3], max_new_tokens=6, temperature=1.0, top_k=10 ** 30, seed=3)
    assert huge.tokens == gen.generate([1, 2, 3], max_new_tokens=6, temperature=1.0, top_k=0, seed=3).tokens


@pytest.mark.parametrize("shape", ["\u00b2", "4x\u00b9\u2076", "self"])
def test_tree_shapes_with_digits_int_cannot_read_are_refused(shape):
    from specdec.tree import TreeShape

    with pytest.raises(SpecdecError, match="a tree shape is TOPKxBUDGET"):
        TreeShape.parse(shape)
    with pytest.raises(SpecdecError, match="a tree shape takes integers"):
        TreeShape(2, "16")


@pytest.mark.parametrize("kw, msg", [
    (dict(prediction=123), "prediction must be a string"), (dict(prediction=None), "prediction must be a string"),
    (dict(prediction=[1, 2, 3]), r"prediction must be a string, the expected output \(for a list of prompts"),
    (dict(prediction=["a b"]), "prediction must be a string"),
    (dict(stop=None), r"stop must be a string or a list of strings \(\(\) for none\), got NoneType"),
    (dict(stop=3), "stop must be a string or a list of strings"),
])
def test_bad_prediction_and_stop_types(kw, msg):
    gen = tiny_generator(tiny_model())
    with pytest.raises(SpecdecError, match=msg):
        gen.generate("1 2 3", max_new_tokens=2, **kw)
    with pytest.raises(SpecdecError, match=msg):
        gen.stream("1 2 3", max_new_tokens=2, **kw)                       # at the call, before any piece


def test_predictions_for_a_list_of_prompts_are_strings_one_per_prompt():
    gen = tiny_generator(tiny_model())
    with pytest.raises(SpecdecError, match="one prediction for a list of prompts"):
        gen.generate(["1 2", "3 4"], max_new_tokens=2, prediction="5 6")
    with pytest.raises(SpecdecError, match="a list of strings, one per prompt; got int"):
        gen.generate(["1 2", "3 4"], max_new_tokens=2, prediction=7)
    with pytest.raises(SpecdecError, match="1 predictions for 2 prompts"):
        gen.generate(["1 2", "3 4"], max_new_tokens=2, prediction=["5"])


@pytest.mark.parametrize("bad", [None, 5, 2.5, {"text": "hi"}])
def test_prompt_of_another_type(bad):
    gen = tiny_generator(tiny_model())
    with pytest.raises(SpecdecError, match="prompt must be a string, a list of token ids, or a list of those"):
        gen.generate(bad)
    with pytest.raises(SpecdecError, match="stream takes one prompt"):
        gen.stream(bad)
    with pytest.raises(SpecdecError, match="prompt 1 of the list must be a string or a list of token ids"):
        gen.generate(["1 2", bad])


def test_prompt_longer_than_context_errors_unless_truncation_asked():
    gen = tiny_generator(tiny_model())                  # max_seq_len 256
    long = list(range(1, 90)) * 3                        # 267 tokens
    with pytest.raises(SpecdecError, match=r"longer than the 247 .*; shorten it or ask for truncation"):
        gen.generate(long, max_new_tokens=8)
    with pytest.raises(SpecdecError, match=r"longer than the 5 .*with max_new_tokens=250; lower max_new_tokens "
                                           r"\(at most 245 with this prompt\), shorten it"):
        gen.generate(list(range(1, 11)), max_new_tokens=250)      # the answer asked for is what does not fit
    res = gen.generate(long, max_new_tokens=8, truncate=True)
    assert len(res.tokens) == 8 and res.prompt_tokens == 256 - 8 - 1
    gen.tokenizer.bos_id = 7                             # a model with a BOS keeps it in front of the kept tail
    with_bos = gen.generate([7] + long, max_new_tokens=8, truncate=True)
    assert with_bos.tokens == gen.generate([7] + long[len(long) - 246:], max_new_tokens=8).tokens
    assert with_bos.tokens != res.tokens and with_bos.prompt_tokens == 247


def test_bad_draft_settings():
    for k in (0, -1, 1000, True):
        with pytest.raises(SpecdecError, match="num_draft_tokens"):
            make_policy("fixed", k)
    with pytest.raises(SpecdecError, match="unknown draft policy"):
        make_policy("magic", 4)
    target = tiny_model(vocab=97)
    with pytest.raises(SpecdecError, match="vocabulary"):
        make_proposer("draft", target, None, tiny_model(vocab=50), "float32", "cpu")
    with pytest.warns(UserWarning, match="larger than the target"):
        make_proposer("draft", target, None, tiny_model(layers=4), "float32", "cpu")
    with pytest.raises(SpecdecError, match="choose one of: none, ngram, draft"):
        make_proposer("medusa-x", target, None, None, "float32", "cpu")
    with pytest.raises(SpecdecError, match="need a draft model"):
        make_proposer("draft", target, None, None, "float32", "cpu")
    assert isinstance(make_proposer("draft", target, None, tiny_model(layers=1), "float32", "cpu"), DraftModelProposer)


def test_text_that_is_no_unicode_and_a_bad_chat_setting():
    gen = tiny_generator(tiny_model())
    for kw, what in [(dict(prompt="1 2 \udcff"), "prompt"), (dict(prompt="1 2", stop=["\ud800"]), "stop string"),
                     (dict(prompt="1 2", prediction="3 \ud800"), "prediction")]:
        with pytest.raises(SpecdecError, match=f"the {what} is not valid UTF-8 text"):
            gen.generate(max_new_tokens=2, **kw)
    for chat in (None, "yes", 1):
        with pytest.raises(SpecdecError, match='chat must be True, False or "auto"'):
            gen.generate("1 2", max_new_tokens=2, chat=chat)


def test_load_checks_types_before_loading():
    with pytest.raises(SpecdecError, match='tree must be a TreeShape or "TOPKxBUDGET"'):
        specdec.load("smollm2-135m", method="eagle", tree=5)
    with pytest.raises(SpecdecError, match="draft_model must be a name, a path or a loaded model, got int"):
        specdec.load("smollm2-135m", method="draft", draft_model=123)
    with pytest.raises(SpecdecError, match="a loaded draft_model must be a causal LM with a vocab_size"):
        specdec.load("smollm2-135m", method="draft", draft_model=torch.nn.Linear(2, 2))
    with pytest.raises(SpecdecError, match="belong to a named method"):
        specdec.load("smollm2-135m", tree="4x16")


@pytest.mark.parametrize("method, takes", [("eagle", "an EAGLE head"), ("eagle3", "an EAGLE-3 head"),
                                           ("hybrid", "an EAGLE-3 head"), ("medusa", "Medusa heads"),
                                           ("self", "an exit"), ("lookahead", "its shape W,N,G")])
def test_a_loaded_model_for_a_method_with_other_weights_is_refused(method, takes, monkeypatch):
    """Heads, exits and shapes are not models: a loaded model given to their methods was silently replaced by
    the shipped weights (eagle, eagle3, hybrid, medusa); refused before anything loads, and by the builders."""
    import specdec.api as api

    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("loaded before refusing"))
    draft = tiny_model(seed=1)
    with pytest.raises(SpecdecError, match=f"method '{method}' takes {takes}.* not a loaded model"):
        specdec.load("smollm2-135m", method=method, draft_model=draft)
    if method in ("eagle", "eagle3", "hybrid", "medusa"):
        with pytest.raises(SpecdecError, match="not a loaded model"):
            api.make_proposer(method, tiny_model(seed=2), None, draft, "float32", "cpu")


def test_load_refuses_a_draft_that_is_not_there_before_loading(monkeypatch, tmp_path):
    import specdec.api as api

    monkeypatch.setattr(api, "load_model", lambda *a: (_ for _ in ()).throw(RuntimeError("got past the checks")))
    for method, draft, message in [("eagle3", "nope.safetensors", "draft 'nope.safetensors' of method 'eagle3' not found"),
                                   ("draft", "no-such-model", "it takes a registered model, a .gguf file, self:N"),
                                   ("medusa", tmp_path / "gone", "of method 'medusa' not found"),
                                   ("lookahead", "2,3", "lookahead shape is W,N,G"),
                                   ("draft", "self:0", "self:N needs a whole number of layers N >= 1"),
                                   ("self", "self:x", "self:N needs a whole number of layers N >= 1")]:
        with pytest.raises(SpecdecError, match=message):
            specdec.load("smollm2-135m", method=method, draft_model=draft)
    (tmp_path / "head.safetensors").write_bytes(b"")
    for method, draft in [("draft", "self:4"), ("draft", "gemma3-270m"), ("self", "self:6"),
                          ("eagle3", str(tmp_path / "head.safetensors")), ("lookahead", "2,3,2")]:
        with pytest.raises(RuntimeError, match="got past the checks"):
            specdec.load("smollm2-135m", method=method, draft_model=draft)


def test_a_chain_spelled_1xN_is_the_default_chain(monkeypatch):
    """tree "1x16" is the chain "1" is: accepted with the default method (which has no tree), as "1" is."""
    import specdec.api as api

    monkeypatch.setattr(api, "load_model", lambda *a: (_ for _ in ()).throw(RuntimeError("got past the checks")))
    for chain in ("1", "1x16", "1X16"):
        with pytest.raises(RuntimeError, match="got past the checks"):
            specdec.load("smollm2-135m", tree=chain)


def test_export_into_an_unusable_directory_is_one_line(tmp_path):
    from specdec.export import _write

    (tmp_path / "f").write_text("x")
    with pytest.raises(SpecdecError, match="the output directory .*f is a file, not a directory"):
        _write(tmp_path / "f", {}, {}, False)
    assert main(["export", "eagle3", ""]) == 2                  # an unset "$OUT": not the working directory
    assert not Path("config.json").exists()


def test_load_rejects_unknown_method_before_loading():
    with pytest.raises(SpecdecError, match="unknown method 'fast'; choose one of"):
        specdec.load("smollm2-135m", method="fast")
    with pytest.raises(SpecdecError, match="unknown method 'eagel'; did you mean 'eagle'\\? choose one of"):
        specdec.load("smollm2-135m", method="eagel")
    with pytest.raises(SpecdecError, match="model must be a registered name or a .gguf path, got NoneType"):
        specdec.load(None)


@pytest.mark.parametrize("method", ["none", "ngram", "suffix"])
def test_load_refuses_a_draft_model_for_methods_without_one(method):
    what = "decodes without drafts" if method == "none" else "drafts from the context"
    with pytest.raises(SpecdecError, match=f"method '{method}' {what} and takes no draft_model"):
        specdec.load("smollm2-135m", method=method, draft_model="smollm2-135m")


@pytest.mark.integration
def test_staged_refuses_a_draft_with_another_tokenizer_at_load():
    with pytest.raises(SpecdecError, match="method 'staged' needs a draft with the target's tokenizer; "
                                           "'gemma3-270m' has another"):
        specdec.load("smollm2-135m", method="staged", draft_model="gemma3-270m", dtype="float32")


@pytest.mark.parametrize("argv, msg", [
    (["generate", "--model", "nope", "--prompt", "hi"], "unknown model"),
    (["generate", "--prompt", "hi", "--method", "warp"], "unknown method"),
    (["generate"], "exactly one of --prompt"),
    (["generate", "--prompt", "hi", "--method", "ngram", "--draft-model", "smollm2-135m"], "takes no draft_model"),
    (["generate", "--prompt-file", "/nonexistent/file.txt"], "prompt file not found"),
    (["generate", "--prompt-file", "/dev/null"], "empty prompt"),            # a device reads as a file (empty)
    (["generate", "--prompt", "hi", "--stop", ""], "--stop takes non-empty strings"),
    (["generate", "--prompt", "hi", "--threads", "-1"], "--threads"),
    (["generate", "--prompt", "hi", "--num-draft-tokens", "0", "--method", "ngram"], "--num-draft-tokens"),
    (["generate", "--prompt", "hi", "--method", "ngram", "--tree", "4x16"], "applies to methods 'eagle' and 'eagle3' only"),
    (["generate", "--prompt", "hi", "--method", "eagle", "--tree", "4by16"], "TOPKxBUDGET"),
    (["generate", "--prompt", "hi", "--method", "eagle", "--tree", "4x200"], "tree budget must be in"),
    (["bench", "--methods", "ngram:4x16"], "applies to eagle and eagle3 only"),
    (["train", "medusa", "--out", "/nonexistent-dir/x.safetensors", "--data", "/nonexistent-data"],
     "no training data"),
    (["train", "eagle3", "--out", "/nonexistent-dir/x.safetensors", "--data", "/nonexistent-data"],
     "--data /nonexistent-data not found"),
    (["export", "eagle3", "/nonexistent-dir/out", "--weights", "/nonexistent/head.safetensors"], "weights not found"),
    (["export", "medusa", "/nonexistent-dir/out", "--format", "sglang"], "vllm only"),
])
def test_cli_errors_are_messages_not_tracebacks(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_cli_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--method", "--max-new-tokens", "--temperature", "--dtype", "--json", "default: smollm2-135m"):
        assert flag in out


def test_export_checks_what_needs_no_model_before_loading_one(tmp_path, monkeypatch, capsys):
    import specdec.cli_export as cli_export

    monkeypatch.setattr(cli_export, "_target", lambda model: pytest.fail("the model was loaded"))
    assert main(["export", "medusa", str(tmp_path / "m"), "--format", "sglang"]) == 2
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text("{}")
    assert main(["export", "eagle3", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert "Medusa heads export to vllm only" in err and "config.json exists; pass --overwrite" in err
    assert main(["export", "eagle3", str(tmp_path / "g"), "--model", "gemma3-270m"]) == 2
    assert ("no shipped eagle3 weights for 'gemma3-270m'; write training data first (`specdec train magpie --model "
            "gemma3-270m`), then train them") in capsys.readouterr().err.replace("\n", " ")
    assert not (tmp_path / "g").exists()
    assert main(["export", "eagle3", str(tmp_path / "h"), "--weights", str(tmp_path / "nope.safetensors")]) == 2
    assert "nope.safetensors: weights not found" in capsys.readouterr().err and not (tmp_path / "h").exists()


def test_a_method_without_weights_for_the_target_is_refused_before_loading_and_by_the_server(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from specdec.server.app import ApiError, speculation
    from specdec.server.schema import Speculative
    from specdec.server.scheduler import SpecChoice

    monkeypatch.chdir(tmp_path)                     # no runs/data/gemma3-270m: the data command comes first
    for method, message in [("eagle", r"no shipped eagle weights for 'gemma3-270m'; write training data first "
                                      r"\(`specdec train data --model gemma3-270m`\), then train them \(`specdec train "
                                      r"eagle --model gemma3-270m --out FILE.safetensors`\)"),
                            ("self", r"train exit --model gemma3-270m --out FILE.safetensors --layers N"),
                            ("staged", r"need a draft model for 'gemma3-270m'.*specdec train draft --model gemma3-270m")]:
        with pytest.raises(SpecdecError, match=message):
            specdec.load("gemma3-270m", method=method)        # before loading: nothing to load for it
    from specdec.api import missing, no_draft_for

    (tmp_path / "runs" / "data" / "gemma3-270m").mkdir(parents=True)
    (tmp_path / "runs" / "data" / "gemma3-270m" / "shard-0000.jsonl").write_text("")
    assert missing("gemma3-270m", "medusa").startswith("no shipped medusa weights for 'gemma3-270m'; train them (")
    for message in (missing("my-model.Q4_0", "eagle"), str(no_draft_for("my-model.Q4_0"))):  # a GGUF path's target
        assert "trains them for a registered model (smollm2-135m, gemma3-270m), not for 'my-model.Q4_0'" in message
        assert "--model my-model" not in message                    # `specdec train` would refuse it
    state = SimpleNamespace(model_name="gemma3-270m", pool=SimpleNamespace(drafts={}), default=SpecChoice("suffix", 4),
                            max_draft_tokens=16, generator=SimpleNamespace(num_draft_tokens=4))
    with pytest.raises(ApiError) as e:
        speculation(Speculative(method="eagle3"), state)
    assert e.value.status == 400 and e.value.param == "speculative" and "no draft weights for gemma3-270m" in e.value.message
    state.pool.drafts["eagle3"] = "head.safetensors"                # --draft-model given to the server
    assert speculation(Speculative(method="eagle3"), state) == SpecChoice("eagle3", 4)
    assert speculation(Speculative(method="suffix"), state) == SpecChoice("suffix", 4)
    state.generator.target = None
    assert speculation(Speculative(method="auto"), state) == SpecChoice("suffix", 4)     # as load(method="auto")


def test_truncate_must_be_a_bool_and_a_closed_stream_keeps_its_result_so_far():
    gen = tiny_generator(tiny_model())
    with pytest.raises(SpecdecError, match="truncate must be True or False, got 'yes'"):
        gen.generate([1, 2, 3], truncate="yes")
    stream = gen.stream([1, 2, 3], max_new_tokens=20)
    first = next(stream)
    stream.close()                                           # the reader stops after one piece
    assert gen.last_result.text == first and len(gen.last_result.tokens) >= 1


def test_a_closed_stream_is_cancelled_and_each_call_resets_last_result():
    gen = tiny_generator(tiny_model())
    assert gen.last_result.text == "" and gen.last_result.finish_reason == ""          # nothing generated yet
    stream = gen.stream([1, 2, 3], max_new_tokens=20)
    next(stream)
    stream.close()
    r = gen.last_result
    assert r.finish_reason == "cancelled" and r.metrics["wall_seconds"] > 0 and r.metrics["tokens_per_second"] > 0
    full = gen.generate([4, 5, 6], max_new_tokens=5)
    assert gen.last_result == full
    gen.generate([[1, 2], [3, 4, 5]], max_new_tokens=3)
    assert gen.last_result == full                                     # a list of prompts leaves it as it was
    with pytest.raises(SpecdecError):
        gen.stream([], max_new_tokens=5)
    assert gen.last_result.tokens == []                                                # not the earlier call's


def test_a_dropped_stream_held_by_a_reference_cycle_does_not_block_the_generator():
    """A consumer that keeps the exception it raised inside `for piece in stream` keeps the suspended stream
    alive in a reference cycle; the next call (this thread or another) collects it instead of waiting forever
    or refusing."""
    import gc
    import threading

    gen = tiny_generator(tiny_model())
    want = gen.generate([7, 8, 9], max_new_tokens=6).tokens

    def consume_and_fail() -> None:
        kept = []
        try:
            for _ in gen.stream([1, 2, 3], max_new_tokens=30):
                raise ValueError("the consumer fails")
        except ValueError as e:
            kept.append(e)                               # frame -> exception -> traceback -> frame: a cycle
        kept.append(kept)

    gc.disable()
    try:
        consume_and_fail()
        got: list = []
        other = threading.Thread(target=lambda: got.append(gen.generate([7, 8, 9], max_new_tokens=6).tokens))
        other.start()
        other.join(30)
        assert got == [want]                                                          # another thread: served
        consume_and_fail()
        assert gen.generate([7, 8, 9], max_new_tokens=6).tokens == want              # this thread: served
    finally:
        gc.enable()


def test_a_call_waiting_for_a_running_generation_does_not_collect_garbage(monkeypatch):
    """A waiting thread collects garbage only while the turn's holder makes no progress (a dropped stream): a full
    collection every half second slowed the running generation up to 16x in a program holding millions of objects."""
    import gc
    import threading

    from specdec.engine import Engine

    gen = tiny_generator(tiny_model())
    step = Engine.step

    def slow_step(self):
        time.sleep(0.05)
        return step(self)

    monkeypatch.setattr(Engine, "step", slow_step)
    collections: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(1) or 0)
    started = threading.Event()

    def long_run() -> None:
        stream = gen.stream([1, 2, 3], max_new_tokens=40)
        next(stream)
        started.set()
        for _ in stream:
            pass

    holder = threading.Thread(target=long_run)
    holder.start()
    started.wait(30)
    waiter = threading.Thread(target=lambda: gen.generate([7, 8, 9], max_new_tokens=2))
    waiter.start()
    holder.join(60)
    waiter.join(60)
    assert gen.last_result is not None and not collections


def test_a_dropped_stream_closed_by_another_thread_sets_its_own_threads_last_result():
    """The stream's result goes to the thread that iterated it, though a waiting call in another thread is what
    collects and closes it (the other thread's `last_result` used to show it, and its own stayed unfinished)."""
    import gc
    import threading

    gen = tiny_generator(tiny_model())

    def take_two_and_drop() -> None:
        stream = gen.stream([1, 2, 3], max_new_tokens=30)
        next(stream), next(stream)
        kept: list = [stream]
        kept.append(kept)                                # a cycle: only a collection closes the stream

    gc.disable()
    try:
        take_two_and_drop()
        seen: list = []

        def other() -> None:
            gen.generate([7, 8, 9, 10], max_new_tokens=4)                  # a batch-free call that sets nothing
            seen.append(gen.last_result)

        t = threading.Thread(target=other)
        t.start()
        t.join(30)
    finally:
        gc.enable()
    assert seen and seen[0].prompt_tokens == 4 and len(seen[0].tokens) == 4          # its own call's result
    assert gen.last_result.finish_reason == "cancelled" and gen.last_result.prompt_tokens == 3


def test_ctrl_c_inside_a_stream_leaves_a_cancelled_result(monkeypatch):
    from specdec.engine import Engine

    gen = tiny_generator(tiny_model())
    want = gen.generate([7, 8, 9], max_new_tokens=6).tokens
    step, calls = Engine.step, []

    def interrupted_step(self):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Engine, "step", interrupted_step)
    pieces = []
    with pytest.raises(KeyboardInterrupt):
        for piece in gen.stream([1, 2, 3], max_new_tokens=30):
            pieces.append(piece)
    assert gen.last_result.finish_reason == "cancelled" and 0 < len(gen.last_result.tokens) < 30
    monkeypatch.setattr(Engine, "step", step)
    assert gen.generate([7, 8, 9], max_new_tokens=6).tokens == want


def test_a_stale_running_marker_without_the_turn_is_ignored():
    """An interrupt between releasing the turn and clearing the marker must not lock the thread out."""
    import threading

    gen = tiny_generator(tiny_model())
    gen._running_in = threading.get_ident()
    assert gen.generate([1, 2], max_new_tokens=3).tokens


def test_an_open_stream_refuses_a_call_from_its_own_thread():
    gen = tiny_generator(tiny_model())
    stream = gen.stream([1, 2, 3], max_new_tokens=30)
    next(stream)
    with pytest.raises(SpecdecError, match="already generating in this thread"):
        gen.generate([1, 2], max_new_tokens=3)
    stream.close()
    assert gen.generate([1, 2], max_new_tokens=3).tokens


def test_a_bad_prompt_in_a_list_is_named_by_its_index():
    gen = tiny_generator(tiny_model())
    with pytest.raises(SpecdecError, match="prompt 1 of the list: empty prompt"):
        gen.generate([[1, 2], []], max_new_tokens=3)


def test_a_generator_says_what_it_is_and_the_package_lists_its_public_names():
    import specdec
    from specdec.names import unknown

    gen = tiny_generator(tiny_model())
    assert repr(gen).startswith("Generator('tiny', method='none', draft_policy='fixed', num_draft_tokens=4")
    assert {"load", "Generator", "Result", "SamplingParams", "SpecdecError", "METHODS", "__version__"} <= set(dir(specdec))
    assert not {"importlib", "TYPE_CHECKING", "_LAZY", "apply_isa_limit", "annotations"} & set(dir(specdec))
    assert "did you mean" not in unknown("method", ["none"], ["none", "suffix"])


def test_a_failed_command_leaves_no_empty_directory_it_made(tmp_path):
    """export and bench: the output folder and the parents it created go again when the command fails; folders
    that existed, or that hold something, stay."""
    from specdec.files import no_empty_dirs_left

    out = tmp_path / "a" / "b" / "c"
    with pytest.raises(SpecdecError):
        with no_empty_dirs_left(out):
            out.mkdir(parents=True)
            raise SpecdecError("failed")
    assert tmp_path.exists() and not (tmp_path / "a").exists()
    with pytest.raises(KeyboardInterrupt):
        with no_empty_dirs_left(out):
            out.mkdir(parents=True)
            (tmp_path / "a" / "kept.txt").write_text("x")
            raise KeyboardInterrupt
    assert (tmp_path / "a" / "kept.txt").exists() and not (tmp_path / "a" / "b").exists()
    with no_empty_dirs_left(out):
        out.mkdir(parents=True)
    assert out.is_dir()                                     # a command that succeeds keeps its folders


def test_a_registered_model_given_by_its_path_is_that_model(tmp_path):
    """The default model's own GGUF by path keeps its name (and so its shipped drafts and heads); another file
    of the same name is another model."""
    from specdec.models.registry import resolve

    name, path = resolve("smollm2-135m")
    assert resolve(str(path)) == (name, path)
    other = tmp_path / path.name
    other.write_bytes(b"GGUF")
    assert resolve(str(other)) == (other.stem, other)


def test_unreadable_prompt_files_and_pipes(tmp_path, monkeypatch, capsys):
    """A file that cannot be read is a one-line error; a pipe (`<(...)`) is read like a file; both before the
    model loads."""
    import os
    import specdec

    monkeypatch.setattr(specdec, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    locked = tmp_path / "locked.txt"
    locked.write_text("hi")
    real_read = type(locked).read_bytes

    def refuse(path):                                  # (as root a mode-000 file is still readable)
        if path.name == "locked.txt":
            raise PermissionError(13, "Permission denied")
        return real_read(path)

    monkeypatch.setattr(type(locked), "read_bytes", refuse)
    assert main(["generate", "--prompt-file", str(locked)]) == 2
    assert capsys.readouterr().err.strip() == f"specdec: error: cannot read the prompt file {locked}: Permission denied"
    from specdec.cli import read_text

    r, w = os.pipe()                                   # what bash's <(echo Say hi) hands over: /dev/fd/N
    os.write(w, "Say hi".encode())
    os.close(w)
    assert read_text(f"/dev/fd/{r}", "prompt") == "Say hi"
    os.close(r)


@pytest.mark.parametrize("name", ["", "   "])
def test_an_empty_model_name_is_named_as_such(name):
    with pytest.raises(SpecdecError, match=r"the model must be a registered name \(smollm2-135m"):
        specdec.load(name)


@pytest.mark.integration
def test_chat_on_a_model_without_a_chat_template_is_refused_before_it_loads(monkeypatch, capsys):
    """gemma3-270m is a base model: `--chat` is refused from its tokenizer, not after the weights load."""
    import specdec.api as api

    monkeypatch.setattr(api, "load_model", lambda *a: (_ for _ in ()).throw(RuntimeError("got past the checks")))
    assert main(["generate", "--model", "gemma3-270m", "--chat", "--prompt", "hi"]) == 2
    assert "gemma3-270m has no chat template (a base model?)" in capsys.readouterr().err


@pytest.mark.integration
def test_staged_with_a_draft_of_another_tokenizer_is_refused_before_the_models_load(monkeypatch):
    import specdec.api as api

    monkeypatch.setattr(api, "load_model", lambda *a: (_ for _ in ()).throw(RuntimeError("got past the checks")))
    with pytest.raises(SpecdecError, match="method 'staged' needs a draft with the target's tokenizer; 'gemma3-270m'"):
        specdec.load("smollm2-135m", method="staged", draft_model="gemma3-270m")
    with pytest.raises(RuntimeError, match="got past the checks"):
        specdec.load("smollm2-135m", method="staged", draft_model="smollm2-135m")


def test_caches_too_large_for_memory_are_one_line(monkeypatch):
    """The caches are reserved for the prompt plus max_new_tokens of every row: where that exceeds memory the
    allocator's RuntimeError became a SpecdecError saying what to lower."""
    gen = tiny_generator(tiny_model())
    model = gen.target

    def no_memory(rows, slots):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 6039797760 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(model, "new_cache", no_memory)
    with pytest.raises(SpecdecError, match=r"not enough memory for the caches of 2 sequence\(s\) of up to \d+ tokens "
                                           r"\(one of them 5.6 GiB\).*fewer new tokens or fewer prompts"):
        gen.generate([[1, 2], [3, 4]], max_new_tokens=8)


def test_a_device_file_is_no_gguf_and_numpy_integers_are_draft_lengths():
    with pytest.raises(SpecdecError, match="/dev/null is not a regular file, not a GGUF file"):
        specdec.load("/dev/null")
    assert make_policy("fixed", np.int64(4)).__class__.__name__ == "Fixed"       # as max_new_tokens and seed take
    with pytest.raises(SpecdecError, match="num_draft_tokens must be an integer"):
        make_policy("fixed", np.float64(4))


def test_finished_threads_results_are_not_kept_for_ever():
    import threading

    gen = tiny_generator(tiny_model())
    for _ in range(100):
        t = threading.Thread(target=lambda: gen.generate([1, 2], max_new_tokens=1))
        t.start()
        t.join()
    assert len(gen._last) <= 2                        # a thread's entry goes with its Thread object


def test_a_new_thread_never_sees_a_finished_threads_result():
    """Thread ids are reused once a thread ends: a new thread that made no call read the finished one's Result."""
    import threading

    gen = tiny_generator(tiny_model())
    for _ in range(30):
        seen = []
        first = threading.Thread(target=lambda: gen.generate([1, 2], max_new_tokens=4))
        first.start()
        first.join()
        second = threading.Thread(target=lambda: seen.append(gen.last_result))
        second.start()
        second.join()
        assert seen[0].tokens == [] and seen[0].finish_reason == "", (first.ident, second.ident)


def test_empty_results_are_not_shared():
    a, b = tiny_generator(tiny_model()), tiny_generator(tiny_model())
    a.last_result.tokens.append(7)
    a.last_result.metrics["new_tokens"] = 99
    assert b.last_result.tokens == [] and b.last_result.metrics["new_tokens"] == 0
    assert a.last_result.tokens == []


def test_a_suspended_or_dropped_stream_leaves_no_thread_in_inference_mode():
    """Inference mode is entered per engine step: a stream suspended between pieces, or dropped and closed by
    another thread, used to leave its consumer's thread in inference mode (autograd off for whatever ran next)."""
    import gc
    import threading

    gen = tiny_generator(tiny_model())
    stream = gen.stream([1, 2, 3], max_new_tokens=20)
    next(stream), next(stream)
    assert not torch.is_inference_mode_enabled()
    kept: list = [stream]
    kept.append(kept)
    del stream, kept
    gc.disable()
    try:
        t = threading.Thread(target=lambda: gen.generate([7, 8], max_new_tokens=2))   # collects and closes it
        t.start()
        t.join(30)
    finally:
        gc.enable()
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
