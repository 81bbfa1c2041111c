"""A draft with another tokenizer (token-level intersection): exact for greedy and sampling."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from helpers import V, check_joint, exact_joint, run_engine, tiny_generator, tiny_model
from specdec.engine import Request
from specdec.errors import SpecdecError
from specdec.models.tokenizer import Tokenizer
from specdec.proposers.cross_vocab import CrossVocabProposer, VocabMap
from specdec.reference import reference_greedy
from specdec.sampling import SamplingParams

TARGET_WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog"]            # V = 8 target tokens
DRAFT_WORDS = ["mat", "a", "on", "the", "bird", "sat", "tree", "cat", "flew", "over"]   # 6 shared, 4 not


def word_tokenizer(words: list[str]) -> Tokenizer:
    backend = Backend(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend, "", {})


def test_the_map_pairs_tokens_spelled_alike():
    m = VocabMap(word_tokenizer(DRAFT_WORDS), word_tokenizer(TARGET_WORDS), len(TARGET_WORDS))
    assert m.shared == 6 and m.d2t.tolist() == [5, 4, 3, 0, -1, 2, -1, 1, -1, -1]
    assert "6 tokens in common: 60.0% of the draft's 10" in m.describe()


@pytest.mark.parametrize("k, batch", [(1, 1), (3, 1), (4, 3)])
def test_cross_vocab_greedy_equals_plain(k, batch):
    target, draft = tiny_model(seed=7, vocab=len(TARGET_WORDS)), tiny_model(seed=8, vocab=len(DRAFT_WORDS))
    prop = CrossVocabProposer(draft, word_tokenizer(DRAFT_WORDS), word_tokenizer(TARGET_WORDS), len(TARGET_WORDS))
    prompts = [[0, 1, 2, 3], [4, 5, 6, 7, 0], [1, 1, 2]][:batch]
    gen = tiny_generator(target, prop, "fixed", k)
    for p, r in zip(prompts, gen.generate(prompts, max_new_tokens=20)):
        assert r.tokens == reference_greedy(target, p, 20)


@pytest.mark.parametrize("context", [5, 64])
def test_the_draft_reads_a_bounded_context(context):
    """The first sync feeds at most the prompt's last `context` tokens (the cache holds no more; a long feed
    takes the prefill path), and the output is still the plain one."""
    target, draft = tiny_model(seed=7, vocab=len(TARGET_WORDS)), tiny_model(seed=8, vocab=len(DRAFT_WORDS))
    prop = CrossVocabProposer(draft, word_tokenizer(DRAFT_WORDS), word_tokenizer(TARGET_WORDS), len(TARGET_WORDS),
                              context=context)
    prompt = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]
    seqs = run_engine(target, prop, [Request(list(prompt), 16)], "fixed", 3)
    assert seqs[0].generated == reference_greedy(target, prompt, 16)
    assert prop.skip[seqs[0].row] == max(0, len(prompt) + 1 - context)   # prompt + first token, all single words
    assert int(prop.cache.lengths[seqs[0].row]) <= min(context, len(prompt) + 1) + 16


def test_a_context_of_no_tokens_is_an_error():
    draft = tiny_model(seed=8, vocab=len(DRAFT_WORDS))
    with pytest.raises(SpecdecError, match="context"):
        CrossVocabProposer(draft, word_tokenizer(DRAFT_WORDS), word_tokenizer(TARGET_WORDS), 8, context=0)


def test_too_little_overlap_is_a_clear_error():
    with pytest.raises(SpecdecError, match="shares too little"):
        CrossVocabProposer(tiny_model(vocab=33), word_tokenizer(["cat", "tree", "flew"] + [f"w{i}" for i in range(30)]),
                           word_tokenizer(TARGET_WORDS), 8)


@pytest.mark.slow        # 20,000 sequences: `make test`
def test_cross_vocab_sampling_matches_exact_distribution():
    assert V == len(TARGET_WORDS)
    target, draft = tiny_model(seed=20, vocab=V, std=0.5), tiny_model(seed=21, vocab=len(DRAFT_WORDS), std=0.5)
    params = SamplingParams(1.0, 6, 0.95)
    prompt = [0, 1, 2]
    prop = CrossVocabProposer(draft, word_tokenizer(DRAFT_WORDS), word_tokenizer(TARGET_WORDS), V)
    reqs = [Request(list(prompt), 4, SamplingParams(1.0, 6, 0.95, seed)) for seed in range(20_000)]
    samples = [tuple(s.generated) for s in run_engine(target, prop, reqs, "fixed", 3)]
    assert check_joint(samples, exact_joint(target, prompt, params)) > 1e-3


def test_a_draft_with_a_shorter_context_than_the_output_reads_a_recent_window():
    """The draft's cache is bounded by its own context; an output that outgrows it ('context full' from the
    draft) makes the row read its last tokens afresh, and the output is still the plain one."""
    from helpers import init_random, tiny_config
    from specdec.models.decoder import Transformer

    target = tiny_model(seed=7, vocab=len(TARGET_WORDS))
    draft = init_random(Transformer(tiny_config(len(DRAFT_WORDS), 2, max_seq_len=64)), 8, 0.3).eval()
    prop = CrossVocabProposer(draft.requires_grad_(False), word_tokenizer(DRAFT_WORDS), word_tokenizer(TARGET_WORDS),
                              len(TARGET_WORDS))
    gen = tiny_generator(target, prop, "fixed", 4)
    prompt = [0, 1, 2, 3]
    assert gen.generate(prompt, max_new_tokens=150).tokens == reference_greedy(target, prompt, 150)
