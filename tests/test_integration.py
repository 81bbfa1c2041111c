"""The real GGUF models: exactness against the slow reference, lossless speculation on real prompts, CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec.api import Generator, early_exit_draft, load_model, make_proposer
from specdec.bench.suites import load_suite
from specdec.proposers.base import NoProposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.lookahead import LookaheadProposer
from specdec.proposers.ngram import NgramProposer
from specdec.reference import reference_greedy
from specdec.tree import TreeShape

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def target():
    model, tok, name = load_model("smollm2-135m", "float32")
    return model, tok


def prompts(n: int) -> list[str]:
    return [p.turns[0] for p in load_suite("mini")][:n]


def test_cached_greedy_equals_reference(target):
    model, tok = target
    gen = Generator(model, tok, NoProposer())
    for text in prompts(2):
        ids = tok.encode(text, chat=True)
        assert gen.generate(ids, max_new_tokens=20).tokens == reference_greedy(model, ids, 20, tok.eos_ids)


def test_ragged_batch_equals_one_by_one(target):
    model, tok = target
    gen = Generator(model, tok, NoProposer())
    ps = prompts(3)
    batch = gen.generate(ps, max_new_tokens=24)
    assert [r.tokens for r in batch] == [gen.generate(p, max_new_tokens=24).tokens for p in ps]


@pytest.fixture(scope="module")
def target_auto():
    """The target in the dtype `auto` picks on this machine (bfloat16 where the CPU has it, else float32)."""
    model, tok, name = load_model("smollm2-135m", "auto")
    assert model.self_check.passed, model.self_check.summary()
    assert model.self_check.dtype == model.compute                 # one name for the mode: q4 where auto chose it
    return model, tok


@pytest.mark.exactness
@pytest.mark.parametrize("dtype", ["float32", "auto"])
@pytest.mark.parametrize("method", ["ngram", "draft", "lookahead"])
def test_speculation_is_lossless_on_real_prompts(request, method, dtype):
    """Token-identical to plain decoding, in float32 and in the dtype `auto` picks here."""
    model, tok = request.getfixturevalue("target" if dtype == "float32" else "target_auto")
    ps = prompts(12)
    plain = Generator(model, tok, NoProposer()).generate(ps, max_new_tokens=40)
    proposer = {"ngram": NgramProposer, "lookahead": LookaheadProposer,
                "draft": lambda: DraftModelProposer(early_exit_draft(model, "self:10"))}[method]()
    spec = Generator(model, tok, proposer, "fixed", 4).generate(ps, max_new_tokens=40)
    for a, b in zip(plain, spec):
        assert b.tokens == a.tokens and b.text == a.text
    assert sum(r.metrics["acceptance_rate"] for r in spec) > 0


@pytest.mark.exactness
@pytest.mark.parametrize("method, tree", [("draft", TreeShape()), ("eagle", TreeShape()),
                                          ("eagle", TreeShape(4, 16)), ("medusa", TreeShape()),
                                          ("hybrid", TreeShape()), ("staged", TreeShape()),
                                          ("eagle3", TreeShape()), ("self", TreeShape())])
def test_shipped_drafts_are_lossless_on_real_prompts(target_auto, method, tree):
    """The weights we ship (distilled draft alone and staged, EAGLE chain and dynamic tree, EAGLE-3, the self-speculation
    exit, Medusa static tree, hybrid), 12 real
    prompts batched, in the dtype `auto` picks on this machine."""
    model, tok = target_auto
    ps = prompts(12)
    plain = Generator(model, tok, NoProposer()).generate(ps, max_new_tokens=32)
    proposer = make_proposer(method, model, tok, None, "auto", "cpu", tree)
    spec = Generator(model, tok, proposer, "fixed", 4).generate(ps, max_new_tokens=32)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert sum(r.metrics["target_forwards"] for r in spec) < sum(r.metrics["target_forwards"] for r in plain)


@pytest.mark.exactness
def test_top_p_sampling_on_real_prompts_is_plain_sampling_with_either_cut(target_auto, monkeypatch):
    """Seeded top-p (with and without top-k) on smollm2's 49,152 tokens, 6 real prompts batched: a point-mass method
    samples exactly what plain sampling does, and the cut found among each row's most likely tokens gives what
    sorting whole rows gives."""
    import specdec.sampling as sampling

    model, tok = target_auto
    ps = prompts(6)
    for kw in (dict(temperature=0.8, top_p=0.9, seed=4), dict(temperature=1.0, top_k=50, top_p=0.95, seed=5)):
        plain = [r.tokens for r in Generator(model, tok, NoProposer()).generate(ps, max_new_tokens=24, **kw)]
        spec = Generator(model, tok, NgramProposer(), "fixed", 4).generate(ps, max_new_tokens=24, **kw)
        assert [r.tokens for r in spec] == plain
        monkeypatch.setattr(sampling, "NUCLEUS_WINDOWS", ())                     # whole rows sorted
        assert [r.tokens for r in Generator(model, tok, NoProposer()).generate(ps, max_new_tokens=24, **kw)] == plain
        monkeypatch.undo()


def test_streaming_and_stop_strings(target):
    model, tok = target
    gen = Generator(model, tok, NgramProposer())
    full = gen.generate("List three colors, one per line.", max_new_tokens=40)
    pieces = list(gen.stream("List three colors, one per line.", max_new_tokens=40))
    assert "".join(pieces) == full.text and len(pieces) > 3
    stop = full.text.strip().split("\n")[1][:3] if "\n" in full.text.strip() else full.text[5:8]
    cut = gen.generate("List three colors, one per line.", max_new_tokens=40, stop=[stop])
    assert stop not in cut.text and full.text.startswith(cut.text) and cut.finish_reason == "stop"


def test_gemma3_cached_greedy_equals_reference():
    model, tok, _ = load_model("gemma3-270m", "float32")
    assert not tok.has_chat_template
    ids = tok.encode("The three primary colors are", chat=False)
    gen = Generator(model, tok, NoProposer())
    assert gen.generate(ids, max_new_tokens=12).tokens == reference_greedy(model, ids, 12, tok.eos_ids)
    text = gen.generate("The three primary colors are", max_new_tokens=4)        # chat "auto": no template here
    assert text.tokens == gen.generate(ids, max_new_tokens=4).tokens and text.prompt_tokens == len(ids)


def test_a_draft_with_another_tokenizer_is_lossless():
    """gemma3-270m drafted by smollm2-135m (token-level intersection), greedy, token-identical to plain."""
    model, tok, _ = load_model("gemma3-270m", "auto")
    ps = ["The three primary colors are", "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n"]
    plain = Generator(model, tok, NoProposer()).generate(ps, max_new_tokens=24, chat=False)
    proposer = make_proposer("draft", model, tok, "smollm2-135m", "auto", "cpu")
    assert proposer.map.overlap > 0.9
    spec = Generator(model, tok, proposer, "fixed", 3).generate(ps, max_new_tokens=24, chat=False)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert sum(r.metrics["accepted_prediction_tokens"] for r in spec) == 0 and sum(r.metrics["acceptance_rate"] for r in spec) > 0


@pytest.mark.parametrize("method, source", [("suffix", None), ("self", "self:14"), ("lookahead", None)])
def test_gemma3_in_q4_is_lossless_with_its_8_bit_and_6_bit_layers(method, source):
    """gemma3-270m in its default mode (4-bit, 8-bit-code and dense layers side by side in the layer loop):
    methods that draft without a trained head (self: its first 14 layers and its own head), K = 4,
    two prompts batched, token-identical to plain decoding."""
    model, tok, _ = load_model("gemma3-270m", "auto")
    ps = ["The three primary colors are", "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n"]
    plain = Generator(model, tok, NoProposer()).generate(ps, max_new_tokens=32, chat=False)
    proposer = make_proposer(method, model, tok, source, "auto", "cpu")
    spec = Generator(model, tok, proposer, "fixed", 4).generate(ps, max_new_tokens=32, chat=False)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert sum(r.metrics["target_forwards"] for r in spec) < sum(r.metrics["target_forwards"] for r in plain)


def test_the_vocabulary_map_names_the_tokens_the_target_writes():
    """Gemma spells "." both as its token "." and as the byte-fallback token <0x2E>; a draft mapped onto the one
    the target never writes is never accepted. Every common piece maps onto the id Gemma's tokenizer gives it."""
    from pathlib import Path

    from specdec.api import resolve
    from specdec.models.tokenizer import Tokenizer
    from specdec.proposers.cross_vocab import VocabMap

    draft, target = (Tokenizer.from_gguf(Path(resolve(name)[1])) for name in ("smollm2-135m", "gemma3-270m"))
    m = VocabMap(draft, target, 262_144)
    for text in [".", ",", "1", "7", "I", ":", "?", "-", "'", " the", "\n", " ("]:
        d, t = (tok.backend.encode(text, add_special_tokens=False).ids for tok in (draft, target))
        assert len(d) == len(t) == 1 and m.d2t[d[0]].item() == t[0], text


