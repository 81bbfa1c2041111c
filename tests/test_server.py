"""The OpenAI-compatible server: a real uvicorn server on a free loopback port, driven by the official client."""
from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import uvicorn

from specdec.api import Generator, early_exit_draft, load_model, make_proposer
from specdec.proposers.base import NoProposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.server import ServeConfig, ServerState, create_app

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"
KEY = "sekrit-key"
PROMPT = "The three primary colors are"
QUESTION = "Name two planets of the solar system."
CHAT_PROMPTS = ["What is 2 + 2?", "Name a fruit that is yellow.", "Say hello in French.", "What color is the sky?",
                "Give me a synonym for happy.", "What is the capital of Italy?", "Count from one to five.",
                "Name a large animal."]


class LiveServer:
    """A real uvicorn server for `state` in a background thread on a free loopback port."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config = uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning",
                                access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.05)

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def metrics(self) -> str:
        return requests.get(self.url + "/metrics", timeout=10).text

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def counted(text: str, name: str, labels: str) -> float:
    """A labelled counter's value, 0 where no line has it yet (a label set shows once it was counted): what a
    module-scoped server counted before a test depends on which tests ran on it first."""
    return metric(text, name, labels) if re.search(rf"^{re.escape(name + labels)} ", text, re.M) else 0.0


@pytest.fixture(scope="module")
def gen() -> Generator:
    """The real default model (float32, exactness mode) with the n-gram method, loaded once."""
    target, tok, name = load_model(MODEL, "float32")
    return Generator(target, tok, NgramProposer(), "fixed", 4, name)


@pytest.fixture(scope="module")
def server(gen):
    state = ServerState(gen, ServeConfig(max_batch=8, max_prompt_tokens=256, max_tokens=32, max_body_bytes=64_000),
                        drafts={"draft": early_exit_draft(gen.target, "self:10")})
    srv = LiveServer(state)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def offline(gen: Generator, prompt: str, n: int, chat: bool, method: str = "ngram", **kw):
    """The same request through Generator.generate with the same method."""
    g = gen
    if method == "none":
        g = Generator(gen.target, gen.tokenizer, NoProposer(), "fixed", 4, gen.name)
    elif method == "draft":
        g = Generator(gen.target, gen.tokenizer, DraftModelProposer(early_exit_draft(gen.target, "self:10")),
                      "fixed", 3, gen.name)
    elif method == "hybrid":                       # the shipped EAGLE head + prompt lookup
        g = Generator(gen.target, gen.tokenizer, make_proposer("hybrid", gen.target, gen.tokenizer, None, "float32", "cpu"),
                      "fixed", 4, gen.name)
    return g.generate(prompt, max_new_tokens=n, chat=chat, **kw)


# ---- the happy paths ------------------------------------------------------------------------
def test_health_and_models(server, client):
    health = requests.get(server.url + "/health", timeout=5).json()
    assert health["status"] == "ok"
    rt = health["runtime"]                                       # the machine, dtype and self-check are named
    assert rt["cpu"] and rt["dtype"] in ("float32", "bfloat16", "q4") and rt["self_check"]["passed"]
    assert [m.id for m in client.models.list().data] == [MODEL]
    before = metric(server.metrics(), "specdec:requests_total", '{endpoint="/v1/models",status="200"}')
    assert client.models.retrieve(MODEL).id == MODEL
    assert metric(server.metrics(), "specdec:requests_total", '{endpoint="/v1/models",status="200"}') == before + 1
    head = requests.head(server.url + "/health", timeout=5)                 # monitors that probe with HEAD
    assert head.status_code == 200 and not head.content


def test_completion_greedy_equals_offline(gen, client):
    want = offline(gen, PROMPT, 16, chat=False)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert got.object == "text_completion"
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == want.prompt_tokens and got.usage.completion_tokens == len(want.tokens)
    assert got.usage.total_tokens == want.prompt_tokens + len(want.tokens)
    spec = got.speculative
    assert spec["method"] == "ngram" and spec["num_draft_tokens"] == 4 and spec["tau"] >= 1.0
    assert spec["draft_policy"] == gen.policy_name == "fixed"      # K is the draft length, not where it starts
    assert spec["acceptance_rate"] is not None and isinstance(spec["acceptance_per_position"], list)


def test_completion_token_ids_prompt(gen, client):
    ids = gen.tokenizer.encode(PROMPT, False)
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert got.choices[0].text == offline(gen, PROMPT, 8, chat=False).text


def test_completion_stream(gen, client):
    want = offline(gen, PROMPT, 16, chat=False)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "include_obfuscation": False}))
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text and len([c for c in chunks if c.choices and c.choices[0].text]) > 3
    final = [c for c in chunks if c.choices][-1]
    assert final.choices[0].finish_reason == want.finish_reason and final.speculative["method"] == "ngram"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)


def test_chat(gen, client):
    want = offline(gen, QUESTION, 20, chat=True)
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                         max_tokens=20, temperature=0)
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == want.prompt_tokens and got.usage.completion_tokens == len(want.tokens)
    assert got.speculative["tau"] >= 1.0


def test_chat_stream(gen, client):
    want = offline(gen, QUESTION, 20, chat=True)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=20, temperature=0, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].speculative["method"] == "ngram" and chunks[-1].usage is None


def test_stop_and_seeded_sampling(gen, client):
    want = offline(gen, PROMPT, 16, chat=False, stop=["."])
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=".")
    assert got.choices[0].text == want.text and "." not in got.choices[0].text
    plain = offline(gen, PROMPT, 16, chat=False, method="none", stop=["."])   # one token per step
    assert got.usage.completion_tokens == len(want.tokens) == len(plain.tokens)   # not the step's later tokens
    sampled = offline(gen, PROMPT, 16, chat=False, temperature=0.9, top_p=0.95, seed=7)
    for _ in range(2):
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95,
                                        seed=7)
        assert got.choices[0].text == sampled.text
    for seed in (-1, 7 + (1 << 62), (1 << 64) - 1):             # every 64-bit seed is offline's, none folded
        want = offline(gen, PROMPT, 6, chat=False, temperature=0.9, seed=seed).text
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.9, seed=seed)
        assert got.choices[0].text == want, seed
    assert offline(gen, PROMPT, 6, chat=False, temperature=0.9, seed=7 + (1 << 62)).text != \
        offline(gen, PROMPT, 6, chat=False, temperature=0.9, seed=7).text
    nucleus_of_one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0,
                                               seed=7)
    assert nucleus_of_one.choices[0].text == offline(gen, PROMPT, 16, chat=False).text   # top_p 0: the argmax


def test_per_request_speculation(gen, client):
    """Each method (run concurrently: four engines stepped round-robin) gives the offline greedy text."""
    choices = [{"method": "none"}, {"method": "ngram", "num_draft_tokens": 2}, {"method": "draft", "num_draft_tokens": 3},
               {"method": "hybrid", "num_draft_tokens": 4}]

    def ask(spec: dict):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                         extra_body={"speculative": spec})

    with ThreadPoolExecutor(len(choices)) as ex:
        results = list(ex.map(ask, choices))
    for spec, got in zip(choices, results):
        want = offline(gen, PROMPT, 16, chat=False, method=spec["method"])
        assert got.choices[0].text == want.text
        report = got.speculative
        assert report["method"] == spec["method"]
        if spec["method"] == "none":
            assert report["acceptance_rate"] is None and report["tau"] == 1.0 and report["draft_tokens"] == 0
        else:
            assert report["num_draft_tokens"] == spec["num_draft_tokens"] and report["draft_tokens"] > 0


def test_predicted_outputs(gen, client):
    """A prediction (the offline answer with one word changed) drafts for both endpoints, streaming or not; the
    text is the offline text and usage reports accepted and rejected prediction tokens."""
    want = offline(gen, QUESTION, 30, chat=True, method="none")
    words = want.text.split(" ")
    words[len(words) // 2] = "banana"
    pred = " ".join(words)
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=30,
                                         temperature=0, prediction={"type": "content", "content": pred},
                                         extra_body={"speculative": {"method": "none"}})
    assert got.choices[0].message.content == want.text
    details = got.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= len(want.tokens) // 2 and details.rejected_prediction_tokens >= 1
    assert got.speculative["target_forwards"] < len(want.tokens) // 2
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=30, temperature=0, stream=True,
        prediction={"type": "content", "content": [{"type": "text", "text": pred}]},
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens >= len(want.tokens) // 2
    plain = offline(gen, PROMPT, 16, chat=False)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                    extra_body={"prediction": {"type": "content", "content": plain.text}})
    assert got.choices[0].text == plain.text and got.speculative["accepted_prediction_tokens"] >= 8


def test_logprobs_are_plain_decodings_streamed_or_not(gen, client):
    """Chat and completions report each completion token's log-probability (and alternatives) bit for bit as
    plain decoding offline does, in OpenAI's two formats, streamed or not."""
    tok = gen.tokenizer
    want = offline(gen, QUESTION, 20, chat=True, method="none", logprobs=True, top_logprobs=3)
    values = [lp.logprob for lp in want.logprobs]
    tops = [[v for _, v in lp.top] for lp in want.logprobs]
    ask = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=20, temperature=0,
               logprobs=True, top_logprobs=3)
    got = client.chat.completions.create(**ask)
    content = got.choices[0].logprobs.content
    assert [c.logprob for c in content] == values and [[t.logprob for t in c.top_logprobs] for c in content] == tops
    assert [bytes(c.bytes) for c in content] == [tok.token_bytes(t) for t in want.tokens]
    assert [c.top_logprobs[0].token for c in content] == [c.token for c in content]           # greedy: the argmax
    assert b"".join(bytes(c.bytes) for c in content).decode().startswith(got.choices[0].message.content)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [c for ch in chunks if ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == values and [c.token for c in streamed] == [c.token for c in content]
    assert chunks[0].choices[0].logprobs is None and chunks[-1].choices[0].logprobs is None    # role, finish

    want = offline(gen, PROMPT, 16, chat=False, logprobs=True, top_logprobs=2)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == [x.logprob for x in want.logprobs] and "".join(lp.tokens) == got.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(t in alts and len(alts) in (2, 3) for t, alts in zip(lp.tokens, lp.top_logprobs))
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0,
                                            stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens and [o for p in parts for o in p.text_offset] == lp.text_offset
    assert all(alts == {t: v} for p in parts for t, v, alts in zip(p.tokens, p.token_logprobs, p.top_logprobs))
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None                                                     # not asked


def test_echo_with_logprobs_scores_the_prompt(gen, client):
    """completions' echo puts the prompt before the text and, with logprobs, its tokens before the completion's
    (the first with null), as evaluation harnesses read a text's log-likelihood; streamed or not."""
    ids = gen.tokenizer.encode(PROMPT, False)
    want = offline(gen, PROMPT, 2, chat=False, method="none", logprobs=True, prompt_logprobs=True, top_logprobs=1)
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1)
    got = client.completions.create(**ask).choices[0]
    lp = got.logprobs
    assert got.text == PROMPT + want.text and "".join(lp.tokens) == got.text and len(lp.tokens) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [x.logprob for x in want.prompt_logprobs + want.logprobs]
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = [c.choices[0] for c in client.completions.create(**ask, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == got.text and chunks[0].text.startswith(PROMPT)
    assert [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs] == lp.token_logprobs
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True).choices[0]
    assert plain.text == gen.tokenizer.decode(ids) + offline(gen, PROMPT, 3, chat=False).text
    assert plain.logprobs is None


def test_echo_offsets_count_the_text_when_the_encoder_adds_a_token_it_does_not_spell(gen):
    """A text prompt whose encoding starts with a token the text does not spell (gemma3's encoder adds <bos>):
    that token stands at 0 and takes no room, so every other token's text_offset points at its text in the echo."""
    from specdec.logprobs import TokenLogprob
    from specdec.server.app import LogprobsView

    tok = gen.tokenizer
    text = "Hello there, world"
    ids = [0] + tok.encode(text, False)                                    # <|endoftext|> in place of a BOS
    scored = [TokenLogprob(t, -1.0, ()) for t in ids[1:]]
    lp = LogprobsView(tok, chat=False, asked=True).echoing(text, ids).render([], ids, scored)
    assert lp["tokens"][0] == "<|endoftext|>" and lp["text_offset"][:2] == [0, 0]
    assert all(text[o:o + len(t)] == t for t, o in zip(lp["tokens"][1:], lp["text_offset"][1:]))
    plain = LogprobsView(tok, chat=False, asked=True).echoing(tok.decode(ids), ids).render([], ids, scored)
    assert plain["text_offset"] == [len("".join(plain["tokens"][:i])) for i in range(len(ids))]   # spelled out


def test_pieces_of_characters_keep_apart_and_offsets_follow_the_text(gen, client):
    """Tokens that are bytes of a character: written bytes:\\xNN (so top_logprobs keeps every alternative, where
    U+FFFD for all of them merged them), and text_offset counts characters of the text, not of token strings."""
    prompt = "日本語の文章を書いてください。東京は"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=20,
                                    echo=True).choices[0]
    lp, text = got.logprobs, got.text
    assert text.startswith(prompt) and lp.top_logprobs[0] is None
    assert all(len(alts) >= 20 for alts in lp.top_logprobs[1:])
    assert any(t.startswith("bytes:\\x") for t in lp.tokens)
    first_new = len(gen.tokenizer.encode(prompt, False))
    assert lp.text_offset[first_new] == len(prompt)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    for t, o in zip(lp.tokens, lp.text_offset):
        if not t.startswith("bytes:"):
            assert text[o:o + len(t)] == t


