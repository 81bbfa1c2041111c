"""EAGLE-3 heads: training-time test computes what drafting computes."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import tiny_model
from specdec.models.eagle3 import Eagle3Config, Eagle3Head
from specdec.train.eagle3 import ttt_unroll


def _head(seed: int = 0, vocab: int = 97, ids: torch.Tensor = torch.arange(0, 80, 2),
          layers: int = 1) -> tuple[object, Eagle3Head]:
    target = tiny_model(seed=seed, layers=6, vocab=vocab, std=0.5 if vocab < 97 else 0.3)
    torch.manual_seed(seed)
    cfg = replace(Eagle3Config.for_target(target, len(ids)), extra_layers=layers - 1)
    head = Eagle3Head(target, cfg, ids).init_from_target()
    for p in head.parameters():                       # larger weights: attention patterns that matter
        p.data.normal_(0, 0.2)
    return target, head.eval()


def _target_features(target, toks, head):
    cache = target.new_cache(1, 64)
    T = toks.shape[1]
    return target(toks, torch.arange(T)[None], cache, torch.tensor([0]), features=head.feature_layers)


@pytest.mark.parametrize("layers", [1, 2])
@torch.no_grad()
def test_training_time_test_matches_drafting_step_by_step(layers):
    target, head = _head(layers=layers)
    toks = torch.tensor([[5, 17, 3, 44, 90, 12, 7, 61, 33, 2, 80, 15]])
    feats = _target_features(target, toks, head)                                   # [1, T, 4H]
    outs = ttt_unroll(head, toks, feats, steps=4)
    W = toks.shape[1] - 1
    for last in (0, 3, 6):                              # position with target features; drafting from it
        cache = head.new_cache(1, 32)
        rows = torch.tensor([0])
        n = last + 1                                    # committed pairs (g_i, x_{i+1}) for i <= last
        h = head(toks[:, 1:n + 1], head.input_features(feats[:, :n]), torch.arange(n)[None], cache, rows)
        cache.commit(rows, torch.arange(n)[None], torch.tensor([n]))
        assert torch.allclose(h[0, -1], outs[0][0, last], atol=1e-4)
        prev = h[:, -1:]
        for s in range(1, 4):                           # draft step s at position last+s
            j = last + s
            if j >= W:
                break
            prev = head(toks[:, j + 1:j + 2], prev, torch.tensor([[j]]), cache, rows)
            cache.commit(rows, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
            assert torch.allclose(prev[0, 0], outs[s][0, j], atol=1e-4), (last, s)


@torch.no_grad()
def test_unrolled_steps_differ_from_teacher_forcing():
    """Step s >= 1 really reads the head's own outputs (a mutant feeding g again would pass the test above
    only at step 0)."""
    target, head = _head(seed=1)
    toks = torch.tensor([[5, 17, 3, 44, 90, 12, 7, 61]])
    outs = ttt_unroll(head, toks, _target_features(target, toks, head), steps=3)
    assert not torch.allclose(outs[0][0, 3:], outs[1][0, 3:], atol=1e-3)


# ---- export / import ---------------------------------------------------------------------
def test_export_has_the_names_and_shapes_vllm_and_sglang_load(tmp_path):
    """What vLLM's llama_eagle3.py and SGLang's llama_eagle3.py read: midlayer.* (q/k/v over 2H), fc [H, 3H],
    norm, lm_head [draft_vocab, H], d2t as target-minus-draft offsets, t2d as a bool mask, a Llama config
    with draft_vocab_size and eagle_aux_hidden_state_layer_ids."""
    import json

    from safetensors.torch import load_file

    from specdec.export import export_eagle3

    target, head = _head()
    H, c = target.config.dim, head.cfg
    for fmt in ("vllm", "sglang"):
        out = export_eagle3(head, fmt, tmp_path / fmt)
        sd = load_file(str(out / "model.safetensors"))
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == 97
        assert cfg["eagle_aux_hidden_state_layer_ids"] == list(c.aux_layers) and not cfg["tie_word_embeddings"]
        # SGLang reads eagle_config's ids and captures each one's output (the input of the next layer)
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in c.aux_layers]
        assert sd["fc.weight"].shape == (H, 3 * H)
        q_out = c.n_heads * c.head_dim
        assert sd["midlayer.self_attn.q_proj.weight"].shape == (q_out, 2 * H)
        assert sd["midlayer.self_attn.k_proj.weight"].shape == (c.n_kv_heads * c.head_dim, 2 * H)
        for n in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                  "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
                  "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.self_attn.o_proj.weight",
                  "norm.weight"):
            assert n in sd, n
        assert sd["lm_head.weight"].shape == (40, H)
        assert torch.equal(sd["d2t"] + torch.arange(40), torch.arange(0, 80, 2))
        assert sd["t2d"].dtype == torch.bool and int(sd["t2d"].sum()) == 40 and bool(sd["t2d"][78])
        assert not any("embed" in k for k in sd)


@torch.no_grad()
def test_an_exported_head_imports_onto_the_target_and_drafts_the_same(tmp_path):
    from specdec.export import export_eagle3, import_eagle3

    target, head = _head(seed=2)
    out = export_eagle3(head, "vllm", tmp_path / "e3")
    back = import_eagle3(out, target)
    head.prepare(target.dtype)
    toks = torch.tensor([[5, 17, 3, 44, 90, 12]])
    feats = _target_features(target, toks, head)
    a = head.logits(head(toks[:, 1:], head.input_features(feats[:, :-1]), torch.arange(5)[None],
                         head.new_cache(1, 8), torch.tensor([0])))
    b = back.logits(back(toks[:, 1:], back.input_features(feats[:, :-1]), torch.arange(5)[None],
                         back.new_cache(1, 8), torch.tensor([0])))
    assert torch.equal(back.vocab_ids, head.vocab_ids)
    assert torch.allclose(a, b, atol=0.05, rtol=0.02)            # bf16 export of float32 weights
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_import_refuses_a_head_of_another_target(tmp_path):
    import json

    import pytest

    from specdec.errors import SpecdecError
    from specdec.export import export_eagle3, import_eagle3

    target, head = _head()
    out = export_eagle3(head, "sglang", tmp_path / "e3")
    cfg = json.loads((out / "config.json").read_text())
    cfg["hidden_size"] = 4096
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdecError, match="another target: hidden_size 4096"):
        import_eagle3(out, target)
    with pytest.raises(SpecdecError, match="not an EAGLE-3 export"):
        import_eagle3(tmp_path, target)


def test_import_of_a_damaged_export_is_one_line(tmp_path):
    import json
    import shutil

    import pytest
    from safetensors.torch import load_file, save_file

    from specdec.errors import SpecdecError
    from specdec.export import export_eagle3, import_eagle3

    target, head = _head()
    good = export_eagle3(head, "vllm", tmp_path / "good")
    cfg = json.loads((good / "config.json").read_text())

    def damaged(name: str, config=None, tensors=None, raw: bytes | None = None):
        d = tmp_path / name
        shutil.copytree(good, d)
        if config is not None:
            (d / "config.json").write_text(json.dumps(config))
        if tensors is not None:
            save_file(tensors, str(d / "model.safetensors"))
        if raw is not None:
            (d / "model.safetensors").write_bytes(raw)
        return d

    sd = load_file(str(good / "model.safetensors"))
    cases = [
        (damaged("json", config=None), None),
        (damaged("inter", {k: v for k, v in cfg.items() if k != "intermediate_size"}), "names no intermediate_size"),
        (damaged("vocab", {**cfg, "draft_vocab_size": cfg["draft_vocab_size"] + 3}), "offsets for a draft vocabulary"),
        (damaged("d2t", tensors={**sd, "d2t": sd["d2t"] + 10_000}), "its d2t gives leave the target's vocabulary"),
        (damaged("trunc", raw=(good / "model.safetensors").read_bytes()[:100]), "corrupt weights file"),
    ]
    (cases[0][0] / "config.json").write_text("{not json")
    cases[0] = (cases[0][0], "is not JSON")
    for d, message in cases:
        with pytest.raises(SpecdecError, match=message):
            import_eagle3(d, target)


def test_a_config_in_sglangs_count_and_bad_aux_fields(tmp_path):
    """A config naming its aux layers only in eagle_config (SGLang's count: the layers whose output is taken)
    imports onto the same layers; malformed aux fields are one line, not a traceback."""
    import json

    import pytest

    from specdec.errors import SpecdecError
    from specdec.export import export_eagle3, import_eagle3

    target, head = _head()
    out = export_eagle3(head, "sglang", tmp_path / "e3")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]
    (out / "config.json").write_text(json.dumps(cfg))
    assert import_eagle3(out, target).cfg.aux_layers == head.cfg.aux_layers
    for bad, message in [({"eagle_config": "x"}, "eagle_config must be an object"),
                         ({"eagle_aux_hidden_state_layer_ids": ["1", "2", "3"]}, "must be a list of integers"),
                         ({"eagle_aux_hidden_state_layer_ids": [1.5, 2, 3]}, "must be a list of integers"),
                         ({"num_hidden_layers": "one"}, "only one-layer heads")]:
        (out / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(SpecdecError, match=message):
            import_eagle3(out, target)


def test_an_interrupted_export_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    """Ctrl-C (or a full disk) while the files are written: no half export, an earlier one intact."""
    import pytest

    import specdec.export as export

    target, head = _head()
    first = export.export_eagle3(head, "vllm", tmp_path / "e3")
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    real = export._write_file

    def interrupted(path, data):
        if path.name == "config.json":
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(export, "_write_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export.export_eagle3(head, "sglang", tmp_path / "e3", overwrite=True)
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before          # no temporary folder either
    with pytest.raises(KeyboardInterrupt):
        export.export_eagle3(head, "vllm", tmp_path / "new")
    assert list((tmp_path / "new").iterdir()) == []


def test_an_export_refuses_a_folder_with_other_weights_and_imports_its_own(tmp_path):
    import shutil

    import pytest

    from specdec.errors import SpecdecError
    from specdec.export import export_eagle3, import_eagle3

    target, head = _head()
    out = export_eagle3(head, "vllm", tmp_path / "e3")
    shutil.copy(out / "model.safetensors", tmp_path / "old.safetensors")
    (tmp_path / "mixed").mkdir()
    shutil.copy(tmp_path / "old.safetensors", tmp_path / "mixed" / "zz-old-head.safetensors")
    with pytest.raises(SpecdecError, match="holds other weights \\(zz-old-head.safetensors\\)"):
        export_eagle3(head, "vllm", tmp_path / "mixed")
    other, other_head = _head(seed=5)
    export_eagle3(other_head, "vllm", tmp_path / "other")
    shutil.copy(tmp_path / "other" / "model.safetensors", out / "zz-another.safetensors")
    back = import_eagle3(out, target)                                  # model.safetensors only
    assert torch.equal(back.fc.weight, import_eagle3(tmp_path / "e3", target).fc.weight)
    assert torch.equal(back.fc.weight.to(torch.bfloat16), head.fc.weight.to(torch.bfloat16))


def test_medusa_export_matches_vllms_medusa_model(tmp_path):
    import json

    from safetensors.torch import load_file

    from helpers import heads_for
    from specdec.export import export_medusa

    target = tiny_model(seed=0)
    heads = heads_for(target, n=3, vocab=torch.arange(0, 60, 3))
    out = export_medusa(heads, "vllm", tmp_path / "m")
    sd = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    H = target.config.dim
    assert cfg["architectures"] == ["MedusaModel"] and cfg["num_heads"] == 3 and cfg["truncated_vocab_size"] == 20
    assert cfg["medusa_fc_bias"] and cfg["num_hidden_layers"] == 1
    for k in range(3):
        assert sd[f"blocks.{k}.layers.0.weight"].shape == (H, H) and sd[f"blocks.{k}.layers.0.bias"].shape == (H,)
        assert sd[f"lm_heads.{k}.weight"].shape == (20, H)
    assert torch.equal(sd["token_map"], torch.arange(0, 60, 3))
    # the block computes what our head computes: x + silu(W x + b)
    f = torch.randn(H)
    ours = heads.features(f)[1]
    theirs = f + torch.nn.functional.silu(sd["blocks.1.layers.0.weight"].float() @ f + sd["blocks.1.layers.0.bias"].float())
    assert torch.allclose(ours.float(), theirs, atol=0.05)


# ---- drafting with the engine: lossless whatever the head ------------------------------

from helpers import PROMPTS, V, check_joint, exact_joint, sample_engine, tiny_generator  # noqa: E402
from specdec.proposers.eagle import EagleProposer  # noqa: E402
from specdec.reference import reference_greedy  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.draft_length import make_policy  # noqa: E402


def _prepared(seed: int = 0, vocab: int = 97, ids: torch.Tensor = torch.arange(0, 80, 2), layers: int = 1):
    target, head = _head(seed, vocab, ids, layers)
    return target, head.prepare(target.dtype)


@pytest.mark.parametrize("topk, depth, budget, layers", [(1, 4, 4, 1), (1, 2, 2, 1), (3, 3, 8, 1), (1, 4, 4, 2),
                                                         (3, 3, 8, 2)])
@pytest.mark.parametrize("batch", [1, 3])
def test_eagle3_greedy_equals_plain(topk, depth, budget, layers, batch):
    target, head = _prepared(layers=layers)
    gen = tiny_generator(target, EagleProposer(head, topk, depth, budget, name="eagle3"), "fixed", depth)
    for p, r in zip(PROMPTS[:batch], gen.generate(PROMPTS[:batch], max_new_tokens=30)):
        assert r.tokens == reference_greedy(target, p, 30)


@pytest.mark.slow        # 20,000 sequences: `make test`
def test_eagle3_sampling_matches_exact_distribution():
    """A chain (the tree path is the same proposer code, tested with EAGLE heads in test_eagle.py)."""
    topk, depth, budget = 1, 3, 3
    target, head = _prepared(seed=20, vocab=V, ids=torch.arange(0, V - 1))
    params = SamplingParams(1.0, 6, 0.95)
    prompt = [1, 2, 3]
    samples = sample_engine(target, EagleProposer(head, topk, depth, budget, name="eagle3"), params, prompt,
                            n=20_000, k=depth)
    assert check_joint(samples, exact_joint(target, prompt, params)) > 1e-3


@torch.no_grad()
def test_served_agreement_counts_answer_positions_against_the_whole_vocabulary():
    """With the whole vocabulary as draft vocabulary and every token an answer, it is training's agreement;
    rows without answer tokens count nothing; a smaller draft vocabulary can only lose agreement."""
    from specdec.train.eagle3 import served_agreement, ttt_losses
    from specdec.train.magpie import Row

    target, head = _head(seed=4, vocab=97, ids=torch.arange(97))
    toks = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(0))
    feats = [_target_features(target, t[None], head)[0] for t in toks]
    seqs = [t.tolist() for t in toks]
    w = target.output if target.output.numel() else target.embed
    rows = [Row(s, [1] * len(s), "chat", f"r{i}") for i, s in enumerate(seqs)]
    served = served_agreement(head, rows, seqs, feats, {"chat": [0, 1, 2]}, w.float(), 3, 64)["chat"]
    # lengths 19: the last token's successor is unknown, so served agreement cannot count it either
    _, accs = ttt_losses(head, toks, torch.stack(feats).float(), torch.full((3,), 19), w.float(), 3)
    assert served == pytest.approx(accs, abs=1e-4)
    none = [Row(s, [0] * len(s), "chat", f"r{i}") for i, s in enumerate(seqs)]
    assert served_agreement(head, none, seqs, feats, {"chat": [0, 1, 2]}, w.float(), 3, 64)["chat"] == [0.0] * 3


def test_ttt_loss_temperature_sharpens_the_target_toward_its_argmax():
    """Below temperature 1 the loss learns a sharpened target: at a small temperature it is the cross-entropy of
    the target's argmax (the hard label); the agreement it reports does not depend on the temperature."""
    from specdec.train.eagle3 import ttt_losses

    target, head = _head(seed=5, vocab=97, ids=torch.arange(97))
    toks = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    feats = torch.stack([_target_features(target, t[None], head)[0] for t in toks]).float()
    w = (target.output if target.output.numel() else target.embed).float()
    lens = torch.full((2,), 16)
    with torch.no_grad():
        soft, accs = ttt_losses(head, toks, feats, lens, w, 1)
        sharp, accs_sharp = ttt_losses(head, toks, feats, lens, w, 1, temperature=1e-4)
        H = head.cfg.dim
        label = (feats[:, 1:, :H] @ w.T).argmax(-1)                               # [B, W]
        logq = torch.log_softmax(head.logits(next(iter(ttt_unroll(head, toks, feats, 1)))).float(), -1)
        m = (torch.arange(15)[None] + 1 < lens[:, None]).float()
        hard = (-logq.gather(-1, label[..., None])[..., 0] * m).sum() / m.sum()
    assert accs_sharp == accs
    assert float(sharp) == pytest.approx(float(hard), rel=1e-4)
    assert abs(float(sharp) - float(soft)) > 1e-3


def test_ttt_loss_weights_positions_by_whether_the_drafted_token_is_an_answer():
    """answer_weight marks draft position j by the answer mask of window token j + 2 (prompt_weight elsewhere, and
    past a row's end); a weight of 0 on prompt positions gives the loss of the answer positions alone, a weight of
    1 everywhere the unweighted loss."""
    from specdec.train.eagle3 import answer_weight, ttt_losses
    from specdec.train.magpie import Row

    rows = [Row(list(range(12)), [0] * 5 + [1] * 7, "chat", "a/0"), Row(list(range(6)), [0, 0, 1, 1, 1, 1], "qa", "a/1")]
    w = answer_weight(rows, [0, 1], torch.tensor([2, 0]), 8, 0.25)
    assert w.tolist() == [[0.25, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0.25, 0.25, 0.25]]

    target, head = _head(seed=6, vocab=97, ids=torch.arange(97))
    toks = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    feats = torch.stack([_target_features(target, t[None], head)[0] for t in toks]).float()
    wt = (target.output if target.output.numel() else target.embed).float()
    lens = torch.full((2,), 16)
    answer = torch.zeros(2, 15)
    answer[0, 4:] = 1
    answer[1, :6] = 1
    with torch.no_grad():
        plain, accs = ttt_losses(head, toks, feats, lens, wt, 1)
        ones, accs1 = ttt_losses(head, toks, feats, lens, wt, 1, weight=torch.ones(2, 15))
        only, accs0 = ttt_losses(head, toks, feats, lens, wt, 1, weight=answer)
        H = head.cfg.dim
        p = torch.softmax(feats[:, 1:, :H] @ wt.T, -1)
        logq = torch.log_softmax(head.logits(next(iter(ttt_unroll(head, toks, feats, 1)))).float(), -1)
        ce = -(p * logq).sum(-1)                                                   # [B, 15]
        m = (torch.arange(15)[None] + 1 < lens[:, None]).float() * answer
        expect = (ce * m).sum() / m.sum()
    assert float(ones) == pytest.approx(float(plain), rel=1e-6) and accs1 == accs == accs0
    assert float(only) == pytest.approx(float(expect), rel=1e-5)
    assert abs(float(only) - float(plain)) > 1e-4


class _EveryThirdStep:
    """A draft-length policy that drafts k tokens at every third step and none in between; `asked` keeps, per
    step, the drafts it asked for and the tokens per row of the head forwards the test saw in that step."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.asked: list[tuple[int, list[int]]] = []

    def choose(self, batch: int, remaining: int) -> int:
        k = self.k if (len(self.asked) + 1) % 3 == 0 else 0
        self.asked.append((k, []))
        return k

    def observe(self, batch, k, valid, accepted, draft_s, target_s, *, asked) -> None:
        pass


@pytest.mark.parametrize("batch", [1, 3])
def test_plain_steps_cost_the_head_nothing_and_drafting_catches_up(batch):
    """Committed tokens wait until the sequence drafts again, then go through the head in one forward."""
    from specdec.engine import Engine, Request
    from specdec.prefix_cache import PrefixCache

    target, head = _prepared()
    fed: list[int] = []                                   # tokens per row of every head forward
    forward = head.forward
    head.forward = lambda tokens, *a, **kw: (fed.append(tokens.shape[1]), forward(tokens, *a, **kw))[1]
    policy = _EveryThirdStep(3)
    target.pack()
    reqs = [Request(list(p), 30) for p in PROMPTS[:batch]]
    eng = Engine(target, EagleProposer(head, 1, 3, 3, name="eagle3"), policy, lambda ids: "", frozenset(),
                 PrefixCache(0), sum(len(r.prompt) for r in reqs))
    eng.allocate(batch, 96)
    seqs = [eng.add(r) for r in reqs]
    with torch.inference_mode():
        while eng.busy:
            before = len(fed)
            eng.step()
            if policy.asked:
                policy.asked[-1][1].extend(fed[before:])
    for p, s in zip(PROMPTS[:batch], seqs):
        assert s.generated == reference_greedy(target, p, 30)
    plain = [calls for k, calls in policy.asked if k == 0]
    drafting = [calls for k, calls in policy.asked if k > 0]
    assert plain and all(calls == [] for calls in plain)
    assert drafting and all(calls and calls[0] >= 3 for calls in drafting)   # caught up on 3 steps' commits


def test_a_late_long_prompt_catches_up_beside_a_long_history():
    """A short prompt decodes while a long one prefills in pieces; their first shared step feeds the head the long
    prompt beside a row with a long history: padded to one forward it would run past the head's cache."""
    from specdec.engine import Engine, Request
    from specdec.prefix_cache import PrefixCache

    target, head = _prepared()
    target.pack()
    long_prompt = [(7 * i + 3) % 90 + 1 for i in range(200)]    # two prefill pieces, steps apart
    reqs = [Request(long_prompt[:100], 20), Request(long_prompt, 5)]
    eng = Engine(target, EagleProposer(head, 1, 3, 3, name="eagle3"), make_policy("fixed", 3), lambda ids: "",
                 frozenset(), PrefixCache(0), 16)                   # one piece per prefill step
    eng.allocate(2, max(len(r.prompt) + r.max_new_tokens for r in reqs) + 2)
    seqs = [eng.add(r) for r in reqs]
    with torch.inference_mode():
        while eng.busy:
            eng.step()
    for r, s in zip(reqs, seqs):
        assert s.generated == reference_greedy(target, r.prompt, r.max_new_tokens)


@torch.no_grad()
def test_a_widened_head_computes_what_it_computed():
    """`train eagle3 --mlp-width`: the wider MLP's new units start switched off (their down_proj columns zero)."""
    from specdec.train.eagle3 import widened

    target, head = _head()
    wide = widened(head, 2 * head.cfg.hidden_dim, seed=1).eval()
    assert wide.midlayer.mlp.down_proj.weight.shape[1] == 2 * head.cfg.hidden_dim
    toks = torch.tensor([[5, 17, 3, 44, 90, 12]])
    feats = torch.randn(1, 6, head.cfg.dim, generator=torch.Generator().manual_seed(0))
    pos, rows = torch.arange(6)[None], torch.tensor([0])
    a = head.logits(head(toks, feats, pos, head.new_cache(1, 16), rows))
    b = wide.logits(wide(toks, feats, pos, wide.new_cache(1, 16), rows))
    assert torch.allclose(a, b, atol=1e-5)
    assert wide.midlayer.mlp.gate_proj.weight[head.cfg.hidden_dim:].abs().sum() > 0      # new units can learn
    with pytest.raises(Exception, match="narrower"):
        widened(head, head.cfg.hidden_dim // 2, seed=1)


def test_a_deepened_head_computes_what_it_computed(tmp_path):
    """`train eagle3 --head-layers 2`: the new layer starts as an identity (zero o_proj and down_proj); the
    deeper head saves and loads, and refuses the one-layer export formats."""
    from specdec.export import export_eagle3
    from specdec.train.eagle3 import deepened

    target, head = _head()
    deep = deepened(head, 2, seed=1).eval()
    assert deep.cfg.extra_layers == 1 and len(deep.layers) == 1
    toks = torch.tensor([[5, 17, 3, 44, 90, 12]])
    feats = torch.randn(1, 6, head.cfg.dim, generator=torch.Generator().manual_seed(0))
    pos, rows = torch.arange(6)[None], torch.tensor([0])
    with torch.no_grad():
        a = head.logits(head(toks, feats, pos, head.new_cache(1, 16), rows))
        b = deep.logits(deep(toks, feats, pos, deep.new_cache(1, 16), rows))
    assert torch.allclose(a, b, atol=1e-5)
    assert deep.layers[0].self_attn.q_proj.weight.abs().sum() > 0                       # the new layer can learn
    with pytest.raises(Exception, match="only deepens"):
        deepened(deep, 1, seed=1)
    deep.save(tmp_path / "deep.safetensors", {})
    again = Eagle3Head.load(tmp_path / "deep.safetensors", target)
    assert again.cfg.extra_layers == 1
    assert torch.equal(again.layers[0].self_attn.q_proj.weight.float(),
                       deep.layers[0].self_attn.q_proj.weight.to(torch.bfloat16).float())
    with pytest.raises(Exception, match="one-layer"):
        export_eagle3(deep, "vllm", tmp_path / "out")


@torch.no_grad()
def test_a_chain_feeds_each_draft_once_and_leaves_the_committed_cache():
    """A chain's depth-d draft is fed alone after the drafts before it, which stay in the head's cache while the
    chain grows: two ragged rows drafted together draft what each drafts alone, and what the argmax chain gives
    when the whole chain is fed again at every depth; afterwards the cache holds the committed pairs only."""
    from specdec.proposers.base import ActiveBatch
    from specdec.sampling import BatchSampling

    target, head = _prepared()
    prompts = [[5, 17, 3, 44, 90, 12, 7], [61, 33, 2, 80]]
    feats = [_target_features(target, torch.tensor([p]), head)[0] for p in prompts]           # [P, 4H] each
    hidden = torch.zeros(2, 7, feats[0].shape[-1])
    for i, f in enumerate(feats):
        hidden[i, :len(f)] = f

    def drafted(rows: list[int]) -> list[list[int]]:
        prop = EagleProposer(head, 1, 4, 4, name="eagle3")
        prop.allocate(2, 32)
        r = torch.tensor(rows)
        prop.start(r, [prompts[i] for i in rows], hidden[r])
        batch = ActiveBatch(r, [prompts[i] for i in rows], BatchSampling.of([SamplingParams()] * len(rows)),
                            torch.zeros(len(rows), dtype=torch.long))
        out = prop.propose(batch, 4).tokens.tolist()
        assert prop.cache.lengths[r].tolist() == [len(prompts[i]) - 1 for i in rows]   # committed pairs only
        return out

    together = drafted([0, 1])
    assert together == drafted([0]) + drafted([1])
    for i, p in enumerate(prompts):                       # the same chain, fed whole again at every depth
        n = len(p) - 1
        cache, rows = head.new_cache(1, 32), torch.tensor([0])
        h = head(torch.tensor([p[1:]]), head.input_features(feats[i][None, :n]), torch.arange(n)[None], cache, rows)
        cache.commit(rows, torch.arange(n)[None], torch.tensor([n]))
        chain, outs = [int(head.vocab_ids[head.logits(h[0, -1]).argmax()])], [h[0, -1]]
        for d in range(1, 4):
            h = head(torch.tensor([chain]), torch.stack(outs)[None], torch.arange(n, n + d)[None], cache, rows)
            chain.append(int(head.vocab_ids[head.logits(h[0, -1]).argmax()]))
            outs.append(h[0, -1])
        assert together[i] == chain