def test_predicted_outputs_on_the_cli(tmp_path):
    """--prediction-file: the plain answer with one word changed as the prediction; the output is the plain one,
    drafted mostly from the prediction."""
    run = lambda *extra: json.loads(subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "--prompt", "Describe a sunny day at the beach.",
         "--max-new-tokens", "40", "--json", *extra], capture_output=True, text=True, timeout=300, check=True).stdout)
    plain = run()
    words = plain["text"].split(" ")
    words[len(words) // 2] = "zebra"
    (tmp_path / "p.txt").write_text(" ".join(words))
    predicted = run("--prediction-file", str(tmp_path / "p.txt"))
    assert predicted["tokens"] == plain["tokens"]
    assert predicted["metrics"]["accepted_prediction_tokens"] >= 20
    assert predicted["metrics"]["target_forwards"] < plain["metrics"]["target_forwards"] // 2


def test_cli_json_contract():
    out = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--prompt", "Say hello.",
                          "--max-new-tokens", "12", "--method", "ngram", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)                                # exactly one JSON object
    assert set(obj) >= {"text", "tokens", "metrics"}
    m = obj["metrics"]
    for key in ("new_tokens", "target_forwards", "tau", "acceptance_rate", "tokens_per_second", "wall_seconds",
                "acceptance_per_position", "draft_seconds", "target_seconds"):
        assert key in m
    assert m["new_tokens"] == len(obj["tokens"]) and m["tau"] >= 1.0
    rt = obj["runtime"]                                         # the machine, dtype and self-check are named
    assert rt["dtype"] in ("float32", "bfloat16", "q4") and rt["self_check"]["passed"] and rt["cpu"]
    assert obj["method"] == "ngram"
    assert "logprobs" not in obj
    plain = json.loads(subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--prompt", "Say hello.",
                                       "--max-new-tokens", "12", "--method", "none", "--json", "--logprobs", "2"],
                                      capture_output=True, text=True, timeout=300).stdout)
    assert plain["metrics"]["tau"] == 1.0 and plain["metrics"]["acceptance_rate"] is None
    default = json.loads(subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--prompt", "Say hello.",
                                         "--max-new-tokens", "12", "--json", "--logprobs", "2"], capture_output=True,
                                        text=True, timeout=300).stdout)
    assert default["method"] == "suffix" and default["tokens"] == plain["tokens"]      # speculation on by default
    assert default["logprobs"] == plain["logprobs"]                            # the same bits in q4 too
    lps = plain["logprobs"]
    assert [x["token"] for x in lps] == plain["tokens"] and all(len(x["top"]) == 2 for x in lps)
    assert all(x["top"][0] == [x["token"], x["logprob"]] for x in lps)                 # greedy: the most likely
    assert "".join(x["text"] for x in lps).startswith(plain["text"])