def test_n_choices_sample_with_seeds_of_their_own_streamed_or_not(gen, client):
    """n choices: choice i samples as offline generation samples prompt i of a list of n equal prompts (seed
    derive_seed(seed, i)); greedy choices are all the plain answer; usage counts the prompt once."""
    kw = dict(temperature=0.9, top_p=0.95, seed=5)
    want = offline(gen, [PROMPT] * 3, 12, chat=False, **kw)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=3, logprobs=1, **kw)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w.text for w in want] and len({w.text for w in want}) > 1
    assert [c.logprobs.token_logprobs for c in got.choices] == [[x.logprob for x in w.logprobs] for w in
                                                                 offline(gen, [PROMPT] * 3, 12, chat=False, logprobs=True,
                                                                         top_logprobs=1, **kw)]
    assert got.usage.prompt_tokens == want[0].prompt_tokens
    assert got.usage.completion_tokens == sum(len(w.tokens) for w in want)
    assert got.speculative == got.choices[0].speculative and all(c.speculative["method"] for c in got.choices)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=10, temperature=0, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    plain = offline(gen, QUESTION, 10, chat=True)
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and "".join(c.delta.content or "" for c in mine) == plain.text
        assert mine[-1].finish_reason == plain.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(plain.tokens)


def test_several_prompts_in_one_completion_request(gen, client):
    """A list of prompts: prompt i's choice j is choice i * n + j, sampled as offline generation samples item
    i * n + j of the list of each prompt repeated n times; usage counts each prompt once."""
    prompts = [PROMPT, "Two plus two is"]
    want = offline(gen, [p for p in prompts for _ in range(2)], 8, chat=False, temperature=0.8, seed=3)
    got = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0.8, seed=3,
                                    echo=True, logprobs=0)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [p + w.text for p, w in zip([p for p in prompts for _ in range(2)], want)]
    assert got.usage.prompt_tokens == want[0].prompt_tokens + want[2].prompt_tokens
    assert got.usage.completion_tokens == sum(len(w.tokens) for w in want)
    ids = [gen.tokenizer.encode(p, False) for p in prompts]
    greedy = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in greedy.choices] == [w.text for w in offline(gen, prompts, 6, chat=False)]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True))
    for i, w in enumerate(offline(gen, prompts, 6, chat=False)):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) == w.text


