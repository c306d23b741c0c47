"""Structured output over real HTTP: `m3lm serve` on the embedded story model, the official clients.

The story model has never seen JSON, XML or a tool call, so every valid reply here is the
constraint's doing. Sampling is at temperature 1 with a seed per request (replies reproducible).
Each request's max_tokens is an upper bound on what its grammar can produce (`json_bound`,
`xml_bound`: every token is at least one byte), so a reply cut by max_tokens (reported as
finish_reason "length") would be a fault of the grammar, and the tests check none is.
"""

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.processes import Serve

NAME = "story"
WORDS = ["name", "age", "color", "pet", "size", "tags", "owner", "ok", "score", "place", "mood", "items"]
EOS_AND_CLOSE = 2  # the grammar's stop token, and a spare


@pytest.fixture(scope="module")
def server():
    serve = Serve("--max-model-len", "2048", "--max-num-seqs", "32", "--served-model-name", NAME)
    try:
        serve.wait_healthy()
        yield serve.url
    finally:
        serve.kill()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=600)


# -- schemas and their bounds ---------------------------------------------------------------------


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema: nesting, bounded arrays, enums, numbers, booleans, required and optional
    fields, no extra properties. Every string and number is bounded, so the JSON is."""
    names = rng.sample(WORDS, rng.randint(1, 4 if depth == 0 else 3))
    props = {name: random_value(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "enum", "integer", "number", "boolean", "nullable"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "blue", "green", 3, 4.5, True, None, "a b"], rng.randint(1, 4))}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": rng.choice([1, 10, 100])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "nullable":
        return {"type": ["boolean", "null"]}
    if kind == "object":
        return random_schema(rng, depth + 1)
    items = rng.choice(
        [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x", "y"]}, {"type": "boolean"}]
    )
    if depth == 0 and rng.random() < 0.3:
        items = random_schema(rng, depth + 1)
    low = rng.randint(0, 1)
    return {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.randint(0, 2)}


def json_bound(s: dict) -> int:
    """Most bytes any JSON text the grammar allows for `s` can take (one line, ", " and ": ")."""
    if "enum" in s:
        return max(len(json.dumps(v).encode()) for v in s["enum"])
    t = s.get("type")
    if t == "object":
        pairs = [len(json.dumps(k)) + 2 + json_bound(v) for k, v in s["properties"].items()]
        return 2 + sum(pairs) + 2 * len(pairs)
    if t == "array":
        return 2 + s["maxItems"] * (json_bound(s["items"]) + 2)
    if t == "string":
        return 2 + 4 * s["maxLength"]  # bounded strings take no escapes; a character is <= 4 bytes
    if t == "integer":
        return max(len(str(s["minimum"])), len(str(s["maximum"])))
    if t == "number":
        return max(len(str(s["minimum"])), len(str(s["maximum"]))) + 7  # a point and <= 6 decimals
    return 5  # true, false, null


def xml_bound(s: dict, name: str = "") -> int:
    """The same for M3's XML arguments: a namespace token, the tags, the value, a space each side."""
    wrap = (2 + 2 * len(name) + 5 + 2) if name else 0
    if "enum" in s:
        return wrap + max(len((v if isinstance(v, str) else json.dumps(v)).encode()) for v in s["enum"])
    t = s.get("type")
    if t == "object":
        return wrap + 2 + sum(xml_bound(v, k) for k, v in s["properties"].items())
    if t == "array":
        return wrap + 2 + s["maxItems"] * xml_bound(s["items"], "item")
    if t == "integer":
        return wrap + max(len(str(s["minimum"])), len(str(s["maximum"])))
    return wrap + 5


def thinking_variants():
    """(stream, thinking): thinking "on" reasons under a budget (the story model never closes its
    reasoning on its own) before the answer; "off" starts with the answer."""
    return [(stream, think) for stream in (False, True) for think in (False, True)]


def chat_extra(think: bool) -> dict:
    if think:
        return {"chat_template_kwargs": {"thinking_mode": "enabled"}, "thinking_token_budget": 4}
    return {"chat_template_kwargs": {"thinking_mode": "disabled"}}


