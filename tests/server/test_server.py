"""The OpenAI-compatible server over real HTTP, driven with the official `openai` client."""

import asyncio
import json

import httpx
import openai
import pytest

import m3lm
from m3lm.server.protocol import Limits
from tests.support.live_server import API_KEY, MSG, NAME, Script, start, wait_idle


def stream_chat(client, messages, max_tokens: int) -> list:
    """Every chunk of a greedy streamed chat completion, the usage chunk last."""
    return list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )


def test_chat_stream_concatenates_to_the_whole_reply(client, live):
    whole = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=12, temperature=0)
    text = whole.choices[0].message.content
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    chunks = stream_chat(client, MSG, 12)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


def test_completions_and_logprobs(client):
    r = client.completions.create(model=NAME, prompt="once upon", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(len(t) >= 1 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    streamed = client.completions.create(
        model=NAME, prompt="once upon", max_tokens=5, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_concurrent_requests_match_each_alone(client):
    prompts = [f"the fox {i} " * (i + 1) for i in range(8)]
    alone = [
        client.completions.create(model=NAME, prompt=p, max_tokens=10, temperature=0).choices[0].text
        for p in prompts
    ]

    async def together():
        ac = openai.AsyncOpenAI(base_url=str(client.base_url), api_key=API_KEY, max_retries=0)
        rs = await asyncio.gather(
            *(ac.completions.create(model=NAME, prompt=p, max_tokens=10, temperature=0) for p in prompts)
        )
        return [r.choices[0].text for r in rs]

    assert asyncio.run(together()) == alone


def test_n_and_seed(client):
    r = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=6, n=3, seed=5, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    again = client.chat.completions.create(
        model=NAME, messages=MSG, max_tokens=6, n=3, seed=5, temperature=1.0
    )
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]


@pytest.mark.parametrize(
    "body",
    [
        {"model": NAME, "messages": MSG, "temperature": -1},
        {"model": NAME, "messages": MSG, "n": 1000},
        {"model": NAME, "messages": []},
        {"model": NAME, "messages": MSG, "max_tokens": "many"},
        {"model": NAME, "messages": MSG, "top_logprobs": 99, "logprobs": True},
        {"model": NAME, "messages": MSG, "stop": ["x"] * 100},
        {"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]},
        {"model": NAME, "messages": MSG, "seed": -(2**63) - 1},
        {"model": NAME, "messages": MSG, "seed": 2**63},
        {"model": NAME, "messages": MSG, "top_k": 2**63},
    ],
)
def test_bad_requests_get_400_with_an_error_object(live, body):
    r = httpx.post(
        live.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_an_image_part_is_refused_by_what_it_is(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(
        openai.BadRequestError, match="image_url parts are not supported: this model reads text"
    ):
        client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, image]}],
            max_tokens=2,
        )


def test_raw_protocol_errors(live):
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    assert (
        httpx.post(live.url + "/v1/chat/completions", content=b"{not json", headers=auth).status_code == 400
    )
    assert (
        httpx.post(live.url + "/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=auth).status_code
        == 400
    )
    big = httpx.post(live.url + "/v1/completions", content=b"x" * (9 << 20), headers=auth)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert httpx.get(live.url + "/nope", headers=auth).json()["error"]["type"] == "not_found_error"
    r = httpx.post(live.url + "/v1/completions", json={"model": "other", "prompt": "x"}, headers=auth)
    assert r.status_code == 404
    long = httpx.post(
        live.url + "/v1/completions", json={"prompt": list(range(300)), "max_tokens": 1}, headers=auth
    )
    assert long.status_code == 400 and "context" in long.json()["error"]["message"]
    assert httpx.post(live.url + "/v1/completions", json={"prompt": ""}, headers=auth).status_code == 400


def test_api_key_on_every_route_but_health_and_tokenizer_info(live):
    assert httpx.get(live.url + "/health").status_code == 200
    assert httpx.get(live.url + "/tokenizer_info").json()["eos_token"]  # lm-eval reads it keyless
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", "/v1/completions"),
        ("POST", "/tokenize"),
    ]:
        r = httpx.request(method, live.url + path, json={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.request(method, live.url + path, json={}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    bad = openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_the_openapi_schema_is_served_and_no_docs_page(live):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert "/v1/chat/completions" in httpx.get(live.url + "/openapi.json", headers=auth).json()["paths"]
    for page in ("/docs", "/redoc"):
        assert httpx.get(live.url + page, headers=auth).status_code == 404


def test_models_tokenize_detokenize(client, live):
    assert [m.id for m in client.models.list().data] == [NAME]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    t = httpx.post(live.url + "/tokenize", json={"prompt": "once upon"}, headers=auth).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 256
    d = httpx.post(live.url + "/detokenize", json={"tokens": t["tokens"]}, headers=auth).json()
    assert d["prompt"] == "once upon"
    chat = httpx.post(live.url + "/tokenize", json={"messages": MSG}, headers=auth).json()
    assert chat["count"] > t["count"]
    # with tools: the prompt a chat request with those tools is given, token for token
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    counted = httpx.post(live.url + "/tokenize", json={"messages": MSG, "tools": tools}, headers=auth).json()
    used = client.chat.completions.create(model=NAME, messages=MSG, tools=tools, max_tokens=1).usage
    assert counted["count"] == used.prompt_tokens > chat["count"]


def metric(live, name: str) -> float:
    text = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_metrics_count_tokens(client, live):
    before_p, before_g = (
        metric(live, "m3lm:prompt_tokens_total"),
        metric(live, "m3lm:generation_tokens_total"),
    )
    r = client.completions.create(model=NAME, prompt="once upon a", max_tokens=7, temperature=0)
    wait_idle(live.engine)
    assert metric(live, "m3lm:generation_tokens_total") - before_g == 7
    assert metric(live, "m3lm:prompt_tokens_total") - before_p == r.usage.prompt_tokens
    assert metric(live, "m3lm:time_to_first_token_seconds_count") >= 1


def test_disconnect_mid_stream_frees_pages(live):
    wait_idle(live.engine)
    body = {
        "model": NAME,
        "prompt": "once upon a time",
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", live.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert live.engine.engine.blocks.num_used > 0
    wait_idle(live.engine)  # the aborted request's pages came back


def test_reasoning_and_tool_calls_over_http(served_checkpoint):
    server = start(served_checkpoint, api_key=None, max_model_len=2048)
    try:
        tok = server.engine.engine.tokenizer
        ns = tok.hf.convert_tokens_to_ids("]<]minimax[>[")
        think, unthink = (tok.hf.convert_tokens_to_ids(t) for t in ("<mm:think>", "</mm:think>"))
        open_, close_ = (tok.hf.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>"))
        enc = tok.encode
        eos = tok.hf.convert_tokens_to_ids("[e~[")
        xml = ['<invoke name="get_weather">', "<city>paris", "</city>", "<days>3", "</days>", "</invoke>"]
        calls = [ns, open_] + [t for piece in xml for t in (ns, *enc(piece))] + [ns, close_]
        reply = [think, *enc("let me see"), unthink, *enc("sure"), *calls, eos]
        server.engine.engine.sampler = Script(reply)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    },
                },
            }
        ]
        r = client.chat.completions.create(model=NAME, messages=MSG, tools=tools, max_tokens=500)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert msg.content == "sure" and msg.model_extra["reasoning_content"] == "let me see"
        call = msg.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
            "city": "paris",
            "days": 3,
        }
        assert call.id.startswith("call_")
        chunks = list(
            client.chat.completions.create(model=NAME, messages=MSG, tools=tools, max_tokens=500, stream=True)
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == "sure"
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "let me see"
        args = "".join(tc.function.arguments or "" for d in deltas for tc in d.tool_calls or [])
        assert json.loads(args) == {"city": "paris", "days": 3}
        assert all(not (d.content and d.tool_calls) for d in deltas)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # History with the call and its result goes back through the template.
        history = [
            *MSG,
            msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        assert client.chat.completions.create(model=NAME, messages=history, tools=tools, max_tokens=5).choices
    finally:
        server.stop()


def test_queue_full_gets_503_and_admitted_requests_complete(served_checkpoint):
    server = start(served_checkpoint, api_key=None, limits=Limits(max_queue=0), max_num_seqs=1)
    try:
        body = {"prompt": "once upon", "max_tokens": 60, "temperature": 0, "ignore_eos": True}

        async def flood():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(6)))

        rs = asyncio.run(flood())
        codes = sorted(r.status_code for r in rs)
        assert codes[0] == 200 and 503 in codes
        for r in rs:
            if r.status_code == 503:
                assert r.headers["retry-after"] and r.json()["error"]["type"] == "service_unavailable"
            else:
                assert r.json()["usage"]["completion_tokens"] == 60
    finally:
        server.stop()


def test_one_api_key_cannot_fill_the_queue_for_another(served_checkpoint, monkeypatch):
    """Two keys, room for 2 running and 4 waiting: a key holds at most 3 requests (a choice each)
    while the engine makes no progress; the other key is still admitted and served."""
    import contextlib
    import threading

    server = start(served_checkpoint, api_key=["key-a", "key-b"], limits=Limits(max_queue=4), max_num_seqs=2)
    gate, engine = threading.Event(), server.engine.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: step() if gate.wait(0.01) else [])
    body = {"prompt": "once upon", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}

    def post(key, **extra):
        return httpx.post(
            server.url + "/v1/completions",
            json={**body, "stream": False, **extra},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )

    try:
        with contextlib.ExitStack() as held:
            a = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer key-a"}, timeout=60)
            held.enter_context(a)
            for _ in range(3):
                r = held.enter_context(a.stream("POST", "/v1/completions", json=body))
                assert r.status_code == 200
            refused = post("key-a")
            assert refused.status_code == 429 and refused.headers["retry-after"], refused.text
            assert "at most 3" in refused.json()["error"]["message"]
            gate.set()
            served = post("key-b", n=2)
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 8
        wait_idle(server.engine)
        again = post("key-a", n=3)  # its share is free again, all of it
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 12
    finally:
        server.stop()


