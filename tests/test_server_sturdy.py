"""The server keeps its promises under clients that stop early, wait, hang up, dawdle or send junk.

Every test runs against a real server over real HTTP with the served settings (keep-alive
interval, timeouts, connection caps), through the official `openai` client where it applies.
"""

import json
import socket
import time

import httpx
import openai
import pytest
from checkpoints import Spec, hf_model, release_config, to_release, write_checkpoint, write_m3_tokenizer
from test_server import API_KEY, MSG, NAME, start, wait_idle

from m3lm.server.protocol import Limits

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("sturdy")
    s = Spec(vocab=write_m3_tokenizer(path))
    write_checkpoint(path, to_release(hf_model(s, seed=3).state_dict(), s), release_config(s))
    return path


@pytest.fixture(scope="module")
def live(checkpoint):
    server = start(checkpoint)
    yield server
    server.stop()


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=20)


def sse(lines) -> list[dict | str]:
    """The events of an SSE body: parsed `data:` objects, "[DONE]", and comment lines as they are."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        elif line.startswith(":"):
            out.append(line)
    return out


def stalled_engine(live, seconds: float):
    """Make the engine's next model step take `seconds` longer (a long prefill, a busy GPU)."""
    runner = live.engine.engine.runner
    real = runner.run
    calls = []

    def slow(*a, **k):
        if not calls:
            calls.append(1)
            time.sleep(seconds)
        return real(*a, **k)

    runner.run = slow
    return lambda: setattr(runner, "run", real)


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
        model=NAME, messages=MSG, max_tokens=40, temperature=0, stop=[stop], timeout=8
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == text[: text.index(stop)]
    assert reply.usage.completion_tokens < 40
    wait_idle(live.engine, timeout=2)


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
        with httpx.stream("POST", live.url + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
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

    def slow(*a, **k):  # 250 steps: over 12 s for the request, if nothing aborts it
        time.sleep(0.05)
        return real(*a, **k)

    runner.run = slow
    try:
        body = {"prompt": "once", "max_tokens": 250, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", json=body, headers=AUTH, timeout=0.5)
        wait_idle(live.engine, timeout=3)  # freed within a few steps of the hang-up
    finally:
        runner.run = real


def test_an_idle_connection_and_half_sent_headers_are_closed(live):
    timeout = Limits().header_timeout_s
    idle, half = (
        socket.create_connection(("127.0.0.1", live.port)),
        socket.create_connection(("127.0.0.1", live.port)),
    )
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    for s in (idle, half):
        s.settimeout(timeout + 5)
        assert s.recv(1024) == b""  # closed by the server
    assert timeout - 0.5 < time.monotonic() - t0 < timeout + 5
    assert httpx.get(live.url + "/health").status_code == 200


# --- 4. a large prompt is refused before it is tokenized, and blocks no one -------------------------


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(live, monkeypatch):
    tok = live.engine.engine.tokenizer
    encoded = []
    monkeypatch.setattr(tok, "encode", lambda *a, **k: encoded.append(1) or [])
    huge = "once upon a time " * (7 << 16)  # 7 MiB
    for path, body in [
        ("/v1/completions", {"prompt": huge, "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 4}),
        ("/tokenize", {"prompt": huge}),
        ("/tokenize", {"messages": [{"role": "user", "content": huge}]}),
    ]:
        r = httpx.post(live.url + path, json=body, headers=AUTH, timeout=20)
        assert r.status_code == 400 and "cannot fit" in r.json()["error"]["message"], (path, r.text[:200])
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