def collect(client, stream: bool, **kwargs):
    """(content, reasoning, tool_calls as [(name, arguments)], finish_reason), streamed or whole."""
    if not stream:
        r = client.chat.completions.create(**kwargs)
        m, c = r.choices[0].message, r.choices[0]
        calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
        return m.content or "", m.model_extra.get("reasoning_content") or "", calls, c.finish_reason
    content, reasoning, calls, finish = [], [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            d = c.delta
            content.append(d.content or "")
            reasoning.append(d.model_extra.get("reasoning_content") or "")
            for t in d.tool_calls or []:
                name, args = calls.get(t.index, ("", ""))
                calls[t.index] = (name + (t.function.name or ""), args + (t.function.arguments or ""))
            finish = c.finish_reason or finish
    return "".join(content), "".join(reasoning), [calls[i] for i in sorted(calls)], finish


MSG = [{"role": "user", "content": "Tell me about the cat."}]


def run_all(jobs):
    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(lambda job: job(), jobs))


# -- JSON -----------------------------------------------------------------------------------------


def test_one_hundred_json_schemas_streamed_and_not_thinking_on_and_off(client):
    rng = random.Random(51)
    schemas = [random_schema(rng) for _ in range(100)]
    jobs = []
    for i, schema in enumerate(schemas):
        for stream, think in thinking_variants():
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
            bound = json_bound(schema) + EOS_AND_CLOSE + (5 if think else 0)

            def job(schema=schema, stream=stream, think=think, fmt=fmt, bound=bound, seed=i):
                kw = dict(model=NAME, messages=MSG, temperature=1, seed=seed, max_tokens=bound)
                out = collect(client, stream, response_format=fmt, extra_body=chat_extra(think), **kw)
                return schema, think, out

            jobs.append(job)
    for schema, think, (content, reasoning, calls, finish) in run_all(jobs):
        assert finish == "stop" and not calls, (schema, content, finish)
        jsonschema.validate(json.loads(content), schema)
        assert bool(reasoning) == think


def test_json_object_streamed_and_not_thinking_on_and_off(client):
    """Any JSON object. The story model writes a story inside any string it opens, so the test
    raises the closing quote's and brace's logits (as a client may, with logit_bias) for the
    objects to end within the bound; what makes every reply an object is the grammar."""
    bias = {"1": 5, "92": 15}  # '"' and '}' in the story tokenizer
    jobs = []
    for seed in range(25):
        for stream, think in thinking_variants():

            def job(stream=stream, think=think, seed=seed):
                kw = dict(model=NAME, messages=MSG, temperature=1, seed=seed, max_tokens=600, logit_bias=bias)
                return collect(
                    client,
                    stream,
                    response_format={"type": "json_object"},
                    extra_body=chat_extra(think),
                    **kw,
                )

            jobs.append(job)
    for content, _, _, finish in run_all(jobs):
        assert finish == "stop", content
        assert isinstance(json.loads(content), dict)


def test_openai_parse_with_a_pydantic_model(client):
    class Pet(BaseModel):
        kind: Literal["cat", "dog", "fish"]
        legs: int = Field(ge=0, le=8)

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=120)
        happy: bool
        pets: list[Pet] = Field(max_length=2)

    for seed in range(4):
        r = client.chat.completions.parse(
            model=NAME,
            messages=MSG,
            response_format=Person,
            temperature=1,
            seed=seed,
            max_tokens=400,
            extra_body=chat_extra(False),  # adaptive: this model may open a reasoning it never closes
        )
        assert r.choices[0].finish_reason == "stop"
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and len(person.pets) <= 2


