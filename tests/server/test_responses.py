"""The Responses API over real HTTP with the official `openai` client and the OpenAI Agents SDK,
on the embedded story model: replies agree with chat completions on the same conversation,
streamed events come in the order the SDK parses with one id per item, function calls go round
trip (the history as the template renders it), stored responses continue and are listed by id,
and the fields coding clients send are accepted or refused by name.

The story model never calls tools by itself, so the tool round trips script the sampler (the
server's parsing, translation and the clients' loops stay real); an agent run on the model's own
words checks that the Agents SDK's loop ends with the model's answer."""

import asyncio

import httpx
import openai
import pytest
from openai.types.shared import Reasoning

from m3lm.server.protocol import Limits
from m3lm.server.response_store import ResponseStore
from m3lm.server.responses_request import chat_messages
from tests.support.live_server import API_KEY, stalled_engine, wait_idle
from tests.support.story_server import NAME, failing_after, scripted, tool_call_ids

agents = pytest.importorskip("agents")
from agents.models.openai_provider import OpenAIProvider  # noqa: E402

STORY = "Tell me a story about a dog."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
}

STORY_CONTEXT = 1024


@pytest.fixture
def client(story_live):
    return openai.OpenAI(base_url=story_live.url + "/v1", api_key=API_KEY, max_retries=0)


def as_chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")}}