def test_the_default_model_is_served():
    server = start(m3lm.DEFAULT_MODEL, api_key=None, max_model_len=1024)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=300, temperature=0)
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop" and len(text.split()) > 20
        model, tok = server.engine.engine.model, server.engine.engine.tokenizer
        assert text == m3lm.generate(model, tok, "Once upon a time", max_tokens=300, temperature=0.0).text
    finally:
        server.stop()


def test_max_tokens_past_the_context_is_capped_on_every_api(served_checkpoint):
    """As Claude Code asks for 32,000 tokens whatever the context: each API generates to the end
    of the context (a prompt that does not fit alone is still refused)."""
    import anthropic

    server = start(served_checkpoint, api_key=None, max_model_len=128)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        text = client.completions.create(
            model=NAME, prompt="once upon", max_tokens=32000, temperature=0, extra_body={"ignore_eos": True}
        )
        assert text.choices[0].finish_reason == "length"
        assert text.usage.prompt_tokens + text.usage.completion_tokens == 128
        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        with claude.messages.stream(  # the SDK streams a request that long, as Claude Code does
            model=NAME,
            max_tokens=32000,
            messages=[{"role": "user", "content": "Hi"}],
            # greedy: how a sampled reply of the random model ends depends on its draws
            extra_body={"ignore_eos": True, "temperature": 0},
        ) as stream:
            messages = stream.get_final_message()
        assert messages.stop_reason == "max_tokens"
        assert messages.usage.input_tokens + messages.usage.output_tokens == 128
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=NAME, prompt=[5] * 200, max_tokens=1)
    finally:
        server.stop()


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(served_checkpoint):
    server = start(served_checkpoint, api_key=None, max_model_len=128)
    try:
        r = httpx.post(
            server.url + "/v1/chat/completions", json={"messages": MSG, "ignore_eos": True, "temperature": 0}
        )
        body = r.json()
        assert r.status_code == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 128
    finally:
        server.stop()