def test_eight_concurrent_streams(gen, server, client):
    wants = gen.generate(CHAT_PROMPTS, max_new_tokens=24, chat=True)

    def stream(prompt: str) -> tuple[str, str]:
        chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=24, temperature=0, stream=True)
        parts, reason = [], None
        for c in chunks:
            parts.append(c.choices[0].delta.content or "")
            reason = c.choices[0].finish_reason or reason
        return "".join(parts), reason

    with ThreadPoolExecutor(len(CHAT_PROMPTS)) as ex:
        results = list(ex.map(stream, CHAT_PROMPTS))
    for (text, reason), want in zip(results, wants):
        assert text == want.text and reason == want.finish_reason
    assert server.state.scheduler.peak_running >= 4, "concurrent requests were not batched together"


# ---- limits, disconnects, auth, bad input ------------------------------------------------------
@pytest.fixture(scope="module")
def single(gen):
    """A one-slot server with no waiting room: the disconnect and 429 cases."""
    srv = LiveServer(ServerState(gen, ServeConfig(max_batch=1, max_waiting=0, max_prompt_tokens=64, max_tokens=200)))
    yield srv
    srv.stop()


def test_more_choices_than_the_server_has_slots_is_a_400(single):
    r = post(single.url, {"prompt": "hi", "n": 2, "max_tokens": 2}, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "n must be <= 1 (this server's --max-batch + --max-waiting" in r.json()["error"]["message"]
    r = post(single.url, {"prompt": ["hi", "ho"], "max_tokens": 2}, "/v1/completions")
    assert r.status_code == 400 and "2 prompts x n=1 choices must be <= 1" in r.json()["error"]["message"]
    r = post(single.url, {"prompt": "hi", "n": 1, "max_tokens": 2}, "/v1/completions")
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_disconnect_mid_stream_frees_the_slot(single, caplog):
    caplog.set_level(logging.INFO, logger="specdec")
    before = single.metrics()
    gone, busy_before = (counted(before, "specdec:requests_total", f'{{endpoint="/v1/completions",status="{s}"}}')
                         for s in (499, 429))
    client = single.client()
    stream = client.completions.create(model=MODEL, prompt="Count from one to one hundred: one, two,",
                                       max_tokens=200, temperature=0, stream=True)
    first = next(iter(stream))
    assert first.choices[0].text
    with pytest.raises(openai.RateLimitError) as busy:       # the only slot is taken and nothing may wait
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert busy.value.status_code == 429 and busy.value.body["code"] == "rate_limit_exceeded"
    stream.close()
    deadline = time.monotonic() + 20
    while metric(single.metrics(), "specdec:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the disconnected stream still holds its slot"
        time.sleep(0.1)
    engine = single.state.pool.engines[single.state.default]
    assert len(engine.free) == 1 and not engine.busy
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert got.usage.completion_tokens == 4
    text = single.metrics()
    assert metric(text, "specdec:requests_total", '{endpoint="/v1/completions",status="499"}') == gone + 1
    assert metric(text, "specdec:requests_total", '{endpoint="/v1/completions",status="429"}') == busy_before + 1
    assert metric(single.metrics(), "specdec:generation_tokens_total") - metric(
        before, "specdec:generation_tokens_total") < 200
    assert "POST /v1/completions -> 499 the client closed the connection: stream cancelled" in caplog.messages


def test_a_queued_stream_starts_at_once_and_keeps_its_connection_alive(gen, monkeypatch):
    """A stream that waits for a slot gets its status line and headers after STREAM_START_SECONDS, then SSE
    comments every KEEP_ALIVE_SECONDS until its tokens come (proxies time out silent connections); its text is
    the one it would have had, with raw HTTP and with the official client."""
    from specdec.server import app as app_module

    monkeypatch.setattr(app_module, "STREAM_START_SECONDS", 0.2)
    monkeypatch.setattr(app_module, "KEEP_ALIVE_SECONDS", 0.2)
    srv = LiveServer(ServerState(gen, ServeConfig(max_batch=1, max_waiting=4, max_prompt_tokens=64, max_tokens=120)))
    try:
        long = {"prompt": "Count from one to one hundred: one, two,", "max_tokens": 120, "temperature": 0}
        busy = ThreadPoolExecutor(1).submit(requests.post, srv.url + "/v1/completions", json=long, timeout=120)
        while metric(srv.metrics(), "specdec:num_requests_running") != 1:
            time.sleep(0.02)
        started = time.monotonic()
        with requests.post(srv.url + "/v1/completions", stream=True, timeout=120,
                           json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}) as r:
            waited = time.monotonic() - started
            assert r.status_code == 200 and not busy.done(), "headers only after the slot was free"
            lines = [line for line in r.iter_lines() if line]
        assert waited < 3 and lines[0] == b": keep-alive" and lines[-1] == b"data: [DONE]"
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines
                       if line.startswith(b"data: {") and json.loads(line[6:])["choices"])
        assert text == offline(gen, PROMPT, 6, chat=False).text
        busy = ThreadPoolExecutor(1).submit(requests.post, srv.url + "/v1/completions", json=long, timeout=120)
        while metric(srv.metrics(), "specdec:num_requests_running") != 1:
            time.sleep(0.02)
        pieces = srv.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in pieces if c.choices) == text
        assert busy.result().status_code == 200
    finally:
        srv.stop()