def test_vllm_structured_outputs_on_completions(client):
    cases = [
        ({"regex": "[a-c]{3}-[0-9]{2}"}, lambda t: len(t) == 6 and t[3] == "-" and t[4:].isdigit()),
        ({"choice": ["yes", "no way"]}, lambda t: t in ("yes", "no way")),
        (
            {"grammar": 'root ::= "x" [0-9]+ "y"'},
            lambda t: t[0] == "x" and t[-1] == "y" and t[1:-1].isdigit(),
        ),
        (
            {"json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
            lambda t: len(json.loads(t)) <= 3,
        ),
        ({"json_object": True}, None),
    ]
    for so, ok in cases:
        for seed in range(3):
            extra = {"structured_outputs": so}
            if ok is None:
                extra["logit_bias"] = {"1": 5, "92": 15}
            r = client.completions.create(
                model=NAME, prompt="Once", max_tokens=300, temperature=1, seed=seed, extra_body=extra
            )
            text, finish = r.choices[0].text, r.choices[0].finish_reason
            if so.get("grammar"):
                assert finish in ("stop", "length")  # [0-9]+ is unbounded
                if finish == "length":
                    continue
            assert finish == "stop", (so, text)
            assert ok(text) if ok else isinstance(json.loads(text), dict)


def test_n_choices_each_follow_the_schema(client):
    schema = random_schema(random.Random(7))
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = client.chat.completions.create(
        model=NAME,
        messages=MSG,
        n=4,
        temperature=1,
        seed=3,
        max_tokens=json_bound(schema) + 2,
        response_format=fmt,
        extra_body=chat_extra(False),
    )
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)


def test_repetitions_whose_cost_explodes_are_refused_at_once(client, server):
    """Counted repetitions past the bound, in a schema's pattern, a regex or a grammar, nested or
    not: a 400 that names them, before anything is built; a plain request beside them is served,
    and the same schema again is refused the same way. (A tool's string patterns are left to the
    client: they cost the grammar nothing.)"""
    import httpx

    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z]{100000}"}}}
    nested = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(([a-z]{64}){64}){2}"}}}
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            "{100000}",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": nested}}},
            "8192 times",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(ab|c){0,5000}"}}}, "{0,5000}"),
        ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "a"{300}'}}}, "{300}"),
    ]
    for extra, why in cases * 2:
        with pytest.raises(openai.BadRequestError, match="past") as e:
            client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **extra
            )
        assert why in str(e.value) and "bound" in str(e.value)
    r = client.completions.create(model=NAME, prompt="Once", max_tokens=2)
    assert r.choices[0].text
    body = {"model": NAME, "prompt": "Once", "max_tokens": 2, "structured_outputs": {"regex": "a{257}"}}
    refused = httpx.post(server + "/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400 and "{257}" in refused.json()["error"]["message"]


def test_what_cannot_be_enforced_is_a_400_that_says_why(client):
    bad = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "pattern": "(("}},
                        },
                    },
                }
            },
            "parenthesis",
        ),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "not supported"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "additionalProperties": {"type": "string"}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "fixed object property names",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
                    }
                ],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "cannot be combined",
        ),
        ({"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "admits no token"),  # after its compile
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "integer"}},
                            "required": ["b"],
                        },
                    },
                }
            },
            "required names 'b', which is not among its properties",
        ),
    ]
    for body, words in bad:
        with pytest.raises(openai.BadRequestError, match=words):
            client.chat.completions.create(model=NAME, messages=MSG, max_tokens=5, extra_body=body)
    assert client.chat.completions.create(model=NAME, messages=MSG, max_tokens=2).choices  # still serving


# -- tool calls -----------------------------------------------------------------------------------


def tool_schema(rng: random.Random) -> dict:
    """Arguments M3's XML can carry with bounds the story model meets: enums, bounded integers,
    booleans, nested objects, bounded arrays (a free string ends only on the namespace token, which
    this model never favours, so strings are enums here)."""
    names = rng.sample(WORDS, rng.randint(1, 3))
    props = {}
    for n in names:
        kind = rng.choice(["enum", "integer", "boolean", "object", "array"])
        if kind == "enum":
            props[n] = {"type": "string", "enum": rng.sample(["red", "blue", "big cat", "x"], 2)}
        elif kind == "integer":
            props[n] = {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 999])}
        elif kind == "boolean":
            props[n] = {"type": "boolean"}
        elif kind == "object":
            props[n] = {
                "type": "object",
                "properties": {
                    "ok": {"type": "boolean"},
                    "n": {"type": "integer", "minimum": 1, "maximum": 5},
                },
                "required": ["ok"],
                "additionalProperties": False,
            }
        else:
            props[n] = {"type": "array", "items": {"enum": ["a", "b", 1]}, "maxItems": 2}
    return {"type": "object", "properties": props, "required": names[:1], "additionalProperties": False}