def check_stream(events: list) -> dict:
    """The lifecycle and per-item order of a streamed response; its final response as a dict.
    Every event is numbered in order; every item keeps its id from `added` to the final output."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}" and final.status in ("completed", "incomplete")
    assert events[0].response.id == final.id and events[0].response.output == []
    items: dict[int, dict] = {}
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert e.output_index == len(items) and all(i["done"] for i in items.values())
            items[e.output_index] = {"id": e.item.id, "type": e.item.type, "text": "", "done": False}
            continue
        item = items[e.output_index]
        assert not item["done"] and getattr(e, "item_id", item["id"]) == item["id"]
        if e.type in (
            "response.output_text.delta",
            "response.reasoning_text.delta",
            "response.function_call_arguments.delta",
        ):
            item["text"] += e.delta
        elif e.type in ("response.output_text.done", "response.reasoning_text.done"):
            assert e.text == item["text"]
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == item["text"]
        elif e.type == "response.output_item.done":
            assert e.item.id == item["id"] and final.output[e.output_index].id == item["id"]
            item["done"] = True
    assert len(final.output) == len(items) and all(i["done"] for i in items.values())
    return final.model_dump()


@pytest.mark.parametrize(("effort", "mode"), [("none", "disabled"), ("high", "enabled")])
def test_create_agrees_with_chat_completions_streamed_and_not(client, effort, mode):
    kw = {
        "model": NAME,
        "input": STORY,
        "max_output_tokens": 16,
        "temperature": 0,
        "reasoning": {"effort": effort},
    }
    r = client.responses.create(**kw)
    ref = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": STORY}],
        max_tokens=16,
        temperature=0,
        extra_body={"chat_template_kwargs": {"thinking_mode": mode}},
    )
    msg, finish = ref.choices[0].message, ref.choices[0].finish_reason
    reasoning = msg.model_extra.get("reasoning_content")
    expected = ([("reasoning", reasoning)] if reasoning else []) + (
        [("message", msg.content)] if msg.content else []
    )
    assert expected and [(o.type, o.content[0].text) for o in r.output] == expected
    assert (mode == "enabled") == (r.output[0].type == "reasoning")
    assert r.output_text == (msg.content or "")
    assert r.status == ("incomplete" if finish == "length" else "completed")
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    assert r.usage.output_tokens == ref.usage.completion_tokens
    thought = r.usage.output_tokens_details.reasoning_tokens
    if mode == "disabled":
        assert thought == 0
    else:  # all of the reply, or up to its closing marker
        assert thought == r.usage.output_tokens if not msg.content else 0 < thought < r.usage.output_tokens
    assert r.id.startswith("resp_") and r.model == NAME and r.reasoning.effort == effort

    final = check_stream(list(client.responses.create(stream=True, **kw)))
    assert [(o["type"], o["content"][0]["text"]) for o in final["output"]] == expected
    assert final["status"] == r.status and final["usage"]["output_tokens"] == r.usage.output_tokens
    if r.status == "completed":  # the SDK's stream helper returns only a completed response
        with client.responses.stream(**kw) as s:
            assert s.get_final_response().output_text == r.output_text


def test_function_call_round_trip(client, story_live):
    tok = story_live.tok
    reply = [
        *tok.encode("Let me look."),
        *tool_call_ids(tok, "get_weather", [("city", "paris"), ("days", "3")]),
    ]
    reply.append(tok.hf.eos_token_id)
    kw = {"model": NAME, "tools": [WEATHER], "max_output_tokens": 200, "reasoning": {"effort": "none"}}
    question = [{"role": "user", "content": "Weather in Paris?"}]
    with scripted(story_live, reply):
        r = client.responses.create(input=question, **kw)
        events = list(client.responses.create(input=question, stream=True, **kw))
    assert r.status == "completed" and [o.type for o in r.output] == ["message", "function_call"]
    call = r.output[1]
    assert (call.name, call.arguments, call.status) == (
        "get_weather",
        '{"city": "paris", "days": 3}',
        "completed",
    )
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and r.output_text == "Let me look."
    final = check_stream(events)
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["arguments"] == call.arguments
    assert "response.function_call_arguments.done" in [e.type for e in events]

    # the call's output goes back: whole history, or after the stored response
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    history = [*question, *(o.model_dump(exclude_none=True) for o in r.output), result]
    whole = client.responses.create(input=history, **{**kw, "max_output_tokens": 4}, temperature=0)
    after = client.responses.create(
        input=[result], previous_response_id=r.id, **{**kw, "max_output_tokens": 4}, temperature=0
    )
    fn = {"name": "get_weather", "arguments": {"city": "paris", "days": 3}}
    expected = tok.apply_chat_template(
        [
            *question,
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [{"type": "function", "function": fn}],
            },
            {"role": "tool", "content": "sunny"},
        ],
        tools=[as_chat_tool(WEATHER)],
        thinking_mode="disabled",
    )
    assert whole.usage.input_tokens == after.usage.input_tokens == len(expected)
    assert whole.output_text == after.output_text


def test_stored_responses_continue_and_are_listed_by_id(client, story_live):
    kw = {"model": NAME, "max_output_tokens": 6, "temperature": 0, "reasoning": {"effort": "none"}}
    first = client.responses.create(input="Hello dog.", instructions="Be kind.", **kw)
    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    second = client.responses.create(input="And then?", previous_response_id=first.id, **kw)
    assert second.previous_response_id == first.id
    # the instructions stay with their response; the conversation carries on
    expected = story_live.tok.apply_chat_template(
        [
            {"role": "user", "content": "Hello dog."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
        thinking_mode="disabled",
    )
    assert second.usage.input_tokens == len(expected)
    unstored = client.responses.create(input="Hi", store=False, **kw)
    for rid in (unstored.id, "resp_nothing"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            client.responses.create(input="x", previous_response_id=rid, **kw)


def test_a_failure_mid_stream_fails_the_response(client, story_live):
    kw = {"model": NAME, "input": STORY, "max_output_tokens": 20, "extra_body": {"ignore_eos": True}}
    with failing_after(story_live, 3):
        events = list(client.responses.create(stream=True, **kw))
        with pytest.raises(openai.InternalServerError, match="decoder exploded"):
            client.responses.create(**kw)
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert final.type == "response.failed" and final.response.status == "failed"
    assert final.response.id == events[0].response.id
    assert final.response.error.code == "server_error" and "decoder exploded" in final.response.error.message


def test_a_waiting_stream_gets_comments_then_its_events(story_live):
    wait_idle(story_live.engine)
    restore = stalled_engine(story_live, Limits().keepalive_s + 1.5)
    body = {"model": NAME, "input": STORY, "max_output_tokens": 3, "stream": True}
    try:
        with httpx.stream(
            "POST", story_live.url + "/v1/responses", json=body, headers={"x-api-key": API_KEY}, timeout=60
        ) as r:
            lines = [line for line in r.iter_lines() if line.startswith((":", "event: "))]
    finally:
        restore()
    assert lines[:2] == ["event: response.created", "event: response.in_progress"]
    assert lines[2] == ": keep-alive" and "event: response.output_text.delta" in lines
    assert lines[-1] in ("event: response.completed", "event: response.incomplete")


def test_the_store_is_bounded_and_per_key():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put("key-a", {"id": f"r{i}"}, [])
    assert store.get("key-a", "r0") is None and store.get("key-a", "r1") is not None
    store.put("key-a", {"id": "r3"}, [])  # r1 was used last: r2 goes
    assert store.get("key-a", "r2") is None and store.get("key-a", "r1") is not None
    assert store.get("key-b", "r1") is None


def test_one_tenant_storing_more_evicts_its_own_responses():
    """A key that stores more than the others loses its own when the store is full, by count or
    by bytes; a response larger than the whole store is not kept."""
    store = ResponseStore(capacity=4, max_bytes=10_000)
    store.put("quiet", {"id": "q0"}, [])
    for i in range(50):
        store.put("flood", {"id": f"f{i}"}, [])
    assert store.get("quiet", "q0") is not None and store.get("flood", "f49") is not None
    assert store.get("flood", "f46") is None  # its own oldest went
    store.put("flood", {"id": "big1", "text": "x" * 6_000}, [])
    store.put("flood", {"id": "big2", "text": "x" * 6_000}, [])  # over the bytes: flood's others go
    assert store.get("quiet", "q0") is not None and store.get("flood", "big2") is not None
    assert store.get("flood", "big1") is None and store.get("flood", "f49") is None
    store.put("quiet", {"id": "huge", "text": "x" * 20_000}, [])
    assert store.get("quiet", "huge") is None and store.get("quiet", "q0") is not None


def test_metadata_within_openais_limits(client):
    ok = {f"k{i}": "v" * 512 for i in range(16)}
    assert client.responses.create(model=NAME, input="Hi", max_output_tokens=1, metadata=ok).metadata == ok
    for bad, why in [
        ({f"k{i}": "v" for i in range(17)}, "17 pairs, at most 16"),
        ({"k" * 65: "v"}, "a key of 65 characters, at most 64"),
        ({"k": "v" * 513}, "513 characters, at most 512"),
    ]:
        with pytest.raises(openai.BadRequestError, match=why):
            client.responses.create(model=NAME, input="Hi", max_output_tokens=1, metadata=bad)


def test_fields_coding_clients_send(client, story_live):
    r = client.responses.create(
        model=NAME,
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ],
        max_output_tokens=2,
        include=["reasoning.encrypted_content"],
        store=False,
        prompt_cache_key="conversation-1",
        metadata={"ticket": "7"},
        truncation="disabled",
        user="u1",
        service_tier="auto",
        parallel_tool_calls=False,
        tools=[WEATHER],
        tool_choice="auto",
        text={"format": {"type": "text"}, "verbosity": "low"},
        extra_body={"client_metadata": {"session": "s"}},
    )
    assert r.metadata == {"ticket": "7"} and r.usage.output_tokens == 2 and r.parallel_tool_calls is False
    refused = {
        "truncation": ("auto", "truncation"),
        "background": (True, "background"),
        "include": (["message.output_text.logprobs"], "include"),
        "tools": ([{"type": "hologram"}], "hologram"),  # web_search and the like are left out instead
        "input": ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input_image"),
        "tool_choice": ({"type": "function", "name": "nope"}, "nope"),
    }
    for field, (value, words) in refused.items():
        body = {"model": NAME, "input": "Hi", "max_output_tokens": 2, "tools": [WEATHER], field: value}
        with pytest.raises(openai.BadRequestError, match=words):
            client.responses.create(**body)
    r = httpx.post(story_live.url + "/v1/responses", json={"input": "Hi"}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_chat_messages_from_items():
    """Items that follow one another make one assistant turn; reasoning starts the next."""
    items = [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "more"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
    ]
    calls = [
        {"id": c, "type": "function", "function": {"name": n, "arguments": "{}"}}
        for c, n in (("c1", "f"), ("c2", "g"))
    ]
    assert chat_messages(items) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "think", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "assistant", "content": "b", "reasoning_content": "more"},
    ]


def weather_tool(calls: list):
    # not strict: a strict tool is enforced by constrained decoding, and these tests script the
    # sampler's tokens (the enforced path has its own tests in test_structured_output.py)
    @agents.function_tool(strict_mode=False)
    def get_weather(city: str, days: int) -> str:
        """The weather in a city."""
        calls.append((city, days))
        return "sunny"

    return get_weather


def as_request_tool(tool) -> dict:
    """The function tool as the Agents SDK sends it."""
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.params_json_schema,
        "strict": tool.strict_json_schema,
    }


def agent_run(story_live, tool, stream: bool = False):
    """Run an agent with one function tool on the Agents SDK's default (Responses) model pointed
    at the server: its final output and the kinds of its new items."""

    async def run():
        client = openai.AsyncOpenAI(base_url=story_live.url + "/v1", api_key=API_KEY, max_retries=0)
        config = agents.RunConfig(
            model_provider=OpenAIProvider(openai_client=client, use_responses=True), tracing_disabled=True
        )
        settings = agents.ModelSettings(max_tokens=200, temperature=0, reasoning=Reasoning(effort="none"))
        agent = agents.Agent(
            name="w", instructions="Be brief.", tools=[tool], model=NAME, model_settings=settings
        )
        if not stream:
            return await agents.Runner.run(agent, "Weather in Paris?", run_config=config)
        result = agents.Runner.run_streamed(agent, "Weather in Paris?", run_config=config)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    return result.final_output, [type(i).__name__ for i in result.new_items]


def test_an_agent_runs_to_the_models_answer(story_live, client):
    """No script: the story model answers in words, and the agent's loop ends with them."""
    calls = []
    tool = weather_tool(calls)
    final, kinds = agent_run(story_live, tool)
    direct = client.responses.create(
        model=NAME,
        instructions="Be brief.",
        input="Weather in Paris?",
        tools=[as_request_tool(tool)],
        max_output_tokens=200,
        temperature=0,
        reasoning={"effort": "none"},
    )
    assert direct.status == "completed" and direct.output_text and final == direct.output_text
    assert kinds == ["MessageOutputItem"] and calls == []


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_calls_its_tool_and_answers(story_live, stream):
    """The sampler writes a call while no tool result is in the prompt, then an answer; the
    Agents SDK runs the tool, sends the call and its output back and ends with the answer."""
    tok = story_live.tok
    eos = tok.hf.eos_token_id
    call = [*tool_call_ids(tok, "get_weather", [("city", "paris"), ("days", "3")]), eos]
    answer = [*tok.encode("It is sunny."), eos]
    prompts: list[list[int]] = []

    def reply(prompt: list[int]) -> list[int]:
        if not prompts or prompts[-1] != prompt:
            prompts.append(list(prompt))
        return answer if "<response>" in tok.decode(prompt) else call

    calls = []
    tool = weather_tool(calls)
    with scripted(story_live, reply):
        final, kinds = agent_run(story_live, tool, stream=stream)
    assert final == "It is sunny." and calls == [("paris", 3)]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    # each request's prompt is the template's rendering of the exchange so far
    fn = {"name": "get_weather", "arguments": {"city": "paris", "days": 3}}
    question = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    exchange = [
        *question,
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": fn}]},
        {"role": "tool", "content": "sunny"},
    ]
    sent = as_request_tool(tool)
    tools = [
        {
            "type": "function",
            "function": {k: sent[k] for k in ("name", "description", "parameters", "strict")},
        }
    ]
    render = [tok.apply_chat_template(m, tools=tools, thinking_mode="disabled") for m in (question, exchange)]
    assert prompts == render