def test_a_non_streaming_client_that_goes_away_frees_the_slot(single, caplog):
    """A running (not waiting) request whose client closes its connection is cancelled within about a second,
    though its tokens keep coming: the disconnect is checked every POLL_SECONDS however busy the request is. The
    log says so."""
    caplog.set_level(logging.INFO, logger="specdec")
    before = single.metrics()
    gone = counted(before, "specdec:requests_total", '{endpoint="/v1/completions",status="499"}')
    tokens = metric(before, "specdec:generation_tokens_total")
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(single.url + "/v1/completions", timeout=1.0, json={
            "prompt": "Count from one to one hundred: one, two,", "max_tokens": 200, "temperature": 0})
    deadline = time.monotonic() + 20
    while metric(single.metrics(), "specdec:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the departed client's request still holds its slot"
        time.sleep(0.1)
    text = single.metrics()
    assert metric(text, "specdec:requests_total", '{endpoint="/v1/completions",status="499"}') == gone + 1
    assert metric(text, "specdec:generation_tokens_total") - tokens < 200
    got = single.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert got.usage.completion_tokens == 4
    assert "POST /v1/completions -> 499 the client closed the connection: request cancelled" in caplog.messages


def test_requests_for_a_full_engine_pool_wait_in_order_then_evict_idle_engines(gen):
    """--max-engines 2: the default engine and one more. While a suffix stream keeps the second engine busy, a
    request naming yet another (method, K) waits (no 429) and the default engine keeps serving, and a later suffix
    request waits behind it (first come, first served: it does not keep the busy engine busy); once the stream
    ends, the waiting requests are served exactly, in order: the ngram one drops the idle suffix engine, the
    suffix one then drops the ngram engine."""
    import threading

    srv = LiveServer(ServerState(gen, ServeConfig(max_batch=2, max_prompt_tokens=64, max_tokens=200, max_engines=2)))
    try:
        client = srv.client()
        stream = client.completions.create(model=MODEL, prompt="Count from one to one hundred: one, two,",
                                           max_tokens=200, temperature=0, stream=True,
                                           extra_body={"speculative": {"method": "suffix"}})
        assert next(iter(stream)).choices[0].text
        other = {"speculative": {"method": "ngram", "num_draft_tokens": 2}}
        answers: list = []
        waiter = threading.Thread(target=lambda: answers.append(client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=other)))
        waiter.start()
        deadline = time.monotonic() + 30
        while not srv.state.scheduler.waiting:
            assert time.monotonic() < deadline and waiter.is_alive(), answers
            time.sleep(0.05)
        later: list = []
        behind = threading.Thread(target=lambda: later.append(client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"speculative": {"method": "suffix"}})))
        behind.start()
        while len(srv.state.scheduler.waiting) < 2:
            assert time.monotonic() < deadline and behind.is_alive(), later
            time.sleep(0.05)
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                        extra_body={"speculative": {"method": "none"}})   # the default engine serves
        assert got.usage.completion_tokens == 4
        assert waiter.is_alive() and not answers and behind.is_alive()    # still waiting for an engine
        stream.close()
        waiter.join(60)
        behind.join(60)
        assert not waiter.is_alive() and answers[0].choices[0].text == offline(gen, PROMPT, 8, chat=False).text
        assert not behind.is_alive() and later[0].choices[0].text == offline(gen, PROMPT, 6, chat=False).text
        assert [(k.method, k.num_draft_tokens) for k in srv.state.pool.engines] == [("ngram", 4), ("suffix", 4)]
        assert 'status="429"' not in srv.metrics()
    finally:
        srv.stop()


def test_one_engine_serves_only_the_default_method(gen):
    srv = LiveServer(ServerState(gen, ServeConfig(max_batch=1, max_prompt_tokens=64, max_tokens=8, max_engines=1)))
    try:
        with pytest.raises(openai.RateLimitError) as e:
            srv.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                            extra_body={"speculative": {"method": "suffix"}})
        assert "only its default method ngram (--max-engines 1)" in e.value.body["message"]
        got = srv.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                              extra_body={"speculative": {"method": "none"}})
        assert got.usage.completion_tokens == 2 and len(srv.state.pool.engines) == 1
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def secured(gen):
    srv = LiveServer(ServerState(gen, ServeConfig(max_batch=2, max_prompt_tokens=64, max_tokens=8, api_keys=(KEY,))))
    yield srv
    srv.stop()


def test_auth(secured, server):
    with pytest.raises(openai.AuthenticationError) as e:
        secured.client("wrong").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = requests.post(secured.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                      timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    assert requests.get(secured.url + "/v1/models", timeout=10).status_code == 401
    ok = secured.client(KEY)
    assert [m.id for m in ok.models.list().data] == [MODEL]
    assert ok.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    assert requests.get(secured.url + "/health", timeout=5).status_code == 200
    # auth off: any key or none at all
    assert requests.get(server.url + "/v1/models", timeout=5).status_code == 200


def test_requests_beyond_the_batch_wait_their_turn(gen, secured):
    """Two slots, five requests at once: three queue, join as slots free up, and all match offline."""
    client = secured.client(KEY)
    prompts = CHAT_PROMPTS[:5]
    wants = gen.generate(prompts, max_new_tokens=6, chat=True)

    def ask(prompt: str) -> str:
        got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=6, temperature=0)
        return got.choices[0].message.content

    with ThreadPoolExecutor(len(prompts)) as ex:
        texts = list(ex.map(ask, prompts))
    assert texts == [w.text for w in wants]
    assert secured.state.scheduler.peak_running == 2
    assert metric(secured.metrics(), "specdec:num_requests_waiting") == 0


def test_suffix_decoding_learns_per_api_key(gen):
    """Suffix decoding's index of earlier outputs is kept per tenant (per API key): a request's acceptance
    does not depend on another key's requests, and a key still learns from its own earlier ones."""
    srv = LiveServer(ServerState(gen, ServeConfig(max_batch=2, max_prompt_tokens=64, max_tokens=40,
                                                  api_keys=(KEY, "other-key"))))
    try:
        def ask(key: str) -> dict:
            got = srv.client(key).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=40, temperature=0,
                extra_body={"speculative": {"method": "suffix", "num_draft_tokens": 4}})
            return got.speculative | {"text": got.choices[0].message.content}

        first = ask(KEY)
        again = ask(KEY)                  # the same key: drafts from its first answer
        other = ask("other-key")          # another key: as if the server were fresh
        assert first["text"] == again["text"] == other["text"]
        assert again["accepted_tokens"] > first["accepted_tokens"] and again["target_forwards"] < first["target_forwards"]
        for field in ("draft_tokens", "accepted_tokens", "target_forwards", "acceptance_per_position"):
            assert other[field] == first[field], field
    finally:
        srv.stop()


def post(url: str, body: bytes | dict, path: str = "/v1/completions") -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(url + path, data=data, headers={"Content-Type": "application/json"}, timeout=30)