def tools_for(rng: random.Random, strict: bool | None = None) -> list[dict]:
    out = []
    for i in range(2):
        fn = {"name": f"tool_{i}", "description": "a tool", "parameters": tool_schema(rng)}
        if strict is not None:
            fn["strict"] = strict
        out.append({"type": "function", "function": fn})
    return out


def block_bound(tools: list[dict]) -> int:
    calls = max(xml_bound(t["function"]["parameters"]) + 40 + len(t["function"]["name"]) for t in tools)
    return calls + 8


def check_calls(tools, calls, only=None):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for name, args in calls:
        assert name in schemas and (only is None or name == only)
        jsonschema.validate(json.loads(args), schemas[name])


def test_required_and_named_tool_choice_always_call_in_m3_format(client):
    """No parallel calls: with them the story model, which never writes the block's closer on its
    own, would list calls until the bound."""
    rng = random.Random(3)
    jobs = []
    for k in range(4):
        tools = tools_for(rng, strict=None if k % 2 else False)
        for choice in ("required", {"type": "function", "function": {"name": "tool_1"}}):
            for stream, think in thinking_variants():

                def job(tools=tools, choice=choice, stream=stream, think=think, seed=k):
                    kw = dict(
                        model=NAME, messages=MSG, temperature=1, seed=seed, tools=tools, tool_choice=choice
                    )
                    kw["max_tokens"] = block_bound(tools) + (5 if think else 0)
                    return (
                        tools,
                        choice,
                        collect(
                            client, stream, parallel_tool_calls=False, extra_body=chat_extra(think), **kw
                        ),
                    )

                jobs.append(job)
    for tools, choice, (content, _, calls, finish) in run_all(jobs):
        assert finish == "tool_calls" and content == "", (content, calls, finish)
        assert len(calls) == 1
        check_calls(tools, calls, None if choice == "required" else "tool_1")


@pytest.mark.parametrize("mode", ["enabled", "adaptive"])
def test_forced_output_arrives_after_reasoning_without_a_budget(client, mode):
    """The story model never closes its reasoning by itself: with no budget of the request's, a
    grammar's reasoning still ends at a quarter of max_tokens, and the forced call or choice follows."""
    rng = random.Random(5)
    tools = tools_for(rng, strict=None)
    extra = {"chat_template_kwargs": {"thinking_mode": mode}}
    limit = 2 * block_bound(tools)
    for seed in range(3):
        content, reasoning, calls, finish = collect(
            client, False, model=NAME, messages=MSG, temperature=1, seed=seed, tools=tools,
            tool_choice="required", parallel_tool_calls=False, max_tokens=limit, extra_body=extra,
        )  # fmt: skip
        assert finish == "tool_calls" and len(calls) == 1, (reasoning, content, calls, finish)
        check_calls(tools, calls, None)
        r = client.chat.completions.create(
            model=NAME, messages=MSG, temperature=1, seed=seed, max_tokens=16,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}, **extra},
        )  # fmt: skip
        assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"


def test_a_reasoning_budget_past_max_tokens_still_leaves_the_forced_call_room(client):
    """An effort's budget (low: 512 tokens) that would take every token of `max_tokens`: the
    grammar's default budget applies instead, and the forced call follows."""
    tools = tools_for(random.Random(5), strict=None)
    limit = 2 * block_bound(tools)
    assert limit <= 512
    for seed in range(2):
        content, reasoning, calls, finish = collect(
            client, False, model=NAME, messages=MSG, temperature=1, seed=seed, tools=tools,
            tool_choice="required", parallel_tool_calls=False, max_tokens=limit, reasoning_effort="low",
        )  # fmt: skip
        assert finish == "tool_calls" and len(calls) == 1, (reasoning, content, calls, finish)
        check_calls(tools, calls, None)


