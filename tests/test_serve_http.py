"""The OpenAI-compatible server, live on 127.0.0.1, through the official `openai` client: outputs at
temperature 0 equal offline generation (a tiny random model with a character tokenizer, and the
embedded model with its shipped head), streaming, stop strings, concurrency and admission, client
disconnects, queue overflow (429), bad requests (400 naming the field), shutdown under load, and the
edge against hostile clients (API key, JSON only, body size, read deadlines, connection limit, a dead
engine)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from conftest import make_tiny_checkpoint
from test_serve_engine import collect
from jetspec_jax.api import generate, random_head
from jetspec_jax.serve.__main__ import warm_up
from jetspec_jax.serve.engine import Engine, EngineRequest
from jetspec_jax.serve.http_server import GracefulServer, begin_shutdown, create_app, uvicorn_config
from jetspec_jax.target import load_target
from jetspec_jax.tokens import encode_prompts

REQUEST_TIMEOUT = 120.0  # seconds one request may take (first ones compile)
MODEL = "test-model"
# min_batch=slots: every chunk runs all 4 rows, so each engine compiles one chunk program, not one per load
TINY_ENGINE = dict(method="jetspec", slots=4, max_len=512, budget=8, chunk_steps=4, max_queue=12, min_batch=4)
EMBEDDED_ENGINE = dict(method="jetspec", slots=4, max_len=256, budget=16, chunk_steps=4, max_queue=12, min_batch=4)


def char_tokenizer():
    """A character tokenizer of 97 ids for the tiny model (vocab_size 97), with a ChatML template.
    Its end-of-text id (96) is one the random model's greedy outputs never reach in 400 tokens, so
    long requests stay long."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    chars = ["\n"] + [chr(c) for c in range(32, 127) if chr(c) not in "`~^"]
    vocab = {t: i for i, t in enumerate(["<|im_start|>", "<|im_end|>", "<unk>"] + chars + ["<|endoftext|>"])}
    assert len(vocab) == 97
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>", pad_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=template)


@dataclasses.dataclass
class Live:
    url: str
    server: GracefulServer
    thread: threading.Thread
    engine: Engine
    app: object

    def client(self, timeout: float = REQUEST_TIMEOUT) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {m[1]: float(m[2]) for m in re.finditer(r"^jetspec_(\w+) (\S+)$", text, re.M)}

    def wait_idle(self, timeout: float = REQUEST_TIMEOUT) -> dict[str, float]:
        """Metrics once no slot is live and nothing is queued; fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            if m["live_slots"] == 0 and m["queue_depth"] == 0:
                return m
            time.sleep(0.05)
        raise AssertionError(f"the engine is still busy after {timeout} s: {self.metrics()}")


@contextlib.contextmanager
def serving(engine: Engine, tokenizer, graceful: float = 10.0, api_key: str | None = None,
            max_body_bytes: int = 1 << 20, **limits):
    """A real uvicorn server on a free 127.0.0.1 port, in a background thread, set up as the command
    line sets it up (`limits`: uvicorn_config's read deadlines and connection limit)."""
    app = create_app(engine, tokenizer, MODEL, default_max_tokens=16, shutdown_timeout=graceful, api_key=api_key,
                     max_body_bytes=max_body_bytes)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = GracefulServer(uvicorn_config(app, log_level="warning", **limits))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    live = Live(f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread, engine, app)
    try:
        yield live
    finally:
        server.should_exit = True
        thread.join(graceful + 70)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-serve"))
    make_tiny_checkpoint("qwen3", path, seed=1)
    char_tokenizer().save_pretrained(path)
    target = load_target(path, dtype="float32")  # the real loader picks up the tokenizer
    head = random_head(target, "causal")
    return target, head


TINY_PROMPTS = ["What is 2+2?", "Tell me a story about a cat.", "Hi there!"]
TINY_LONGEST = 300


@pytest.fixture(scope="module")
def tiny_offline(tiny):
    """{prompt: offline greedy token ids} for TINY_PROMPTS, TINY_LONGEST tokens, in one compilation."""
    target, _ = tiny
    return dict(zip(TINY_PROMPTS, offline(target, TINY_PROMPTS, [TINY_LONGEST] * len(TINY_PROMPTS))))


@pytest.fixture(scope="module")
def tiny_server(tiny):
    target, head = tiny
    with serving(Engine(target, head, **TINY_ENGINE).start(), target.tokenizer) as live:
        # compiles, so that tests time requests only: the command line's first-request warm-up
        warm_up(live.engine, encode_prompts(target.tokenizer, ["warm up"])[0])
        yield live


@pytest.fixture(scope="module")
def embedded_server(embedded_target):
    from jetspec_jax.loading.head_checkpoint import load_head, packaged_head_path

    head = load_head(packaged_head_path(embedded_target, "jetspec"), embedded_target.params["embed"].dtype,
                     target=embedded_target)
    with serving(Engine(embedded_target, head, **EMBEDDED_ENGINE).start(), embedded_target.tokenizer) as live:
        yield live


def offline(target, prompts, max_tokens, chat=True):
    """Offline greedy token ids, one batched call; request i's answer is the first max_tokens[i]."""
    out = generate(list(prompts), target, method="ar", max_new_tokens=max(max_tokens), chat=chat)
    return [ids[:n] for ids, n in zip(out.token_ids, max_tokens)]


def chat(client, prompt, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          temperature=0, **kw)


def read_stream(stream, chat=True):
    """(text, finish_reason, usage) of a streamed completion."""
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage


# ---- outputs ----------------------------------------------------------------------------------


def test_chat_and_completions_equal_offline_generation(tiny, tiny_offline, tiny_server):
    target, _ = tiny
    expected = target.tokenizer.decode(tiny_offline["What is 2+2?"][:24], skip_special_tokens=True)
    client = tiny_server.client()

    r = chat(client, "What is 2+2?", max_tokens=24)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "length" and r.model == MODEL and r.object == "chat.completion"
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (24, r.usage.prompt_tokens + 24)

    stream = chat(client, "What is 2+2?", max_tokens=24, stream=True, stream_options={"include_usage": True})
    text, finish, usage = read_stream(stream)
    assert (text, finish, usage.completion_tokens) == (expected, "length", 24)

    # The chat template's text as a raw prompt tokenizes to the same ids, so it has the same answer.
    raw = target.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                               add_generation_prompt=True)
    r = client.completions.create(model=MODEL, prompt=raw, max_tokens=24, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (expected, "length", 24)
    stream = client.completions.create(model=MODEL, prompt=raw, max_tokens=24, temperature=0, stream=True)
    text, finish, usage = read_stream(stream, chat=False)
    assert (text, finish, usage) == (expected, "length", None)  # usage only when asked for
    tiny_server.wait_idle()


def test_stop_strings_cut_the_text_and_free_the_slot(tiny, tiny_offline, tiny_server):
    target, _ = tiny
    full = target.tokenizer.decode(tiny_offline["What is 2+2?"][:40], skip_special_tokens=True)
    stop = full[10:13]  # three characters: held back across tokens until they match
    expected = full[: full.find(stop)]
    client = tiny_server.client()
    r = chat(client, "What is 2+2?", max_tokens=40, stop=[stop, "never-there"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (expected, "stop")
    text, finish, _ = read_stream(chat(client, "What is 2+2?", max_tokens=40, stop=stop, stream=True))
    assert (text, finish) == (expected, "stop")
    tiny_server.wait_idle()


def test_sixteen_concurrent_requests_equal_offline_generation(embedded_target, embedded_server):
    """Different prompts and lengths, half of them streamed, more than the slots at once: each answer
    is the offline greedy one (T=0 is lossless), cut at its own max_tokens or at EOS."""
    topics = ["the sea", "a cat", "rain", "the moon", "bread", "music", "a tree", "snow"]
    prompts = [f"Write one sentence about {t}." if i % 2 else f"What is {i} + {i + 3}?"
               for i, t in enumerate(topics * 2)]
    max_tokens = [3 + (i * 5) % 10 for i in range(16)]  # few tokens: the 135M model is slow on CPU
    expected = [embedded_target.tokenizer.decode(ids, skip_special_tokens=True)
                for ids in offline(embedded_target, prompts, max_tokens)]
    client = embedded_server.client()

    def ask(i):
        if i % 2:
            return read_stream(chat(client, prompts[i], max_tokens=max_tokens[i], stream=True))[:2]
        r = chat(client, prompts[i], max_tokens=max_tokens[i])
        return r.choices[0].message.content, r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16), timeout=3 * REQUEST_TIMEOUT))
    assert [a[0] for a in answers] == expected
    assert {a[1] for a in answers} <= {"stop", "length"}
    m = embedded_server.wait_idle()
    assert m["requests_total"] >= 16 and m["tau"] >= 1.0 and "budget" in m


def test_admission_while_others_run(tiny, tiny_offline, tiny_server):
    """A short request admitted while a long one streams finishes first; both equal offline."""
    target, _ = tiny
    decode = target.tokenizer.decode
    long_prompt, short_prompt = "Tell me a story about a cat.", "Hi there!"
    client = tiny_server.client()
    stream = chat(client, long_prompt, max_tokens=TINY_LONGEST, stream=True)
    chunks = iter(stream)
    text = next(chunks).choices[0].delta.content + next(chunks).choices[0].delta.content  # it is running
    short = chat(client, short_prompt, max_tokens=8)
    assert short.choices[0].message.content == decode(tiny_offline[short_prompt][:8], skip_special_tokens=True)
    assert tiny_server.metrics()["live_slots"] == 1  # the long one is still going
    rest, finish, _ = read_stream(chunks)
    assert text + rest == decode(tiny_offline[long_prompt], skip_special_tokens=True) and finish == "length"
    tiny_server.wait_idle()


# ---- disconnects, overflow, shutdown --------------------------------------------------------------


def test_client_disconnect_frees_the_slot(tiny_server):
    """A stream closed after two chunks, and a non-streamed request whose client gives up, both stop
    generating well before their max_tokens (the tiny model never ends by itself)."""
    client = tiny_server.client()
    before = tiny_server.wait_idle()["generated_tokens_total"]
    stream = chat(client, "Tell me a story about a cat.", max_tokens=400, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    after = tiny_server.wait_idle()["generated_tokens_total"]
    assert after - before < 400

    with pytest.raises(openai.APITimeoutError):
        chat(tiny_server.client(timeout=0.5), "Tell me a story about a dog.", max_tokens=400)
    final = tiny_server.wait_idle()["generated_tokens_total"]
    assert final - after < 400


def test_queue_overflow_is_429_and_shutdown_answers_the_queue(tiny):
    """An engine whose device thread is not started admits nothing: slots + max_queue requests wait,
    the next ones get 429. Shutting down then answers the waiting ones with a 'cancelled' error
    event, and /health and new requests get 503."""
    target, head = tiny
    engine = Engine(target, head, **{**TINY_ENGINE, "slots": 2, "max_queue": 2})  # never started
    with serving(engine, target.tokenizer) as live:
        client = live.client()
        waiting = [chat(client, f"question {i}", max_tokens=8, stream=True) for i in range(4)]
        assert live.metrics()["queue_depth"] == 4
        for _ in range(3):
            with pytest.raises(openai.RateLimitError) as e:
                chat(client, "one too many", max_tokens=8)
            assert e.value.status_code == 429 and e.value.code == "queue_full"
        # what is full: both slots are free (nothing was admitted), the 4 requests wait in the queue
        assert "0 decoding and 4 queued" in e.value.message and "slots are busy" not in e.value.message
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="also too many", max_tokens=8, stream=True)
        assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}

        begin_shutdown(live.app).join(30)
        for stream in waiting:
            with pytest.raises(openai.APIError) as e:
                read_stream(stream)
            assert e.value.code == "cancelled"
        assert httpx.get(f"{live.url}/health").status_code == 503
        with pytest.raises(openai.InternalServerError) as e:
            chat(client, "late", max_tokens=8)
        assert e.value.status_code == 503 and e.value.code == "shutting_down"
    m = engine.metrics()
    assert m["queue_depth"] == 0 and m["requests_finished"] == m["requests_total"] == 4  # cancelled ones count


def connection_refused_within(url: str, seconds: float) -> bool:
    """Whether new connections to `url` are refused (or reset unanswered) within `seconds` (until then a
    request gets 503)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        except (httpx.ConnectError, httpx.ReadError):  # refused, or reset unanswered from the closing backlog
            return True
        time.sleep(0.02)
    return False


def test_shutdown_under_load_finishes_or_cancels_everything(tiny):
    """SIGTERM's path with 6 requests on 4 slots: the short running ones finish within the grace
    period, the others finish or are cancelled and told so (503, or an error event in the stream),
    none hangs, and the server and the engine stop. The grace period is ten times what the short
    requests take on this machine, after a full warm-up, so that a slow or busy machine cannot turn
    a finish into a cancellation."""
    target, head = tiny
    engine = Engine(target, head, **TINY_ENGINE).start(warm_up=True)
    engine.warm_up.wait()  # every program compiled: no request below waits on a compilation
    t0 = time.monotonic()
    short = [engine.submit(EngineRequest([3 + i] * 12, max_new_tokens=30)) for i in range(4)]
    assert [collect(h)[1].reason for h in short] == ["length"] * 4
    graceful = max(2.0, 10 * (time.monotonic() - t0))
    with serving(engine, target.tokenizer, graceful=graceful) as live:
        client = live.client(timeout=60)
        assert chat(client, "warm", max_tokens=4).choices[0].finish_reason == "length"

        def ask(i, max_tokens):
            try:
                if i % 2:
                    return read_stream(chat(client, f"story {i}", max_tokens=max_tokens, stream=True))[1]
                return chat(client, f"story {i}", max_tokens=max_tokens).choices[0].finish_reason
            except openai.APIError as e:
                return e.code or type(e).__name__

        before = live.metrics()["requests_total"]  # the direct submits and the warm request above

        def submitted(n):  # the engine holds n of the requests below (SIGTERM must come after they are in)
            deadline = time.monotonic() + 30
            while live.metrics()["requests_total"] < before + n:
                assert time.monotonic() < deadline, f"{n} requests were not all submitted within 30 s"
                time.sleep(0.02)

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            running = [pool.submit(ask, i, n) for i, n in enumerate([30, 30, 400, 400])]  # fill the 4 slots
            submitted(4)
            queued = [pool.submit(ask, i, 400) for i in (4, 5)]
            submitted(6)
            t0 = time.monotonic()
            live.server.handle_exit(signal.SIGTERM, None)
            refused = connection_refused_within(live.url, 10.0)  # at uvicorn's next tick
            outcomes = [f.result(timeout=60) for f in running + queued]
        assert refused, "the server still accepted connections 10 s after SIGTERM"
        live.thread.join(60)
        assert not live.thread.is_alive() and time.monotonic() - t0 < graceful + 30
    assert engine.thread is not None and not engine.thread.is_alive()
    assert outcomes[:2] == ["length", "length"], outcomes  # short ones finish within the grace period
    assert set(outcomes) <= {"length", "cancelled"}, outcomes


# ---- bad requests ---------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}]
BAD_CHAT = [
    (dict(model="no-such-model"), "model"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role"),
    (dict(max_tokens=10_000), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_completion_tokens=10_000), "max_completion_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=2), "top_p"),
    (dict(extra_body={"top_k": -1}), "top_k"),
    (dict(extra_body={"top_k": 2**31}), "top_k"),  # killed the engine's thread (int32) for good
    (dict(extra_body={"top_k": 10**12}), "top_k"),
    (dict(extra_body={"top_k": 98}), "top_k"),  # the tiny model's vocabulary is 97
    (dict(temperature=2.5), "temperature"),  # OpenAI's range is 0..2
    (dict(max_tokens=True), "max_tokens"),  # strict types: not coerced to 1, 5 or True
    (dict(max_tokens="5"), "max_tokens"),
    (dict(extra_body={"stream": "yes"}), "stream"),
    (dict(temperature="0.5"), "temperature"),
    (dict(n=2), "n"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(stream_options={"include_usage": "maybe"}), "stream_options.include_usage"),
]


@pytest.mark.parametrize("fields,param", BAD_CHAT, ids=[f"{p}={f}" for f, p in BAD_CHAT])
def test_bad_chat_request_is_400_naming_the_field(tiny_server, fields, param):
    request = dict(model=MODEL, messages=MESSAGES) | fields
    with pytest.raises(openai.BadRequestError) as e:
        tiny_server.client().chat.completions.create(**request)
    assert e.value.status_code == 400 and e.value.param == param and e.value.type == "invalid_request_error"
    assert param.split("[")[0].split(".")[0] in e.value.message


BAD_COMPLETION = [(dict(prompt=""), "prompt"), (dict(prompt="x", max_tokens=10_000), "max_tokens"),
                  (dict(prompt=[1, 2, 10_000]), "prompt"), (dict(prompt=["a", "b"]), "prompt"),
                  (dict(prompt="x", top_p=2), "top_p")]


@pytest.mark.parametrize("fields,param", BAD_COMPLETION)
def test_bad_completion_request_is_400_naming_the_field(tiny_server, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        tiny_server.client().completions.create(model=MODEL, **fields)
    assert e.value.param == param


@pytest.mark.parametrize("body", [b'{"model": "test-model", "messages": [', b"not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_json_is_400(tiny_server, body):
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_json"


# ---- hostile clients --------------------------------------------------------------------------------

SURROGATE_BODIES = [  # JSON's \\ud800 escape decodes to a lone surrogate, which nothing can encode
    ("completions", '{"model": "test-model", "prompt": "a\\ud800b"}', "prompt"),
    ("completions", '{"model": "test-model", "prompt": ["\\udfff"]}', "prompt[0]"),
    ("completions", '{"model": "test-model", "prompt": "hi", "stop": ["\\ud800"]}', "stop[0]"),
    ("chat/completions", '{"model": "test-model", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content"),
]


@pytest.mark.parametrize("route,body,param", SURROGATE_BODIES, ids=[p for _, _, p in SURROGATE_BODIES])
def test_lone_surrogate_is_400_not_a_dropped_connection(tiny_server, route, body, param):
    r = httpx.post(f"{tiny_server.url}/v1/{route}", content=body.encode(),
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and "surrogate" in r.json()["error"]["message"]


def test_tokenising_leaves_the_event_loop_free(tiny_server, monkeypatch):
    """A prompt being tokenised (held here until /health answers) does not stall the other clients:
    a 5 MB prompt tokenised in the async handler blocked /health for 8 s."""
    server = tiny_server.app.state.server
    tokenising, release = threading.Event(), threading.Event()

    def held_text_prompt(body):
        tokenising.set()
        assert release.wait(30), "/health never answered while a prompt was being tokenised"
        return original(body)

    original = server.text_prompt
    monkeypatch.setattr(server, "text_prompt", held_text_prompt)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        completion = pool.submit(tiny_server.client().completions.create, model=MODEL, prompt="Hi", max_tokens=2,
                                 temperature=0)
        assert tokenising.wait(30)
        try:
            assert httpx.get(f"{tiny_server.url}/health", timeout=10).json() == {"status": "ok"}
        finally:
            release.set()
        assert completion.result(timeout=REQUEST_TIMEOUT).usage.completion_tokens == 2


API_KEY = "test-key"
EDGE_LIMITS = dict(max_body_bytes=4096, header_timeout=1.0, body_timeout=1.0, max_connections=8)


@pytest.fixture(scope="module")
def edge_server(tiny):
    """A server with an API key and tight limits around an engine that is never started: the requests
    these tests send end at the HTTP layer, before any generation (nothing compiles)."""
    target, _ = tiny
    engine = Engine(target, None, method="ar", slots=2, max_len=128)
    with serving(engine, target.tokenizer, api_key=API_KEY, **EDGE_LIMITS) as live:
        yield live


def post(live, body, authorization: str | None = f"Bearer {API_KEY}", content_type: str | None = "application/json",
         route: str = "chat/completions") -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    if authorization is not None:
        headers["authorization"] = authorization
    return httpx.post(f"{live.url}/v1/{route}", content=body, headers=headers, timeout=10)


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_api_key_is_required_on_v1_only(edge_server):
    body = '{"model": "test-model"}'
    for authorization in (None, "Bearer wrong-key", "Bearer", f"Basic {API_KEY}", f"Bearer {API_KEY}x"):
        r = post(edge_server, body, authorization=authorization)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key", (authorization, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
    assert post(edge_server, body).status_code == 400  # the key lets it through to validation
    # closed after use: their pooled connections would count against the server's connection limit
    with openai.OpenAI(base_url=f"{edge_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=10) as right:
        assert [m.id for m in right.models.list()] == [MODEL]
    with openai.OpenAI(base_url=f"{edge_server.url}/v1", api_key="wrong-key", max_retries=0, timeout=10) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=MODEL, messages=MESSAGES)
    for path in ("/health", "/metrics"):  # load balancers and scrapers hold no key
        assert httpx.get(f"{edge_server.url}{path}", timeout=10).status_code == 200


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_post_bodies_must_be_sent_as_json(edge_server, content_type):
    """What a web page may post to any port without a CORS preflight is refused, JSON or not."""
    r = post(edge_server, '{"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}',
             content_type=content_type)
    assert r.status_code == 415 and error_of(r)["code"] == "unsupported_media_type"
    assert post(edge_server, "{}", content_type="Application/JSON; charset=utf-8").status_code == 400  # parsed


def test_body_over_the_limit_is_413(edge_server):
    big = '{"model": "test-model", "prompt": "' + "x" * 5000 + '"}'
    r = post(edge_server, big, route="completions")  # Content-Length says so: refused before reading
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large" and "4096" in error_of(r)["message"]
    r = post(edge_server, (big[i: i + 1000].encode() for i in range(0, len(big), 1000)), route="completions")
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"  # chunked: counted as it comes
    assert httpx.get(f"{edge_server.url}/health", timeout=10).status_code == 200


def test_stalled_clients_are_disconnected(edge_server):
    """A connection that sends nothing, half a request head, or a head and half its body is closed by the
    read deadlines (1 s here), with nothing sent back."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    port = int(edge_server.url.rsplit(":", 1)[1])
    stalls = [b"", head[:30], head + b'{"model": ']
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in stalls]
    t0 = time.monotonic()
    for sock, sent in zip(sockets, stalls):
        sock.sendall(sent)
    for sock in sockets:
        with sock:
            assert sock.recv(1024) == b""  # closed, well before the socket's own 10 s timeout
    assert time.monotonic() - t0 < 5


def test_requests_past_the_connection_limit_get_503(edge_server):
    port = int(edge_server.url.rsplit(":", 1)[1])
    limit = EDGE_LIMITS["max_connections"]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(limit - 1)]
    try:
        assert httpx.get(f"{edge_server.url}/health", timeout=10).status_code == 503  # the limit's connection
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10
    while httpx.get(f"{edge_server.url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the closed connections still count against the limit"
        time.sleep(0.05)


def test_a_dead_engine_shows_in_health_and_refuses_requests(tiny, monkeypatch):
    """A device failure stops the engine for good (its slots' state is gone): the request in it fails,
    /health says so with 503, and new requests get 503 'engine_failed', not 'shutting down'."""
    target, _ = tiny
    engine = Engine(target, None, method="ar", slots=2, max_len=128)

    def device_lost():
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "_admit_pending", device_lost)
    with serving(engine.start(), target.tokenizer) as live:
        client = live.client(timeout=30)
        with pytest.raises(openai.InternalServerError) as e:
            chat(client, "hi", max_tokens=2)
        assert e.value.code == "engine_error" and "device lost" in e.value.message
        r = httpx.get(f"{live.url}/health", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "engine_failed" and "device lost" in r.json()["message"]
        with pytest.raises(openai.InternalServerError) as e:
            chat(client, "again", max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "engine_failed"


# ---- the other endpoints ----------------------------------------------------------------------------


def test_models_health_metrics_and_unknown_routes(tiny_server):
    client = tiny_server.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert httpx.get(f"{tiny_server.url}/health").json() == {"status": "ok"}
    chat(client, "hi", max_tokens=4)
    m = tiny_server.wait_idle()
    for name in ("tokens_per_second", "tau", "live_slots", "queue_depth", "budget", "requests_total"):
        assert name in m, name
    assert m["budget"] == TINY_ENGINE["budget"] and m["tokens_per_second"] > 0
    assert m["warm_up_seconds"] > 0  # the first-request warm-up (the fixture's) is recorded, not only the full one
    r = httpx.get(f"{tiny_server.url}/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize("seed", [7, 2**63 - 1])
def test_same_seed_same_sample(tiny_server, seed):
    client = tiny_server.client()
    answers = [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0,
                                              top_p=0.9, seed=seed, extra_body={"top_k": 20}
                                              ).choices[0].message.content for _ in range(2)]
    assert answers[0] == answers[1] and len(answers[0]) > 0


# ---- the command line ------------------------------------------------------------------------------


def test_cli_bad_settings_are_one_error_line(capsys):
    from jetspec_jax.serve.__main__ import main

    assert main(["--slots", "0", "--port", "70000", "--max-body-bytes", "0", "--header-timeout", "0",
                 "--prefill-chunk", "100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1
    assert all(flag in err for flag in ("--slots", "--port", "--max-body-bytes", "--header-timeout",
                                        "--prefill-chunk must be a multiple of 64")), err
    assert main(["--kv-page-size", "48", "--kv-pages", "1"]) == 2
    err = capsys.readouterr().err
    assert "--kv-page-size must be a power of two >= 16, got 48" in err and "--kv-pages must be >= 2" in err, err
    assert main(["--kv-pages", "100"]) == 2
    assert "--kv-pages sizes a paged cache: give --kv-page-size too" in capsys.readouterr().err


def test_cli_api_key_from_the_flag_or_the_environment(monkeypatch):
    from jetspec_jax.serve.__main__ import build_parser

    monkeypatch.delenv("JETSPEC_API_KEY", raising=False)
    assert build_parser().parse_args([]).api_key is None
    monkeypatch.setenv("JETSPEC_API_KEY", "from-env")
    assert build_parser().parse_args([]).api_key == "from-env"
    assert build_parser().parse_args(["--api-key", "from-flag"]).api_key == "from-flag"


def test_cli_warmup_modes_parse():
    from jetspec_jax.serve.__main__ import build_parser

    parse = build_parser().parse_args
    assert parse([]).warmup == "first"  # the default: the programs of one short request
    assert [parse(["--warmup", mode]).warmup for mode in ("full", "first", "none")] == ["full", "first", "none"]
    assert parse(["--no-warmup"]).warmup == "none"
    with pytest.raises(SystemExit):
        parse(["--warmup", "all"])


def test_cli_serves_and_exits_cleanly_on_sigterm(tiny):
    """The real command line on the tiny model (no head ships for it: token by token), after the full
    warm-up: it answers, and SIGTERM stops it with status 0."""
    target, _ = tiny
    proc = subprocess.Popen([sys.executable, "-m", "jetspec_jax.serve", "--model", target.source, "--port", "0",
                             "--served-model-name", MODEL, "--slots", "2", "--max-len", "128", "--dtype", "float32",
                             "--warmup", "full", "--no-cache", "--shutdown-timeout", "5"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        deadline, url, log = time.monotonic() + REQUEST_TIMEOUT, None, []
        while url is None:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log)
            with contextlib.suppress(queue.Empty):
                log.append(lines.get(timeout=1))
                found = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log[-1])
                url = found and found[1]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT)
        r = chat(client, "hi", max_tokens=1)  # the first token comes from admission alone
        assert r.usage.completion_tokens == 1
        # 2 chunks (AR x 1 and 2 rows) and admissions of 1 and of 2 prompts in buckets of 64 and 128 columns
        assert any("warm-up (compilation of 6 programs) took" in line for line in log), "".join(log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("sig, warmup", [(signal.SIGINT, "first"), (signal.SIGTERM, "first"), (signal.SIGINT, "full")],
                         ids=["SIGINT", "SIGTERM", "SIGINT-full"])
def test_cli_stops_on_one_signal_during_start_up(tiny, sig, warmup):
    """One signal while warm-up compiles stops the server within a bound, with status 0, before it listens.
    SIGINT is inherited as ignored, as a shell script's background job has it: such a SIGINT was lost
    before (the server came up and served until a second one)."""
    target, _ = tiny
    command = [sys.executable, "-m", "jetspec_jax.serve", "--model", target.source, "--port", "0", "--slots", "2",
               "--max-len", "128", "--dtype", "float32", "--no-cache", "--shutdown-timeout", "5", "--warmup", warmup]
    proc = subprocess.Popen(["sh", "-c", 'trap "" INT; exec "$0" "$@"', *command],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        deadline, log = time.monotonic() + REQUEST_TIMEOUT, []
        while not (log and log[-1].startswith("warm-up: compiling")):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log)
            with contextlib.suppress(queue.Empty):
                log.append(lines.get(timeout=1))
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)  # the reader thread drains the rest of stderr
        while not lines.empty():
            log.append(lines.get())
        text = "".join(log)
        assert f"{sig.name}: stopped before serving" in text and "Uvicorn running" not in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