LONG = "word " * 400
BAD = [  # (what, path, body, status, param)
    ("invalid JSON", "/v1/completions", b'{"prompt": "hi",', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens over the cap", "/v1/completions", {"prompt": "hi", "max_tokens": 33}, 400, "max_tokens"),
    ("temperature out of range", "/v1/completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("top_p negative", "/v1/completions", {"prompt": "hi", "top_p": -0.1}, 400, "top_p"),
    ("over-long prompt", "/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("over-long chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("unsupported field", "/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("unsupported value", "/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("logprobs over 20", "/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("logprobs true for completions", "/v1/completions", {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                               "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs over 20", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("a value nested 600 deep", "/v1/completions", {"prompt": "hi", "x": json.loads("[" * 600 + "]" * 600)}, 400, "x"),
    ("logit_bias nested 600 deep", "/v1/completions", {"prompt": "hi", "logit_bias": json.loads('{"a":' * 600 + "1"
                                                                                                 + "}" * 600)}, 400,
     "logit_bias"),
    ("not UTF-8", "/v1/completions", b'{"prompt": "hi \xff"}', 400, None),
    ("n over OpenAI's 128", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 129}, 400,
     "n"),
    ("missing prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("an empty prompt in a list", "/v1/completions", {"prompt": ["a", ""]}, 400, "prompt"),
    ("an id out of range in a list", "/v1/completions", {"prompt": [[1, 2], [1, 10 ** 9]]}, 400, "prompt"),
    ("token id out of range", "/v1/completions", {"prompt": [1, 10 ** 9]}, 400, "prompt"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("too many stops", "/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("unknown method", "/v1/completions", {"prompt": "hi", "speculative": {"method": "magic"}}, 400, "speculative"),
    ("K out of range", "/v1/completions", {"prompt": "hi", "speculative": {"method": "ngram", "num_draft_tokens": 99}},
     400, "speculative"),
    ("body too large", "/v1/completions", {"prompt": "x" * 70_000}, 413, None),
    ("prediction not content", "/v1/completions", {"prompt": "hi", "prediction": {"type": "text", "content": "a"}},
     400, "prediction"),
    ("prediction not a string", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "prediction": {"type": "content", "content": 5}}, 400,
     "prediction"),
    ("prediction beyond the context", "/v1/completions",
     {"prompt": "hi", "prediction": {"type": "content", "content": "word " * 9000}}, 400, "prediction"),
    ("unknown route", "/v1/embeddings", {"input": "hi"}, 404, None),
    # wrong types anywhere: a 400 naming the field, never a 500
    ("prediction a number", "/v1/completions", {"prompt": "hi", "prediction": 5}, 400, "prediction"),
    ("prediction without content", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                            "prediction": {"type": "content"}}, 400, "prediction"),
    ("stop a number", "/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("empty stop string", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("messages a string", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("message a number", "/v1/chat/completions", {"messages": [5]}, 400, "messages"),
    ("content a number", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("content missing", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("unsupported message field", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a", "age": 3}]},
     400, "messages"),
    ("message name with a space", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a", "name": "a b"}]}, 400, "messages"),
    ("speculative a string", "/v1/completions", {"prompt": "hi", "speculative": "ngram"}, 400, "speculative"),
    ("K a string", "/v1/completions", {"prompt": "hi", "speculative": {"method": "ngram", "num_draft_tokens": "4"}},
     400, "speculative"),
    ("stream a string", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("include_usage a string", "/v1/completions", {"prompt": "hi", "stream": True,
                                                   "stream_options": {"include_usage": "yes"}}, 400, "stream_options"),
    ("stream_options without stream", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("seed a float", "/v1/completions", {"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("seed beyond 64 bits", "/v1/completions", {"prompt": "hi", "seed": 1 << 64}, 400, "seed"),
    ("negative top_k", "/v1/completions", {"prompt": "hi", "top_k": -1}, 400, "top_k"),
    ("user a number", "/v1/completions", {"prompt": "hi", "user": 5}, 400, "user"),
    ("temperature a string", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("max_tokens a boolean", "/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("n a string", "/v1/completions", {"prompt": "hi", "n": "2"}, 400, "n"),
    ("token id a boolean", "/v1/completions", {"prompt": [1, True]}, 400, "prompt"),
    ("prompt an object", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ("penalty", "/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("reasoning effort", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                  "reasoning_effort": "high"}, 400, "reasoning_effort"),
    ("audio output", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              "modalities": ["text", "audio"]}, 400, "modalities"),
    ("max_completion_tokens over the cap", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 99}, 400, "max_completion_tokens"),
    ("max_tokens and max_completion_tokens differ", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "max_completion_tokens": 8}, 400, "max_tokens"),
    ("two unsupported fields", "/v1/completions", {"prompt": "hi", "zz": 1, "frobnicate": 2}, 400, "frobnicate"),
    ("unknown model and a bad field", "/v1/completions", {"model": "gpt-4", "prompt": 5}, 404, "model"),
    # a lone surrogate ("\\ud800" is valid JSON, not Unicode): a 400, never a tokenizer's or encoder's 500
    ("lone surrogate in content", "/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
     400, "messages"),
    ("lone surrogate in a prompt", "/v1/completions", {"prompt": "hi \udc00"}, 400, "prompt"),
    ("lone surrogate in a stop", "/v1/completions", {"prompt": "hi", "stop": ["a", "\ud800"]}, 400, "stop"),
    ("lone surrogate in the model", "/v1/completions", {"model": "\ud800", "prompt": "hi"}, 404, "model"),
    ("lone surrogate in a field name", "/v1/completions", {"prompt": "hi", "\ud800": 1}, 400, None),
    ("lone surrogate in a prediction", "/v1/completions",
     {"prompt": "hi", "prediction": {"type": "content", "content": [{"type": "text", "text": "\ud800"}]}}, 400,
     "prediction"),
]


@pytest.mark.parametrize("what,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_error(server, what, path, body, status, param, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="specdec"):
        r = post(server.url, body, path)
    assert r.status_code == status, r.text
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "specdec"]
    assert len(logged) == 1 and logged[0].startswith(f"POST {path} -> {status}")
    logged[0].encode("utf-8")                           # a client's lone surrogate is escaped, not logged raw
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param
    assert set(err) == {"message", "type", "param", "code"}
    assert "\n" not in err["message"] and len(err["message"]) < 240, err["message"]


def test_wrong_types_name_the_field_and_what_it_must_be(server):
    """A few messages in full: the field's path, what it must be, what was sent."""
    cases = [({"prompt": "hi", "prediction": 5}, "prediction must be an object, got 5"),
             ({"prompt": "hi", "temperature": "hot"}, 'temperature must be a number, got "hot"'),
             ({"prompt": "hi", "temperature": float("nan")}, "temperature must be a finite number, got NaN"),
             ({"prompt": "hi", "top_p": float("inf")}, "top_p must be a finite number, got Infinity"),
             ({"prompt": "hi", "zz": 1, "frobnicate": 2}, "unsupported fields: frobnicate, zz"),
             ({"prompt": "hi", "stop": 5}, "stop must be a non-empty string or a list of up to 4 non-empty strings, "
                                           "got 5")]
    for body, message in cases:
        assert post(server.url, body).json()["error"]["message"] == message
    chat = post(server.url, {"messages": [{"role": "user", "content": 5}]}, "/v1/chat/completions")
    assert chat.json()["error"]["message"] == "messages[0].content must be a string or a list of text parts, got 5"
    odd = post(server.url, {"messages": [{"role": "user", "content": "a \ud800"}]}, "/v1/chat/completions")
    assert odd.json()["error"]["message"] == "messages[0].content holds a lone surrogate (\\ud800-\\udfff): not valid Unicode"
    name = post(server.url, {"messages": [{"role": "user", "content": "hi", "name": "a b"}]}, "/v1/chat/completions")
    assert name.json()["error"]["message"] == 'messages[0].name must be 1-64 letters, digits, _ or -, got "a b"'
    role = post(server.url, {"messages": [{"role": "\ud800", "content": "hi"}]}, "/v1/chat/completions")
    assert role.status_code == 400 and "messages[0].role holds a lone surrogate" in role.json()["error"]["message"]


def test_null_means_absent(gen, client):
    """OpenAI allows null for optional fields: stop, prediction, seed... null is as if the field were not sent."""
    want = offline(gen, PROMPT, 8, chat=False)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"stop": None, "prediction": None, "speculative": None, "top_k": None,
                                                "logprobs": None, "n": None, "stream_options": None})
    assert got.choices[0].text == want.text and got.speculative["method"] == "ngram"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=8,
                                          temperature=0, stop=None, extra_body={"prediction": None, "tools": None})
    assert chat.choices[0].message.content == offline(gen, QUESTION, 8, chat=True).text


def test_a_message_name_goes_to_the_chat_template(gen, client):
    """OpenAI's optional participant name is accepted and handed to the template; smollm2's template does not
    render it, so the answer is the one without it."""
    messages = [{"role": "system", "content": "Be brief.", "name": "setup"},
                {"role": "user", "content": QUESTION, "name": "alice_1"}]
    want = client.chat.completions.create(model=MODEL, messages=[{k: v for k, v in m.items() if k != "name"}
                                                                 for m in messages], max_tokens=8, temperature=0)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content


def test_a_response_message_appended_to_the_history_is_accepted(gen, client):
    """The common multi-turn pattern `messages.append(r.choices[0].message.model_dump())` sends the message back
    with refusal, tool_calls, audio... as null; OpenAI's other fields at their neutral values are accepted too."""
    first = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=6, temperature=0)
    history = [{"role": "user", "content": QUESTION}, first.choices[0].message.model_dump(),
               {"role": "user", "content": "And then?"}]
    assert "refusal" in history[1] and "tool_calls" in history[1]
    neutral = dict(metadata={"team": "a"}, service_tier="auto", modalities=["text"], reasoning_effort=None)
    got = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0, **neutral)
    plain = [{k: v for k, v in m.items() if k in ("role", "content")} for m in history]
    want = client.chat.completions.create(model=MODEL, messages=plain, max_tokens=6, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content


def test_a_refused_value_is_shown_cut_short(server):
    r = post(server.url, {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "x" * 3000}] * 10},
             "/v1/chat/completions")
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "unsupported_parameter" and len(err["message"]) < 160, err
    nested = post(server.url, {"messages": [{"role": "assistant", "content": "a", "tool_calls": [{"id": "1"}]},
                                            {"role": "user", "content": "hi"}]}, "/v1/chat/completions")
    assert nested.json()["error"]["message"] == \
        'messages[0].tool_calls=[{"id": "1"}] is not supported (only [] or null)'


def test_the_request_schema_is_published(server):
    """/openapi.json (and /docs) describe the request bodies the server validates with."""
    schema = requests.get(server.url + "/openapi.json", timeout=10).json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/CompletionRequest")
    props = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "temperature", "stop", "prediction", "speculative", "max_completion_tokens"} <= set(props)
    assert requests.get(server.url + "/docs", timeout=10).status_code == 200


def test_bad_input_through_the_client_and_still_serving(client, caplog):
    """Each refused request leaves one info line in the server's log (method, path, status, message)."""
    import logging

    with caplog.at_level(logging.INFO, logger="specdec"):
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-5)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=3)
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec" and r.levelno == logging.INFO]
    assert len(lines) == 3, lines
    assert lines[0].startswith("POST /v1/chat/completions -> 404") and "no-such-model" in lines[0]
    assert lines[1].startswith("POST /v1/completions -> 400") and lines[2].startswith("POST /v1/chat/completions -> 400")
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert got.usage.completion_tokens == 3


def test_a_request_during_shutdown_is_refused_not_left_waiting(gen):
    """Once the scheduler loop has ended nothing takes jobs: a job submitted after the stop command (still in
    the inbox when the loop ends) fails with a 503, and a later submit raises Closed at once."""
    import asyncio

    from specdec.engine import Request
    from specdec.sampling import SamplingParams
    from specdec.server.scheduler import Closed, Failed, Job, SpecChoice

    state = ServerState(gen, ServeConfig(max_batch=2, max_tokens=16))
    scheduler = state.scheduler
    scheduler.in_caller = True

    async def scenario() -> object:
        ids = gen.tokenizer.encode(PROMPT, False)
        job = Job.create(Request(ids, 4, SamplingParams()), SpecChoice(gen.method, 4))
        scheduler.stop()                     # the stop command is queued first
        scheduler.submit(job)                # then a request arrives
        scheduler.run()                      # the loop ends at the stop command
        with pytest.raises(Closed, match="shutting down"):
            scheduler.submit(Job.create(Request(ids, 4, SamplingParams()), SpecChoice(gen.method, 4)))
        return await asyncio.wait_for(job.events.get(), 5)

    event = asyncio.run(scenario())
    assert isinstance(event, Failed) and event.status == 503 and "shutting down" in event.message
    assert scheduler.outstanding == 0


@pytest.mark.parametrize("where", ["step", "add"])
def test_a_failed_generation_is_a_500_and_logged_with_its_traceback(server, client, monkeypatch, caplog, where):
    """An exception inside an engine step (or while admitting a request) fails the request with a 500 and
    logs the traceback with the engine's method on the "specdec" logger; the server keeps serving."""
    import logging

    from specdec.engine import Engine

    def boom(self, *args):
        raise RuntimeError("boom in the engine")

    with monkeypatch.context() as m:
        m.setattr(Engine, where, boom)
        with caplog.at_level(logging.ERROR, logger="specdec"):
            with pytest.raises(openai.InternalServerError) as e:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                          extra_body={"speculative": {"method": "ngram", "num_draft_tokens": 4}})
    assert e.value.status_code == 500 and "boom in the engine" in e.value.body["message"]
    records = [r for r in caplog.records if r.name == "specdec" and r.levelno == logging.ERROR]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    assert "method ngram" in records[0].getMessage() and records[0].exc_info is not None
    assert "RuntimeError: boom in the engine" in caplog.text and "Traceback" in caplog.text
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_a_stream_that_ends_in_an_error_event_is_logged_as_refused_requests_are(server, monkeypatch, caplog):
    """A stream already answered 200 reports a failure as an error event; the log still gets the request's line
    with its status, as a request refused before its stream began does."""
    import logging

    import requests

    from specdec.engine import Engine

    step, steps = Engine.step, []

    def boom_later(self, *args):                # the stream has begun when the third step fails
        steps.append(1)
        if len(steps) > 2:
            raise RuntimeError("boom in the engine")
        return step(self, *args)

    with monkeypatch.context() as m:
        m.setattr(Engine, "step", boom_later)
        with caplog.at_level(logging.INFO, logger="specdec"):
            with requests.post(server.url + "/v1/completions", stream=True, timeout=20, json={
                    "model": MODEL, "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stream": True,
                    "speculative": {"method": "ngram", "num_draft_tokens": 4}}) as r:
                events = [line for line in r.iter_lines() if line.startswith(b"data: ")]
    assert r.status_code == 200 and b"boom in the engine" in events[-1]
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "specdec"]
    assert any(line.startswith("POST /v1/completions -> 500 (in the stream) ") and "boom" in line
               for line in lines), lines


def test_malloc_trim_is_looked_up_on_first_use():
    """Importing the scheduler loads no C library; the first trim_heap looks malloc_trim up once."""
    import subprocess
    import sys

    code = ("import ctypes.util, specdec.server.scheduler as s\n"
            "calls = []\n"
            "real = ctypes.util.find_library\n"
            "ctypes.util.find_library = lambda n: calls.append(n) or real(n)\n"
            "assert s._malloc_trim.cache_info().currsize == 0\n"
            "s.trim_heap(); s.trim_heap()\n"
            "assert calls == ['c'], calls\n"
            "print(type(s.trim_heap()).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "int"


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="a b c a b c a b c a b", max_tokens=8, temperature=0)
    text = server.metrics()
    assert metric(text, "specdec:spec_decode_num_drafts_total") > 0
    assert metric(text, "specdec:spec_decode_num_draft_tokens_total") > 0
    assert metric(text, "specdec:spec_decode_num_accepted_tokens_total") > 0
    assert metric(text, "specdec:spec_decode_num_accepted_tokens_per_pos_total", '{position="0"}') > 0
    assert metric(text, "specdec:time_to_first_token_seconds_count") > 0
    assert metric(text, "specdec:inter_token_latency_seconds_count") > 0
    assert metric(text, "specdec:e2e_request_latency_seconds_count") > 0
    assert metric(text, "specdec:requests_total", '{endpoint="/v1/completions",status="200"}') > 0
    assert metric(text, "specdec:num_requests_running") == 0
    assert metric(text, "specdec:num_requests_waiting") == 0
    assert metric(text, "specdec:engine_sequences", '{method="ngram",num_draft_tokens="4"}') == 0   # kept, idle
    for kind in ("prefill", "decode"):
        label = f'{{kind="{kind}"}}'
        steps = metric(text, "specdec:engine_steps_total", label)
        assert steps >= 1
        assert metric(text, "specdec:engine_step_seconds_total", label) > 0
        assert metric(text, "specdec:engine_step_sequences_total", label) >= steps


def test_a_chats_next_turn_reuses_its_prefix_exactly(gen, server, client):
    """The second turn of a conversation starts with the first turn's tokens: the server copies the
    full 128-token pieces from the prefix cache (counted in /metrics) and answers exactly what a
    prefill from scratch (offline generate, no prefix cache) gives."""
    story = " ".join(f"Item {i} is a {c} box." for i, c in zip(range(18), ["red", "green", "blue"] * 6))
    turn1 = [{"role": "user", "content": f"Read this list. {story} Which item comes first?"}]
    first = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=8, temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And which one comes last?"}]
    ids = gen.tokenizer.encode_chat(turn2)
    assert 128 < len(ids) <= 256
    hits = metric(server.metrics(), "specdec:prefix_cache_hits_total")
    got = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=12, temperature=0)
    assert metric(server.metrics(), "specdec:prefix_cache_hits_total") - hits == 128
    held = server.metrics()                                   # what it holds, within its bound
    assert 0 < metric(held, "specdec:prefix_cache_bytes") <= server.state.pool.prefix_cache.capacity_bytes
    assert metric(held, "specdec:prefix_cache_pieces") >= 1
    want = gen.generate(ids, max_new_tokens=12)
    assert got.choices[0].message.content == want.text


def test_prefill_steps_run_with_prefill_threads(gen, monkeypatch):
    """--prefill-threads: a step that prefills runs with that many torch threads, decode steps with the
    process's own setting, which is restored afterwards; 0 threads is a clear error."""
    import torch

    from specdec.engine import Engine, Request
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError, match="prefill_threads"):
        ServeConfig(prefill_threads=0)
    base = torch.get_num_threads()
    seen: dict[str, set[int]] = {"prefill_pieces": set(), "speculate": set()}
    for name in seen:
        real = getattr(Engine, f"_{name}")

        def spy(self, *seqs, _real=real, _name=name):
            seen[_name].add(torch.get_num_threads())
            return _real(self, *seqs)
        monkeypatch.setattr(Engine, f"_{name}", spy)
    state = ServerState(gen, ServeConfig(max_batch=2, max_prompt_tokens=64, max_tokens=4, prefill_threads=base + 1))
    eng = state.pool.get(state.default)
    eng.add(Request(gen.tokenizer.encode(PROMPT, chat=False), 3))
    with torch.inference_mode():
        while eng.busy:
            state.scheduler._step(eng)
    assert seen == {"prefill_pieces": {base + 1}, "speculate": {base}}
    assert torch.get_num_threads() == base


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_serve_command_steps_in_its_main_thread_and_stops_on_a_signal(tmp_path):
    """`specdec serve` as users run it: the scheduler loop in the main thread, uvicorn in a helper thread.
    Its start-up line names the dtype /health reports and the kernel family. It answers; SIGINT ends an open stream with an error event and the process exits 0,
    a SIGTERM right after it changing nothing; a second
    server on the taken port exits 2 with a clear error before it loads the model."""
    import signal
    import subprocess
    import sys

    from specdec.machine import probe

    port = free_port()
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", MODEL, "--dtype", "auto", "--method", "none",
           "--max-tokens", "200"]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=subprocess.DEVNULL, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, open(tmp_path / "serve.log").read()
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "specdec serve did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        assert got.usage.completion_tokens == 4
        dtype = requests.get(url + "/health", timeout=5).json()["runtime"]["dtype"]     # one truth: what auto chose
        start_up = re.search(r"serving \S+ \(method none, (\S+), kernels (\S+)\)", open(tmp_path / "serve.log").read())
        assert start_up and start_up.group(1) == dtype
        assert start_up.group(2) == probe().kernel_family

        second = subprocess.run(cmd + ["--port", str(port)], capture_output=True, text=True, timeout=300)
        assert second.returncode == 2                                        # before loading the model
        assert f"cannot listen on 127.0.0.1:{port}" in second.stderr and "in use" in second.stderr
        roomless = subprocess.run(cmd + ["--port", str(free_port()), "--max-prompt-tokens", "8191"],
                                  capture_output=True, text=True, timeout=300)
        assert roomless.returncode == 2 and roomless.stderr.strip().splitlines()[-1] == \
            f"specdec: error: --max-prompt-tokens 8191 leaves no room for an answer in {MODEL}'s context of 8192 " \
            "tokens (at most 8190)"

        with requests.post(url + "/v1/completions", json={"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 200,
                                                          "temperature": 0, "stream": True}, stream=True,
                           timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith(b"data: "))
            assert b'"text"' in first
            proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line.startswith(b"data: ")]
        assert rest and b"shutting down" in rest[-1], rest[-3:]
        proc.send_signal(signal.SIGTERM)                 # a supervisor repeating the signal while it stops
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_run_server_steps_engines_in_the_calling_thread(gen, monkeypatch):
    """run_server (what `specdec serve` calls): every engine step runs in the thread that called it (the one
    that loaded the model; a second OpenMP master thread makes libgomp stop spinning), HTTP in another."""
    import os
    import signal

    from specdec.engine import Engine

    state = ServerState(gen, ServeConfig(max_batch=2, max_tokens=16))
    stepped_in: set[str] = set()
    step = Engine.step

    def recording_step(self):
        stepped_in.add(threading.current_thread().name)
        return step(self)

    monkeypatch.setattr(Engine, "step", recording_step)
    answers: list[int] = []

    def drive(url: str) -> None:
        try:
            c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            answers.append(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
                           .usage.completion_tokens)
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    code, _ = serve_until_stopped(state, drive)
    assert code == 0
    assert answers == [3]
    assert stepped_in == {threading.current_thread().name}
    assert not state.scheduler.alive