@pytest.fixture(scope="module")
def long_plain(target_auto):
    """Two real prompts' plain greedy outputs of 160 tokens (the source of the predictions below)."""
    model, tok = target_auto
    ps = prompts(8)[3:5]
    return ps, Generator(model, tok, NoProposer()).generate(ps, max_new_tokens=160)


CORNERS = [(2, 0, 40), (4, 60, 72), (7, 150, 160)]        # (K, prediction tokens, new tokens)


@pytest.mark.slow            # about 9 min on one core: once per `make test`, not again under SPECDEC_ISA=avx2
@pytest.mark.parametrize("method", ["ngram", "suffix", "lookahead", "draft", "staged", "self", "eagle", "eagle3",
                                    "medusa", "hybrid"])
def test_every_method_at_every_draft_length_and_prediction_is_plain_decoding(target_auto, long_plain, method):
    """K = 2, 4, 7 with predictions of 0, 60 and 150 tokens (the plain output's beginning, followed and then left),
    the largest trees at K = 7; two real prompts batched; token-identical to plain decoding."""
    model, tok = target_auto
    ps, plain = long_plain
    proposer = make_proposer(method, model, tok, None, "auto", "cpu")
    for k, n_pred, new in CORNERS:
        if k == 7 and method in ("eagle", "eagle3", "lookahead"):          # the largest trees
            source = "16,8,16" if method == "lookahead" else None
            tree = TreeShape(4, 64) if method != "lookahead" else TreeShape()
            proposer = make_proposer(method, model, tok, source, "auto", "cpu", tree)
        preds = [tok.decode(r.tokens[:n_pred]) if n_pred else "" for r in plain]
        spec = Generator(model, tok, proposer, "fixed", k).generate(ps, max_new_tokens=new, prediction=preds)
        assert [r.tokens for r in spec] == [r.tokens[:new] for r in plain], (method, k, n_pred)
