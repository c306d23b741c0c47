"""The Anthropic Messages API over real HTTP with the official `anthropic` client, on the embedded
story model: replies agree with chat completions on the same conversation, streamed events come
in Anthropic's order, thinking blocks go back with the signature this server issued, tool calls
go round trip, count_tokens counts the prompt the template makes, errors in Anthropic's shape."""

import json

import anthropic
import httpx
import openai
import pytest

from m3lm.server.anthropic import MessagesRequest, ThinkingSigner, chat_request
from m3lm.server.protocol import Limits
from tests.support.live_server import API_KEY, stalled_engine, wait_idle
from tests.support.story_server import NAME, failing_after, scripted, tool_call_ids

STORY = [{"role": "user", "content": "Tell me a story about a dog."}]
GREEDY = {"extra_body": {"temperature": 0}}  # the newest SDK has no sampling arguments of its own
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
}

STORY_CONTEXT = 512


@pytest.fixture
def client(story_live):
    return anthropic.Anthropic(base_url=story_live.url, api_key=API_KEY, max_retries=0)


@pytest.fixture
def chat(story_live):
    return openai.OpenAI(base_url=story_live.url + "/v1", api_key=API_KEY, max_retries=0)


def as_openai_tool(tool: dict) -> dict:
    fn = {"name": tool["name"], "description": tool["description"], "parameters": tool["input_schema"]}
    return {"type": "function", "function": fn}


def blocks(content: list) -> list[tuple]:
    """Each block's type, payload and signature (the SDK's whole and streamed classes differ)."""
    return [
        (b.type, getattr(b, b.type, None) or getattr(b, "input", None), getattr(b, "signature", None))
        for b in content
    ]


def check_order(events: list) -> None:
    """message_start, then blocks opened, filled and closed one at a time with rising indices (a
    thinking block's signature last), then message_delta and message_stop."""
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    open_block, last_index, last_delta = None, -1, None
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert open_block is None and e.index == last_index + 1
            open_block, last_index = e.content_block, e.index
        elif e.type == "content_block_delta":
            assert open_block is not None and e.index == last_index
            last_delta = e.delta
        else:
            assert e.type == "content_block_stop" and e.index == last_index
            if open_block.type == "thinking":
                assert last_delta.type == "signature_delta"
            open_block = None
    assert open_block is None