def serve_until_stopped(state: ServerState, drive) -> tuple[int, float]:
    """run_server (what `specdec serve` runs) on a free port while `drive(url)` runs in another thread;
    (its return code, seconds it took)."""
    from specdec.cli_serve import http_server, run_server

    port = free_port()
    server = http_server(state, "127.0.0.1", port, "warning")

    def driver() -> None:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        drive(f"http://127.0.0.1:{port}")

    thread = threading.Thread(target=driver, name="test-client")
    thread.start()
    t0 = time.monotonic()
    code = run_server(server, state.scheduler)
    took = time.monotonic() - t0
    thread.join()
    return code, took


def test_a_signal_while_a_requests_engine_is_built_still_answers_it(gen, monkeypatch):
    """A stop signal that lands while the loop builds the engine a request named (the request has left the
    waiting list and is not running yet) still answers that request with a 503, and the server stops promptly."""
    import os
    import signal

    from specdec.server.scheduler import EnginePool

    state = ServerState(gen, ServeConfig(max_batch=2, max_tokens=16))
    build = EnginePool._build

    def build_with_a_signal(self, spec):
        if spec.method == "suffix":
            os.kill(os.getpid(), signal.SIGTERM)     # the operator stops the server while the engine is built
            time.sleep(0.2)
        return build(self, spec)

    monkeypatch.setattr(EnginePool, "_build", build_with_a_signal)
    answers: list = []

    def drive(url: str) -> None:
        try:
            r = requests.post(url + "/v1/completions", timeout=20, json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "speculative": {"method": "suffix"}})
            answers.append((r.status_code, r.json()["error"]["message"], r.json()["error"]["code"]))
        except requests.RequestException as e:
            answers.append(type(e).__name__)

    code, took = serve_until_stopped(state, drive)
    assert answers == [(503, "the server is shutting down", "server_shutting_down")]
    assert code == 0 and took < 10
    assert state.scheduler.outstanding == 0