def test_a_repeated_prompt_is_served_from_the_prefix_cache(client, live):
    page = live.engine.engine.blocks.page_size
    msgs = [{"role": "user", "content": "the fox and the old mill by the river " * 6}]
    first = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=3, temperature=0)
    wait_idle(live.engine)
    hits = metric(live, "m3lm:prefix_cache_hits_total")
    second = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=3, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert (
        cached
        == (second.usage.prompt_tokens - 1) // page * page
        > first.usage.prompt_tokens_details.cached_tokens
    )
    assert second.choices[0].message.content == first.choices[0].message.content
    chunks = stream_chat(client, msgs, 3)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    wait_idle(live.engine)
    assert metric(live, "m3lm:prefix_cache_hits_total") - hits == 2 * cached


def test_the_choices_of_one_request_compute_its_prompt_once(client, live):
    """n = 3 on a prompt no request has sent: the first choice computes it (past the chat
    template's head, which earlier requests left cached), the other two wait for its pages and
    find them all cached (the hits metric); greedy, so all three agree."""
    page = live.engine.engine.blocks.page_size
    msgs = [{"role": "user", "content": "a lantern, a map and a boat on the quiet lake " * 6}]
    wait_idle(live.engine)
    hits = metric(live, "m3lm:prefix_cache_hits_total")
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=3, n=3, temperature=0)
    assert len({c.message.content for c in r.choices}) == 1
    whole = (r.usage.prompt_tokens - 1) // page * page  # all the pages a prompt can find cached
    first = r.usage.prompt_tokens_details.cached_tokens  # the fewest any choice found: the first's
    assert first < whole
    wait_idle(live.engine)
    assert metric(live, "m3lm:prefix_cache_hits_total") - hits == first + 2 * whole