@pytest.mark.parametrize("mode", ["disabled", "enabled"])
def test_create_agrees_with_chat_completions_streamed_and_not(client, chat, mode):
    thinking = {"type": "enabled", "budget_tokens": 6} if mode == "enabled" else {"type": mode}
    m = client.messages.create(model=NAME, max_tokens=16, messages=STORY, thinking=thinking, **GREEDY)
    budget = {"thinking_token_budget": 6} if mode == "enabled" else {}  # the same rule, enforced
    ref = chat.chat.completions.create(
        model=NAME,
        messages=STORY,
        max_tokens=16,
        temperature=0,
        extra_body={"chat_template_kwargs": {"thinking_mode": mode}, **budget},
    )
    msg = ref.choices[0].message
    reasoning = msg.model_extra.get("reasoning_content")
    expected = ([("thinking", reasoning)] if reasoning else []) + (
        [("text", msg.content)] if msg.content else []
    )
    assert expected and [(b.type, getattr(b, b.type)) for b in m.content] == expected
    assert (mode == "enabled") == (m.content[0].type == "thinking")
    if mode == "enabled":  # six thinking tokens, then the answer
        assert [b.type for b in m.content] == ["thinking", "text"]
    reason = {"length": "max_tokens", "stop": "end_turn"}[ref.choices[0].finish_reason]
    assert m.stop_reason == reason and m.stop_sequence is None
    assert m.usage.output_tokens == ref.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    assert m.id.startswith("msg_") and m.model == NAME and m.role == "assistant"

    events = list(
        client.messages.create(
            model=NAME, max_tokens=16, messages=STORY, thinking=thinking, stream=True, **GREEDY
        )
    )
    check_order(events)
    start, end = events[0].message.usage, events[-2].usage  # message_start, message_delta
    assert start.input_tokens + start.cache_read_input_tokens == ref.usage.prompt_tokens
    assert (start.input_tokens, start.cache_read_input_tokens) == (
        end.input_tokens,
        end.cache_read_input_tokens,
    )
    assert start.cache_read_input_tokens > 0  # the same prompt again: its pages were cached
    with client.messages.stream(model=NAME, max_tokens=16, messages=STORY, thinking=thinking, **GREEDY) as s:
        final = s.get_final_message()
    assert blocks(final.content) == blocks(m.content)  # the same text signs the same
    assert (final.stop_reason, final.usage.output_tokens) == (reason, ref.usage.completion_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == ref.usage.prompt_tokens


def test_a_thinking_budget_must_be_under_max_tokens(client):
    with pytest.raises(
        anthropic.BadRequestError, match="`max_tokens` must be greater than `thinking.budget_tokens`"
    ):
        client.messages.create(
            model=NAME, max_tokens=16, messages=STORY, thinking={"type": "enabled", "budget_tokens": 16}
        )


def test_thinking_blocks_go_back_with_their_signature(client):
    thinking = {"type": "enabled", "budget_tokens": 3}
    first = client.messages.create(model=NAME, max_tokens=12, messages=STORY, thinking=thinking, **GREEDY)
    block = first.content[0]
    assert block.type == "thinking" and block.thinking and block.signature

    def next_turn(content):
        history = [
            *STORY,
            {"role": "assistant", "content": content},
            {"role": "user", "content": "And then?"},
        ]
        return client.messages.create(model=NAME, max_tokens=4, messages=history, thinking=thinking, **GREEDY)

    assert next_turn(first.content).usage.output_tokens == 4
    with client.messages.stream(model=NAME, max_tokens=12, messages=STORY, thinking=thinking, **GREEDY) as s:
        streamed = s.get_final_message().content
    assert next_turn(streamed).stop_reason == "max_tokens"
    sent = block.model_dump(exclude_none=True)
    for bad in (
        {**sent, "thinking": sent["thinking"] + "!"},
        {**sent, "signature": ("A" if sent["signature"][0] != "A" else "B") + sent["signature"][1:]},
        {**sent, "signature": ""},
    ):
        with pytest.raises(anthropic.BadRequestError) as e:
            next_turn([bad])
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert "signature" in e.value.body["error"]["message"]
    # redacted thinking is accepted and carries nothing to render
    assert next_turn([{"type": "redacted_thinking", "data": "opaque"}]).usage.output_tokens == 4


def test_tool_use_and_tool_result_round_trip(client, story_live):
    tok = story_live.tok
    reply = [
        *tok.encode("Let me look."),
        *tool_call_ids(tok, "get_weather", [("city", "paris"), ("days", "3")]),
    ]
    reply.append(tok.hf.eos_token_id)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    kw = {"model": NAME, "max_tokens": 200, "tools": [WEATHER], "thinking": {"type": "disabled"}}
    with scripted(story_live, reply):
        m = client.messages.create(messages=question, **kw)
        events = list(client.messages.create(messages=question, stream=True, **kw))
        with client.messages.stream(messages=question, **kw) as s:
            streamed = s.get_final_message()
    assert m.stop_reason == "tool_use"
    text, use = m.content
    assert (text.type, text.text) == ("text", "Let me look.")
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "paris", "days": 3})
    assert use.id.startswith("toolu_")
    check_order(events)
    args = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(args) == {"city": "paris", "days": 3}
    assert events[-2].delta.stop_reason == "tool_use"
    assert [b.type for b in streamed.content] == ["text", "tool_use"] and streamed.content[
        1
    ].input == use.input

    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}
    history = [*question, {"role": "assistant", "content": m.content}, result]
    after = client.messages.create(messages=history, **{**kw, "max_tokens": 4}, **GREEDY)
    assert after.stop_reason == "max_tokens" and after.content[0].type == "text"
    # the prompt is the template's rendering of the same conversation in OpenAI's form
    call = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "paris", "days": 3}},
    }
    expected = tok.apply_chat_template(
        [
            *question,
            {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
            {"role": "tool", "content": "sunny"},
        ],
        tools=[as_openai_tool(WEATHER)],
        thinking_mode="disabled",
    )
    counted = client.messages.count_tokens(
        model=NAME, messages=history, tools=[WEATHER], thinking={"type": "disabled"}
    )
    assert counted.input_tokens == len(expected)
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens == len(expected)


def test_tool_choice(client, story_live):
    tok = story_live.tok
    two = tool_call_ids(tok, "get_weather", [("city", "paris")])[:-2]  # open block, one invoke
    ns = tok.hf.convert_tokens_to_ids("]<]minimax[>[")
    two += [
        t
        for p in ('<invoke name="get_weather">', "<city>rome", "</city>", "</invoke>")
        for t in (ns, *tok.encode(p))
    ]
    two += [ns, tok.hf.convert_tokens_to_ids("</tool_call>"), tok.hf.eos_token_id]
    question = [{"role": "user", "content": "Weather?"}]
    kw = {"model": NAME, "max_tokens": 200, "tools": [WEATHER], "messages": question}
    with scripted(story_live, two):
        both = client.messages.create(**kw)
        one = client.messages.create(tool_choice={"type": "auto", "disable_parallel_tool_use": True}, **kw)
        none = client.messages.create(tool_choice={"type": "none"}, **kw)
    cities = [[b.input["city"] for b in r.content if b.type == "tool_use"] for r in (both, one)]
    assert cities == [["paris", "rome"], ["paris"]]
    # "tool" and "any" are enforced by constrained decoding: the model itself writes the calls
    # (arguments it must close: the story model would write a free string to the context's end)
    cities = {"type": "object", "properties": {"city": {"enum": ["paris", "rome"]}}, "required": ["city"]}
    forced = {**kw, "tools": [{**WEATHER, "input_schema": cities}], "max_tokens": 400}
    # one call each (no parallel calls): a sampled model may otherwise write calls to max_tokens
    one_call = {"disable_parallel_tool_use": True}
    for choice in ({"type": "tool", "name": "get_weather", **one_call}, {"type": "any", **one_call}):
        reply = client.messages.create(tool_choice=choice, thinking={"type": "disabled"}, **forced)
        calls = [b for b in reply.content if b.type == "tool_use"]
        assert reply.stop_reason == "tool_use" and calls, reply
        assert all(c.name == "get_weather" and c.input["city"] in ("paris", "rome") for c in calls)
    assert none.stop_reason == "end_turn" and all(b.type == "text" for b in none.content)
    # "none" lists no tools in the prompt
    without = client.messages.count_tokens(model=NAME, messages=question).input_tokens
    assert (
        client.messages.count_tokens(
            model=NAME, messages=question, tools=[WEATHER], tool_choice={"type": "none"}
        ).input_tokens
        == without
    )
    assert client.messages.count_tokens(model=NAME, messages=question, tools=[WEATHER]).input_tokens > without
    with pytest.raises(anthropic.BadRequestError, match="nope"):
        client.messages.create(tool_choice={"type": "tool", "name": "nope"}, **kw)


def test_stop_sequences(client):
    kw = {"model": NAME, "max_tokens": 24, "messages": STORY, "thinking": {"type": "disabled"}, **GREEDY}
    whole = client.messages.create(**kw).content[0].text
    stop = whole[6:10]
    assert len(stop) == 4 and whole.index(stop) == 6
    cut = client.messages.create(stop_sequences=[stop], **kw)
    assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == ("stop_sequence", stop, whole[:6])
    with client.messages.stream(stop_sequences=[stop], **kw) as s:
        streamed = s.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert streamed.content[0].text == whole[:6]


def test_count_tokens_is_the_templates_prompt(client, story_live):
    system = [
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be kind."},
    ]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "context", "content": "A note."},  # a role clients add for context: read as user
    ]
    counted = client.messages.count_tokens(model=NAME, system=system, messages=messages).input_tokens
    expected = story_live.tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief.\nBe kind."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "A note."},
        ]
    )
    assert counted == len(expected)
    m = client.messages.create(
        model=NAME, system=system, messages=messages, max_tokens=2, metadata={"user_id": "u1"}
    )
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted


def test_errors_are_anthropics_and_both_key_headers_work(client, story_live):
    bearer = anthropic.Anthropic(base_url=story_live.url, auth_token=API_KEY, api_key=None, max_retries=0)
    assert bearer.messages.create(model=NAME, max_tokens=1, messages=STORY).usage.output_tokens == 1
    wrong = anthropic.Anthropic(base_url=story_live.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=NAME, max_tokens=1, messages=STORY)
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid or missing API key"},
    }
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-x", max_tokens=1, messages=STORY)
    assert e.value.body["error"]["type"] == "not_found_error"
    headers = {"x-api-key": API_KEY}
    for body, words in (
        ({"model": NAME, "messages": STORY}, "max_tokens"),
        (
            {"model": NAME, "max_tokens": 1, "messages": [*STORY, {"role": "assistant", "content": "Once"}]},
            "prefill",
        ),
        (
            {
                "model": NAME,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "image",
        ),
        (
            {
                "model": NAME,
                "max_tokens": 1,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]}
                        ],
                    }
                ],
            },
            "document",
        ),
        (
            {
                "model": NAME,
                "max_tokens": 1,
                "messages": STORY,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "web_search",
        ),
        (  # (a max_tokens past the context is capped, as on every API)
            {
                "model": NAME,
                "max_tokens": 8,
                "messages": STORY,
                "thinking": {"type": "enabled", "budget_tokens": 8},
            },
            "budget_tokens",
        ),
    ):
        r = httpx.post(story_live.url + "/v1/messages", json=body, headers=headers)
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert words in err["error"]["message"]
    r = httpx.post(
        story_live.url + "/v1/messages", content=b"{", headers={**headers, "content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["type"] == "error"
    # the OpenAI routes keep OpenAI's error object, and take x-api-key too
    r = httpx.post(
        story_live.url + "/v1/chat/completions", json={"messages": STORY}, headers={"x-api-key": "wrong"}
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(
        story_live.url + "/v1/chat/completions", json={"messages": STORY, "max_tokens": 1}, headers=headers
    )
    assert r.status_code == 200


def test_a_failure_mid_stream_is_an_error_event(client, story_live):
    kw = {"model": NAME, "max_tokens": 20, "messages": STORY, "extra_body": {"ignore_eos": True}}
    with failing_after(story_live, 3):
        events = []
        with pytest.raises(anthropic.APIStatusError) as e:
            for event in client.messages.create(stream=True, **kw):
                events.append(event.type)
        with pytest.raises(anthropic.InternalServerError) as whole:
            client.messages.create(**kw)
    assert events[0] == "message_start" and "message_stop" not in events
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"
    assert "decoder exploded" in e.value.body["error"]["message"]
    assert whole.value.body["error"]["type"] == "api_error"
    wait_idle(story_live.engine)


def test_a_waiting_stream_gets_pings_then_its_events(client, story_live):
    wait_idle(story_live.engine)
    restore = stalled_engine(story_live, Limits().keepalive_s + 1.5)
    body = {"model": NAME, "max_tokens": 3, "messages": STORY, "stream": True}
    try:
        with httpx.stream(
            "POST", story_live.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60
        ) as r:
            names = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    finally:
        restore()
    assert names[0] == "message_start" and names[1] == "ping"
    assert "content_block_delta" in names and names[-2:] == ["message_delta", "message_stop"]


def test_a_stream_left_early_frees_its_request(client, story_live):
    with client.messages.stream(
        model=NAME, max_tokens=400, messages=STORY, extra_body={"ignore_eos": True}
    ) as s:
        for event in s:
            if event.type == "content_block_delta":
                break
    wait_idle(story_live.engine)


def test_chat_request_mapping():
    """The translation itself, on what the story template does not render (reasoning, errors)."""
    signer = ThinkingSigner()
    req = MessagesRequest.model_validate(
        {
            "max_tokens": 5,
            "system": "S",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": signer.sign("hmm")},
                        {"type": "text", "text": "ok"},
                        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "bad"}],
                            "is_error": True,
                        },
                        {"type": "text", "text": "go on"},
                    ],
                },
            ],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "thinking": {"type": "adaptive"},
            "stop_sequences": ["\n\n"],
            "top_k": 5,
            "output_config": {
                "effort": "low",
                "format": {"type": "json_schema", "schema": {"type": "object"}},
            },
        }
    )
    chat = chat_request(req, signer)
    assert [m.for_template() for m in chat.messages] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "ok",
            "reasoning_content": "hmm",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: bad"},
        {"role": "user", "content": "go on"},
    ]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.chat_template_kwargs == {"thinking_mode": "adaptive"}
    assert (chat.stop, chat.top_k, chat.max_tokens) == (["\n\n"], 5, 5)
    schema = {"name": "output", "schema": {"type": "object"}, "strict": True}
    assert chat.response_format == {"type": "json_schema", "json_schema": schema}
    assert not ThinkingSigner().verify("hmm", signer.sign("hmm"))  # another server's secret