def test_codex_namespace_tools_go_round_trip_and_hosted_tools_are_left_out(story_live):
    """As Codex sends them: an MCP server's functions in a `namespace` tool beside a hosted
    `web_search`. The model sees `mcp__weather__get_weather` (and no web search); its call comes
    back as `get_weather` in namespace `mcp__weather`, and sent back so it is the same call."""
    tok = story_live.tok
    eos = tok.hf.eos_token_id
    call = [*tool_call_ids(tok, "mcp__weather__get_weather", [("city", "paris")]), eos]
    answer = [*tok.encode("It is sunny."), eos]
    prompts: list[str] = []

    def reply(prompt: list[int]) -> list[int]:
        prompts.append(tok.decode(prompt))
        return answer if "<response>" in prompts[-1] else call

    fn = {k: v for k, v in WEATHER.items() if k != "type"}
    tools = [
        {
            "type": "namespace",
            "name": "mcp__weather",
            "description": "Weather tools",
            "tools": [{"type": "function", **fn}],
        },
        {"type": "web_search", "external_web_access": False},
    ]
    base = {
        "model": NAME,
        "tools": tools,
        "reasoning": {"effort": "none"},
        "max_output_tokens": 64,
        "store": False,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = story_live.url + "/v1/responses"
    with scripted(story_live, reply):
        first = httpx.post(url, json={**base, "input": "Weather in Paris?"}, headers=headers, timeout=60)
        assert first.status_code == 200, first.text
        (item,) = first.json()["output"]
        assert (item["type"], item["namespace"], item["name"]) == (
            "function_call",
            "mcp__weather",
            "get_weather",
        )
        assert item["arguments"] == '{"city": "paris"}'
        sent_back = [
            {"type": "message", "role": "user", "content": "Weather in Paris?"},
            {k: item[k] for k in ("type", "call_id", "namespace", "name", "arguments")},
            {"type": "function_call_output", "call_id": item["call_id"], "output": "sunny"},
        ]
        second = httpx.post(url, json={**base, "input": sent_back}, headers=headers, timeout=60)
        assert second.status_code == 200, second.text
    assert second.json()["output"][0]["content"][0]["text"] == "It is sunny."
    assert "mcp__weather__get_weather" in prompts[0] and "web_search" not in prompts[0]
    history = next(p for p in prompts if "<response>" in p)  # the second request's
    assert history.count('<invoke name="mcp__weather__get_weather">') == 1  # the call, sent back