def test_a_second_signal_while_the_server_stops_still_ends_open_streams(gen, monkeypatch):
    """Ctrl-C pressed twice (or SIGTERM repeated by a supervisor): the second signal, arriving while the loop
    fails its open jobs, does not cut that short: the open stream still ends with its error event."""
    import os
    import signal

    from specdec.server.scheduler import Scheduler

    state = ServerState(gen, ServeConfig(max_batch=2, max_tokens=200))
    fail = Scheduler._fail
    again: list[bool] = []

    def fail_after_a_second_signal(self, job, message, status, code=None):
        if status == 503 and not again:
            again.append(True)
            os.kill(os.getpid(), signal.SIGINT)      # the second Ctrl-C lands during the clean-up
            time.sleep(0.05)
        return fail(self, job, message, status, code)

    monkeypatch.setattr(Scheduler, "_fail", fail_after_a_second_signal)
    rest: list[bytes] = []

    def drive(url: str) -> None:
        try:
            with requests.post(url + "/v1/completions", stream=True, timeout=20, json={
                    "model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 200, "temperature": 0,
                    "stream": True}) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith(b"data: "))
                os.kill(os.getpid(), signal.SIGINT)      # the first Ctrl-C
                rest.extend(line for line in lines if line.startswith(b"data: "))
        except requests.RequestException as e:
            rest.append(type(e).__name__.encode())

    code, took = serve_until_stopped(state, drive)
    assert again and rest and b"shutting down" in rest[-1], rest[-2:]
    assert b"server_shutting_down" in rest[-1]
    assert code == 0 and took < 10


