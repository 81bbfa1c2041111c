"""Log-probabilities of generated tokens: the target's own numbers, the same bits under every method."""
from __future__ import annotations

import math

import pytest
import torch

from specdec.draft_length import make_policy
from specdec.engine import Engine, Request
from specdec.errors import SpecdecError
from specdec.logprobs import MAX_TOP_LOGPROBS, most_likely, token_text
from specdec.prefix_cache import PrefixCache
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.lookahead import LookaheadProposer, LookaheadShape
from specdec.proposers.medusa import MedusaProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer
from specdec.reference import exact_distribution

from helpers import PROMPTS, head_for, heads_for, tiny_generator, tiny_model

REPEATS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]]        # n-gram methods draft (and get accepted) here


def _draft_of(target):
    draft = tiny_model(seed=8, layers=1)
    draft.load_state_dict({n: p for n, p in target.state_dict().items() if not n.startswith("layers.1.")})
    return draft


PROPOSERS = {
    "ngram": lambda t: NgramProposer(),
    "suffix": lambda t: SuffixProposer(),
    "lookahead": lambda t: LookaheadProposer(LookaheadShape()),
    "draft": lambda t: DraftModelProposer(_draft_of(t)),
    "eagle-tree": lambda t: EagleProposer(head_for(t), 3, 4, 10),
    "medusa": lambda t: MedusaProposer(heads_for(t, 3)),
}


def test_plain_logprobs_are_the_full_contexts_distribution():
    target = tiny_model(seed=8).pack()                   # prepacked: the rows keep their bits (design.md)
    prompt = PROMPTS[1]
    r = tiny_generator(target).generate(prompt, max_new_tokens=12, logprobs=True, top_logprobs=5)
    assert len(r.logprobs) == len(r.tokens) == 12
    context = list(prompt)
    for tok, lp in zip(r.tokens, r.logprobs):
        want = torch.log_softmax(exact_distribution(target, context).float(), -1)      # [V] no cache, whole context
        assert lp.token == tok
        assert lp.logprob == pytest.approx(float(want[tok]), abs=1e-5)
        assert [i for i, _ in lp.top] == want.topk(5).indices.tolist()
        assert lp.top[0][0] == tok                                 # greedy: the token is the most likely
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
        context.append(tok)


@pytest.mark.exactness                  # run again on the portable AVX2 kernels (`make test`)
@pytest.mark.parametrize("method", list(PROPOSERS))
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_every_method_reports_the_bits_plain_decoding_reports(method, k):
    """Greedy and seeded sampling (point-mass drafts: the same tokens), batch of 3: every token's log-probability
    and alternatives equal plain decoding's bit for bit."""
    target = tiny_model(seed=8).pack()                   # prepacked: the rows keep their bits (design.md)
    prompts = PROMPTS[1:] + REPEATS
    accepted = 0.0
    for temperature in (0.0, 0.8):
        args = dict(max_new_tokens=16, temperature=temperature, seed=3, logprobs=True, top_logprobs=3)
        plain = tiny_generator(target).generate(prompts, **args)
        spec = tiny_generator(target, PROPOSERS[method](target), "fixed", k).generate(prompts, **args)
        accepted += sum(r.metrics["acceptance_rate"] for r in spec)
        if method == "draft" and temperature > 0:
            continue                    # sampled drafts: other tokens for a seed (their bits: below, greedy)
        for p, s in zip(plain, spec):
            assert s.tokens == p.tokens
            assert s.logprobs == p.logprobs                                          # floats compared exactly
    assert accepted > 0


def test_sampled_tokens_get_their_own_logprob():
    target = tiny_model(seed=8).pack()                   # prepacked: the rows keep their bits (design.md)
    gen = tiny_generator(target, SuffixProposer(), "fixed", 4)
    batch = gen.generate(PROMPTS, max_new_tokens=16, temperature=1.0, seed=11, logprobs=True, top_logprobs=1)
    for r in batch:
        assert [lp.token for lp in r.logprobs] == r.tokens
        assert all(lp.logprob <= lp.top[0][1] <= 0 and math.isfinite(lp.logprob) for lp in r.logprobs)
    assert any(lp.top[0][0] != lp.token for r in batch for lp in r.logprobs)      # sampled: not always the argmax


def test_logprobs_stop_where_the_tokens_stop():
    """An EOS, max_new_tokens inside a step's accepted drafts, a stop string: one entry per token kept."""
    target = tiny_model(seed=8).pack()                   # prepacked: the rows keep their bits (design.md)
    plain = tiny_generator(target).generate(REPEATS[0], max_new_tokens=30, logprobs=True)
    eos = plain.tokens[9]
    gen = tiny_generator(target, NgramProposer(), "fixed", 6, eos=eos)
    r = gen.generate(REPEATS[0], max_new_tokens=30, logprobs=True)
    assert r.finish_reason == "stop" and r.tokens[-1] == eos
    assert r.logprobs == plain.logprobs[:len(r.tokens)]
    r = tiny_generator(target, NgramProposer(), "fixed", 6).generate(REPEATS[0], max_new_tokens=7, logprobs=True)
    assert len(r.tokens) == len(r.logprobs) == 7 and r.logprobs == plain.logprobs[:7]


