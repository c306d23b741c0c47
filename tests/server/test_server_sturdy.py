"""The server keeps its promises under clients that stop early, wait, hang up, dawdle or send junk.

Every test runs against a real server over real HTTP with the served settings (keep-alive
interval, timeouts, connection caps), through the official `openai` client where it applies.
"""

import contextlib
import json
import logging
import random
import socket
import time

import httpx
import openai
import pytest

import m3lm
from m3lm.config import EngineConfig
from m3lm.engine.engine import LLMEngine
from m3lm.server.app import create_server_app
from m3lm.server.engine_client import AsyncEngine
from m3lm.server.protocol import Limits
from tests.support.live_server import API_KEY, MSG, NAME, LiveServer, stalled_engine, start, wait_idle
from tests.support.paths import PATIENCE_S

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def sse(lines) -> list[dict | str]:
    """The events of an SSE body: parsed `data:` objects, "[DONE]", and comment lines as they are."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        elif line.startswith(":"):
            out.append(line)
    return out


def a_stop_string(client) -> tuple[str, str]:
    """A greedy chat reply and a stop string that occurs in it, past its start."""
    whole = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=40, temperature=0)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "length" and len(text) >= 8, text
    k = len(text) // 2
    return text, text[k : k + 3]


# --- 1. a chat stop string ends the reply at once ---------------------------------------------------


def test_a_chat_stop_string_ends_the_whole_reply(client, live):
    text, stop = a_stop_string(client)
    reply = client.chat.completions.create(
        model=NAME, messages=MSG, max_tokens=40, temperature=0, stop=[stop]
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == text[: text.index(stop)]
    assert reply.usage.completion_tokens < 40
    wait_idle(live.engine)


def test_a_chat_stop_string_ends_the_stream_at_once(client, live):
    text, stop = a_stop_string(client)
    body = {"messages": MSG, "max_tokens": 40, "temperature": 0, "stop": [stop], "stream": True}
    # The keep-alive interval is 10 s: a stream that waited for one before ending would time out here.
    timeout = httpx.Timeout(5.0)
    with httpx.stream(
        "POST", live.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=timeout
    ) as r:
        events = sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text[: text.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# --- 2. a stream that waits is kept alive, never ended ----------------------------------------------


def test_a_stream_that_waits_past_the_keepalive_gets_comments_then_its_tokens(live):
    assert Limits().keepalive_s == 10.0
    wait_idle(live.engine)
    restore = stalled_engine(live, Limits().keepalive_s + 1.5)
    try:
        body = {"prompt": "once upon a time", "max_tokens": 5, "stream": True, "ignore_eos": True}
        with httpx.stream(
            "POST", live.url + "/v1/completions", json=body, headers=AUTH, timeout=PATIENCE_S
        ) as r:
            events = sse(r.iter_lines())
    finally:
        restore()
    first = next(i for i, e in enumerate(events) if isinstance(e, dict))
    assert any(e == ": keep-alive" for e in events[:first])
    chunks = [e for e in events if isinstance(e, dict)]
    assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1] == "[DONE]"
    wait_idle(live.engine)


# --- 3. a non-streamed request ends when its client hangs up ----------------------------------------


def test_a_non_streamed_request_is_aborted_when_its_client_disconnects(live):
    wait_idle(live.engine)
    runner = live.engine.engine.runner
    real = runner.run

    steps = []

    def slow(*a, **k):  # 250 steps: over 12 s for the request, if nothing aborts it
        steps.append(1)
        time.sleep(0.05)
        return real(*a, **k)

    runner.run = slow
    try:
        body = {"prompt": "once", "max_tokens": 250, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", json=body, headers=AUTH, timeout=0.5)
        wait_idle(live.engine)
        assert len(steps) < 250  # aborted by the hang-up, not run to its end
    finally:
        runner.run = real


# --- 4. a large prompt is refused before it is tokenized, and blocks no one -------------------------


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(live, monkeypatch):
    tok = live.engine.engine.tokenizer
    encoded = []
    monkeypatch.setattr(tok, "encode", lambda *a, **k: encoded.append(1) or [])
    # 1 MiB: within the largest body a request to this server can need, yet far from fitting
    huge = "once upon a time " * (1 << 16)
    for path, body in [
        ("/v1/completions", {"prompt": huge, "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 4}),
        ("/tokenize", {"prompt": huge}),
        ("/tokenize", {"messages": [{"role": "user", "content": huge}]}),
    ]:
        r = httpx.post(live.url + path, json=body, headers=AUTH, timeout=PATIENCE_S)
        assert r.status_code == 400 and "cannot fit" in r.json()["error"]["message"], (path, r.text[:200])
        r = httpx.post(live.url + path, json={"prompt": huge * 7}, headers=AUTH, timeout=20)
        assert r.status_code == 413  # past that body size: not even read
    assert encoded == []
    monkeypatch.undo()
    r = httpx.post(live.url + "/tokenize", json={"prompt": "once upon a time " * 100}, headers=AUTH)
    assert r.status_code == 400 and "a prompt holds at most 255" in r.json()["error"]["message"]


def test_streams_go_on_while_a_prompt_is_being_tokenized(live):
    """Encoding holds the tokenizer's lock; the text of running requests must not wait for it."""
    wait_idle(live.engine)
    tok = live.engine.engine.tokenizer
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 20, "stream": True, "ignore_eos": True}  # ids: no encode
    url = live.url + "/v1/completions"
    # Holding the lock as a long encode in another request would.
    with tok._lock, httpx.stream("POST", url, json=body, headers=AUTH, timeout=10) as r:
        events = sse(r.iter_lines())
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"