def test_a_wrong_method_is_a_405_that_names_the_allowed_methods(server):
    """RFC 9110: a 405 carries Allow; the OpenAI-shaped body keeps Starlette's header."""
    r = requests.options(server.url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["message"] == \
        "OPTIONS is not allowed on /v1/chat/completions (allowed: POST)"
    assert r.headers.get("allow") == "POST"
    r = requests.get(server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.headers.get("allow") == "POST"
    r = requests.post(server.url + "/v1/embeddings", json={"input": "hi"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"] == "no such route: POST /v1/embeddings (see /docs)"
    r = requests.get(server.url + "/v1/models/", timeout=10)
    assert r.status_code == 404 and "names no model" in r.json()["error"]["message"]


def test_cors_for_the_origins_the_server_names(gen, server):
    """--cors-origin: a browser's preflight is answered and responses carry the origin; a server without it sends
    no CORS headers (browsers then refuse cross-origin calls) and other origins get none."""
    app_origin = "http://localhost:3000"
    srv = LiveServer(ServerState(gen, ServeConfig(max_batch=1, max_prompt_tokens=64, max_tokens=4, api_keys=(KEY,),
                                                  cors_origins=(app_origin,))))
    try:
        pre = requests.options(srv.url + "/v1/chat/completions", timeout=10, headers={
            "Origin": app_origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == app_origin
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = requests.post(srv.url + "/v1/completions", timeout=60, headers={"Origin": app_origin,
                                                                            "Authorization": f"Bearer {KEY}"},
                          json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == app_origin
        denied = requests.post(srv.url + "/v1/completions", timeout=60, headers={"Origin": app_origin},
                               json={"prompt": PROMPT, "max_tokens": 2})              # no key: a 401 the app can read
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == app_origin
        other = requests.post(srv.url + "/v1/completions", timeout=60, headers={"Origin": "http://elsewhere.example",
                                                                                "Authorization": f"Bearer {KEY}"},
                              json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert "access-control-allow-origin" not in other.headers
    finally:
        srv.stop()
    plain = requests.post(server.url + "/v1/completions", timeout=60, headers={"Origin": app_origin},
                          json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_chat_messages_that_fill_the_context_say_so_without_naming_a_max_tokens_not_sent(gen):
    """No max_tokens sent and no room left after the messages: the error says the messages fill the context
    (not "max_tokens (1)", a value the client never sent)."""
    from specdec.server.app import ApiError, parse_chat
    from specdec.server.schema import ChatCompletionRequest

    state = ServerState(gen, ServeConfig(max_batch=1, max_prompt_tokens=20_000, max_tokens=16))
    context = gen.target.max_seq_len
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * context}]}
    with pytest.raises(ApiError) as e:
        parse_chat(ChatCompletionRequest(**body), state)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert "leave no room for an answer" in e.value.message and "max_tokens" not in e.value.message
    body["max_tokens"] = 8                                        # sent: the message names it
    with pytest.raises(ApiError) as e:
        parse_chat(ChatCompletionRequest(**body), state)
    assert "max_tokens (8)" in e.value.message


def test_a_client_stalled_in_its_body_does_not_hold_the_shutdown(gen):
    """A client that sent half its body and waits: the server stops within GRACE_SECONDS of the scheduler's end
    (uvicorn's default waited for the connection forever, and the join 30 s)."""
    import os
    import signal

    from specdec.cli_serve import GRACE_SECONDS

    state = ServerState(gen, ServeConfig(max_batch=2, max_tokens=16))
    held: list[socket.socket] = []

    def drive(url: str) -> None:
        port = int(url.rsplit(":", 1)[1])
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"messages\": ")
        held.append(s)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    code, took = serve_until_stopped(state, drive)
    held[0].close()
    assert code == 0 and took < GRACE_SECONDS + 4


def test_a_body_over_the_limit_is_one_413_and_the_connection_closes(server):
    """The rest of an oversized body is not parsed as a second request (a stray plain-text 400 followed the 413)."""
    port = int(server.url.rsplit(":", 1)[1])
    body = b'{"prompt": "' + b"x" * 150_000 + b'"}'
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        try:
            s.sendall(body)
        except OSError:                               # the server closed its side: the rest is not read
            pass
        got = b""
        while True:
            try:
                part = s.recv(65536)
            except ConnectionResetError:
                break
            if not part:
                break
            got += part
    finally:
        s.close()
    assert got.startswith(b"HTTP/1.1 413") and got.count(b"HTTP/1.1 ") == 1, got[:600]
    assert b"exceeds the limit" in got