def test_a_stream_keeps_the_logprobs_so_far():
    target = tiny_model(seed=8).pack()                   # prepacked: the rows keep their bits (design.md)
    gen = tiny_generator(target, SuffixProposer(), "fixed", 4)
    whole = gen.generate(PROMPTS[0], max_new_tokens=10, logprobs=True, top_logprobs=2)
    for _ in gen.stream(PROMPTS[0], max_new_tokens=10, logprobs=True, top_logprobs=2):
        assert len(gen.last_result.logprobs) == len(gen.last_result.tokens)
    assert gen.last_result.logprobs == whole.logprobs
    assert gen.generate(PROMPTS[0], max_new_tokens=10).logprobs == []                   # not asked: none


def test_prompt_logprobs_score_the_prompt_as_the_full_context_does():
    """prompt_logprobs: the log-likelihood of each prompt token after the first; a continuation scored as part of
    a prompt gets the log-probabilities it got when generated (within rounding: other rows of other forwards)."""
    target = tiny_model(seed=8).pack()
    gen = tiny_generator(target, SuffixProposer(), "fixed", 4)
    prompt = PROMPTS[1]
    r = gen.generate(prompt, max_new_tokens=10, logprobs=True, prompt_logprobs=True, top_logprobs=2)
    assert [lp.token for lp in r.prompt_logprobs] == prompt[1:]
    for i, lp in enumerate(r.prompt_logprobs):
        want = torch.log_softmax(exact_distribution(target, prompt[:i + 1]).float(), -1)
        assert lp.logprob == pytest.approx(float(want[prompt[i + 1]]), abs=1e-5)
        assert [t for t, _ in lp.top] == [t for t, _ in most_likely(want, 2)]
    scored = gen.generate(prompt + r.tokens, max_new_tokens=1, prompt_logprobs=True, top_logprobs=2)
    again = scored.prompt_logprobs[len(prompt) - 1:]
    assert [lp.token for lp in again] == r.tokens
    assert [lp.logprob for lp in again] == pytest.approx([lp.logprob for lp in r.logprobs], abs=1e-5)
    assert r.logprobs and scored.logprobs == []                                   # asked for the prompt's only


def test_prompt_logprobs_through_the_prefix_cache_are_the_prefills_bits():
    target = tiny_model(seed=8).pack()
    prompt = list(range(1, 97)) + list(range(1, 60))                          # over PREFILL_PIECE: cached pieces
    cache = PrefixCache(1 << 26)
    first = _run_engine(target, cache, Request(prompt, 3, prompt_logprobs=True, top_logprobs=1))
    second = _run_engine(target, cache, Request(prompt, 3, prompt_logprobs=True, top_logprobs=1))
    assert second.cached > 0 and first.cached == 0
    assert second.prompt_logprobs == first.prompt_logprobs and len(first.prompt_logprobs) == len(prompt) - 1


def _run_engine(target, cache, request):
    eng = Engine(target, NgramProposer(), make_policy("fixed", 3), lambda ids: "", frozenset(), prefix_cache=cache)
    eng.allocate(1, 256)
    seq = eng.add(request)
    with torch.inference_mode():
        while eng.busy:
            eng.step()
    return seq


def test_a_piece_of_a_character_is_written_as_its_bytes():
    assert token_text(" caf\u00e9".encode()) == " caf\u00e9"
    assert token_text(b"\xe6\x97") == "bytes:\\xe6\\x97" != token_text(b"\xe6\x98")     # pieces stay apart
    assert token_text(b"") == ""


def test_tied_alternatives_come_lowest_id_first_as_the_argmax_picks():
    lp = torch.tensor([-3.0, -1.0, -2.0, -1.0, -2.0, -2.0, -5.0])
    assert most_likely(lp, 1) == ((int(lp.argmax()), -1.0),)
    assert most_likely(lp, 4) == ((1, -1.0), (3, -1.0), (2, -2.0), (4, -2.0))
    assert most_likely(lp, 7)[-2:] == ((0, -3.0), (6, -5.0))


@pytest.mark.parametrize("logprobs, top, message", [
    (True, MAX_TOP_LOGPROBS + 1, "top_logprobs must be an integer from 0 to 20"),
    (True, -1, "top_logprobs must be an integer from 0 to 20"),
    (True, 2.0, "top_logprobs must be an integer"),
    (True, True, "top_logprobs must be an integer"),
    (1, 0, "logprobs must be True or False"),
    (False, 3, "top_logprobs needs logprobs=True or prompt_logprobs=True"),
])
def test_bad_logprobs_arguments_are_refused(logprobs, top, message):
    gen = tiny_generator(tiny_model(seed=8))
    with pytest.raises(SpecdecError, match=message):
        gen.generate(PROMPTS[0], max_new_tokens=4, logprobs=logprobs, top_logprobs=top)
    with pytest.raises(SpecdecError, match=message):
        gen.stream(PROMPTS[0], max_new_tokens=4, logprobs=logprobs, top_logprobs=top)