def test_parallel_calls_and_strict_tools_under_auto(client):
    """Parallel calls under "required", and strict tools under "auto" (the reply may be text; the
    test raises the namespace token's logit so the model opens a block, and the block closer's so
    the list of calls ends): every call is in M3's format and its arguments validate."""
    tools = tools_for(random.Random(11), strict=True)
    ns, close = "4089", "4091"  # ]<]minimax[>[ and </tool_call> in the story tokenizer
    jobs = []
    for choice, bias in (("required", {close: 12}), ("auto", {ns: 30, close: 12})):
        for seed in range(2):
            for stream in (False, True):

                def job(choice=choice, bias=bias, seed=seed, stream=stream):
                    kw = dict(
                        model=NAME, messages=MSG, temperature=1, seed=seed, tools=tools, tool_choice=choice
                    )
                    kw.update(
                        max_tokens=4 * block_bound(tools), logit_bias=bias, extra_body=chat_extra(False)
                    )
                    return collect(client, stream, **kw)

                jobs.append(job)
    for content, _, calls, finish in run_all(jobs):
        assert finish == "tool_calls", (content, calls, finish)
        check_calls(tools, calls)


def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    class Weather(BaseModel):
        """The weather in a city."""

        city: Literal["paris", "rome", "oslo"]
        degrees: int = Field(ge=-30, le=45)
        sunny: bool
        summary: str = Field(min_length=1, max_length=12)  # a bounded string, in both methods

    llm = ChatOpenAI(
        base_url=server + "/v1",
        api_key="none",
        model=NAME,
        temperature=1,
        max_tokens=400,
        max_retries=0,
        seed=5,
        extra_body=chat_extra(False),  # adaptive: this model may open a reasoning it never closes
    )
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Weather, method=method).invoke("What is the weather?")
        assert isinstance(out, Weather), (method, out)


def test_tool_parameters_with_string_limits_are_enforced_not_refused(client):
    """LangChain's max_length fields, MCP servers' patterns and formats: the forced call keeps
    every limit (a 400 before, then left to the client)."""
    note = {"type": "string", "maxLength": 8, "minLength": 1, "format": "hostname"}
    code = {"type": "string", "pattern": "^[a-z]{2,4}$"}
    host = {"type": "string", "enum": ["a.org", "b.org"], "maxLength": 8, "pattern": "^[a-z.]+$"}
    schema = {
        "type": "object",
        "properties": {"host": host, "note": note, "code": code},
        "required": ["host", "note"],
    }
    tool = {"type": "function", "function": {"name": "lookup", "parameters": schema}}
    for seed in range(3):
        r = client.chat.completions.create(
            model=NAME, messages=MSG, tools=[tool], tool_choice="required", max_tokens=200, temperature=1,
            seed=seed, parallel_tool_calls=False,
            extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}},
        )  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "lookup"
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_compile_past_the_engines_budget_is_a_400_over_http(story_live, monkeypatch):
    """The engine's grammar compile (two threads, here both held) has a budget: the request
    past it gets a 400 that says so, and the server goes on serving."""
    import threading

    from m3lm.engine import constraints
    from m3lm.engine import engine as engine_mod
    from tests.support.live_server import API_KEY

    gate = threading.Event()
    real = constraints.Grammars._compile

    def held(self, spec):
        assert gate.wait(60)
        return real(self, spec)

    monkeypatch.setattr(constraints.Grammars, "_compile", held)
    monkeypatch.setattr(engine_mod, "GRAMMAR_COMPILE_BUDGET_S", 0.0)
    story = openai.OpenAI(base_url=story_live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    try:
        with pytest.raises(openai.BadRequestError, match="took longer than 0 s to compile"):
            story.completions.create(
                model="story",
                prompt="Once",
                max_tokens=2,
                extra_body={"structured_outputs": {"regex": "q+z"}},
            )
    finally:
        gate.set()
    assert story.completions.create(model="story", prompt="Once", max_tokens=2).usage.completion_tokens == 2