# --- 5. slow clients are cut off; a request without the key is refused on its headers --------------


def test_slow_and_keyless_clients_are_cut_off(live):
    limits = Limits()
    addr = ("127.0.0.1", live.port)
    idle, half, trickle, keyless = (socket.create_connection(addr) for _ in range(4))
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    trickle.sendall(f"{head}Authorization: Bearer {API_KEY}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    # A keyless client announcing 8 MB: refused at once, before any of the body is read.
    keyless.sendall(f"{head}Content-Length: 8000000\r\n\r\n".encode())
    keyless.settimeout(5)
    assert keyless.recv(4096).startswith(b"HTTP/1.1 401")
    t0 = time.monotonic()
    closed = {}
    for s in (idle, half, trickle):
        s.settimeout(0.5)
    while len(closed) < 3 and time.monotonic() - t0 < limits.body_timeout_s + 10:
        with contextlib.suppress(OSError):
            trickle.sendall(b"1\r\n \r\n")  # a byte of body every half second, forever
        for name, s in (("idle", idle), ("half", half), ("trickle", trickle)):
            if name in closed:
                continue
            try:
                data = s.recv(4096)
            except TimeoutError:
                continue
            closed[name] = (time.monotonic() - t0, data)
        assert httpx.get(live.url + "/health").status_code == 200  # serving meanwhile
    assert closed["idle"][1] == b"" and closed["half"][1] == b""
    assert limits.header_timeout_s - 1 < closed["half"][0] < limits.header_timeout_s + 3
    assert closed["trickle"][1].startswith(b"HTTP/1.1 408")
    assert limits.body_timeout_s - 1 < closed["trickle"][0] < limits.body_timeout_s + 3


# --- 6-8. junk in the request ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'),
        ("/tokenize", '{"prompt": "\\ud800"}'),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
            '"function": {"name": "f", "description": "\\ud83d"}}]}',
        ),
        ("/v1/completions", '{"prompt": "hi", "\\ud800": 1}'),
    ],
)
def test_an_unpaired_surrogate_is_a_400(live, path, body):
    r = httpx.post(live.url + path, content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_unknown_fields_are_logged_as_a_bounded_summary(client, live, caplog):
    from m3lm.server import protocol

    rng = random.Random(5)
    with caplog.at_level(logging.INFO, logger="m3lm.server"):
        for _ in range(3):
            extra = {f"x{rng.getrandbits(64):x}": 1 for _ in range(20_000)}
            client.completions.create(model=NAME, prompt="hi", max_tokens=1, extra_body=extra)
    lines = [r for r in caplog.records if "unknown request field" in r.getMessage()]
    assert len(lines) == 3 and all(len(r.getMessage()) < 1000 for r in lines)
    assert len(protocol._warned_fields) <= protocol._MAX_WARNED


def test_smaller_request_faults(client, live):
    for kwargs in ({"messages": []}, {"tools": []}, {"add_generation_prompt": False}):
        with pytest.raises(openai.BadRequestError, match="not allowed"):
            client.chat.completions.create(
                model=NAME, messages=MSG, max_tokens=2, extra_body={"chat_template_kwargs": kwargs}
            )
    top = 2**63 - 1  # the choices' seeds wrap around instead of overflowing
    reply = client.completions.create(model=NAME, prompt="hi", max_tokens=2, n=3, seed=top)
    assert len(reply.choices) == 3
    raw = socket.create_connection(("127.0.0.1", live.port))
    raw.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    raw.settimeout(5)
    answer = b""
    while chunk := raw.recv(4096):  # the server closes the connection after its answer
        answer += chunk
    answer = answer.decode()
    raw.close()
    assert answer.startswith("HTTP/1.1 400") and '"invalid_request_error"' in answer
    r = httpx.get(live.url + "/v1/models/", headers={**AUTH, "Host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers


# --- 9. the prefix cache is shared only within a cache salt -----------------------------------------


def test_cache_salt_keeps_tenants_apart(client, live):
    msgs = [{"role": "user", "content": "the secret system prompt of tenant A " * 6}]

    def cached(salt):
        extra = {"cache_salt": salt} if salt else {}
        reply = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=1, extra_body=extra)
        wait_idle(live.engine)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    again = cached("tenant-a")
    assert again > 0  # the same tenant reuses its pages
    assert cached("tenant-b") == 0  # another tenant learns nothing
    # Unsalted requests share only what unsalted requests sent (here: the chat template's header).
    assert cached(None) < again
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=msgs, max_tokens=1, extra_body={"cache_salt": ""})


# --- 10. fields the server would otherwise ignore ---------------------------------------------------


def test_logit_bias_and_refused_fields(client, live):
    favourite = 42
    reply = client.completions.create(
        model=NAME, prompt="once upon a time", max_tokens=6, temperature=1.0, logit_bias={str(favourite): 100}
    )
    tok = live.engine.engine.tokenizer
    assert reply.choices[0].text == tok.decode([favourite] * 6, skip_special_tokens=True)
    greedy = client.completions.create(model=NAME, prompt="once upon a time", max_tokens=1, temperature=0)
    first = tok.encode(greedy.choices[0].text)[0]
    banned = client.completions.create(
        model=NAME, prompt="once upon a time", max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != greedy.choices[0].text
    vocab = live.engine.engine.model.args.vocab_size
    for extra in (
        {"logit_bias": {str(vocab): 1}},
        {"logit_bias": {"x": 1}},
        {"logit_bias": {"1": 101}},
        {"best_of": 2},
        {"suffix": "the end"},
        {"response_format": {"type": "xml"}},
        {"structured_outputs": {"structural_tag": "x"}},
    ):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=NAME, prompt="hi", max_tokens=1, extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=NAME, messages=MSG, max_tokens=1, response_format={"type": "json_schema"}
        )
    huge = {str(i): 1 for i in range(50_000)}  # far past the entries allowed
    r = httpx.post(live.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": NAME, "prompt": "hi", "max_tokens": 1, "logit_bias": huge})  # fmt: skip
    assert r.status_code == 400 and "at most" in r.json()["error"]["message"]
    assert len(r.content) < 1000  # the answer names the rule without echoing the value


# --- SIGTERM: a drain, then an error event for what is still open ----------------------------------


def test_sigterm_drains_then_ends_open_streams_with_an_error(served_checkpoint):
    import signal

    server = start(served_checkpoint, grace_s=1.0)
    runner = server.engine.engine.runner
    real = runner.run

    def slow(*a, **k):  # 200 steps: far longer than the grace period
        time.sleep(0.05)
        return real(*a, **k)

    runner.run = slow
    try:
        body = {"prompt": "once", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=PATIENCE_S
        ) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            server.server.handle_exit(signal.SIGTERM, None)
            assert httpx.get(server.url + "/health").status_code == 503
            late = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=AUTH)
            assert late.status_code == 503
            events = sse(lines)
        assert events[-1] == "[DONE]"
        assert (
            events[-2]["error"]["code"] == "service_unavailable"
            and "shutting down" in events[-2]["error"]["message"]
        )
        server.thread.join(10)
        assert not server.thread.is_alive()
        wait_idle(server.engine)
    finally:
        runner.run = real
        server.stop()


def test_cache_salt_by_api_key(served_checkpoint):
    keys = ["sk-tenant-a", "sk-tenant-b"]
    model, tok = m3lm.load(served_checkpoint, device="cpu")
    engine = AsyncEngine(LLMEngine(model, tok, EngineConfig(max_model_len=256, max_num_seqs=4)), 16).start()
    server = LiveServer(create_server_app(engine, tok, NAME, keys, Limits(), cache_salt_by_api_key=True))
    server.engine = engine
    msgs = [{"role": "user", "content": "tenant A's confidential instructions, word for word " * 4}]
    try:

        def cached(key, salt=None):
            c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            extra = {"cache_salt": salt} if salt else {}
            reply = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=1, extra_body=extra)
            wait_idle(engine)
            return reply.usage.prompt_tokens_details.cached_tokens

        assert cached(keys[0]) == 0
        assert cached(keys[0]) > 0
        assert cached(keys[1]) == 0  # the other key's tenant gets nothing of A's pages
        assert cached(keys[1], salt="x") == 0  # nor by choosing a salt of its own
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-other", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    finally:
        server.stop()
