"""Reply parsers: reasoning split, tool calls (M3 and M2), tool_choice, history rendering.

Token streams come from a small fake tokenizer that, like a real one, turns every marker string
in the text into its single special token, and splits other text into 1-character or random
chunks; `Lit` text is never split into markers (the model or a user wrote it with plain tokens).
"""

import json
import logging
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m3lm.text.reasoning import (
    ReasoningMarkers,
    ReasoningParser,
    ReasoningText,
    ReplyFormat,
    ReplyParser,
    ThinkingMode,
    detect_thinking_mode,
    parse_reply,
    split_reasoning,
    to_openai_delta,
)
from m3lm.text.schema_values import (
    ToolChoicePlan,
    finish_reason,
    missing_required_call,
    parse_json_bounded,
    plan_tool_choice,
    template_messages,
    type_value,
)
from m3lm.text.tool_calls import (
    ContentDelta,
    ToolCallArguments,
    ToolCallHeader,
    ToolCallParser,
    parse_tool_calls,
)
from tests.support.paths import FIXTURES

NS = "]<]minimax[>["
M3_MARKERS = {
    m: 501 + i for i, m in enumerate(["]~b]", "<mm:think>", "</mm:think>", NS, "<tool_call>", "</tool_call>"])
}
M2_MARKERS = {
    m: 601 + i
    for i, m in enumerate(["]~b]", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"])
}
ENABLED, DISABLED, ADAPTIVE = ThinkingMode.ENABLED, ThinkingMode.DISABLED, ThinkingMode.ADAPTIVE


class Lit(str):
    """Text written with ordinary tokens: never turned into a marker token."""


class FakeTokenizer:
    def __init__(self, markers: dict[str, int]) -> None:
        self.vocab, self.inverse = dict(markers), {v: k for k, v in markers.items()}

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token)

    def convert_ids_to_tokens(self, tid):
        return self.inverse.get(tid)

    def tokens(self, *parts, rng=None, marker_text=False):
        """(id, text) pairs for `parts`; rng: random text chunks and random marker text."""
        out = []
        for part in parts:
            pieces = [part] if isinstance(part, Lit) else _split_markers(part, self.vocab)
            for piece in pieces:
                if piece in self.vocab and not isinstance(piece, Lit):
                    shown = marker_text or (rng is not None and rng.random() < 0.5)
                    out.append((self.vocab[piece], piece if shown else ""))
                    continue
                i = 0
                while i < len(piece):
                    n = rng.randint(1, 6) if rng else 1
                    out.append((1, piece[i : i + n]))
                    i += n
        return out


def _split_markers(text, vocab):
    pieces, i, start = [], 0, 0
    while i < len(text):
        hit = next((m for m in sorted(vocab, key=len, reverse=True) if text.startswith(m, i)), None)
        if hit:
            pieces += [Lit(text[start:i]), hit] if i > start else [hit]
            i = start = i + len(hit)
        else:
            i += 1
    return [*pieces, Lit(text[start:])] if start < len(text) else pieces


M3 = FakeTokenizer(M3_MARKERS)
M2 = FakeTokenizer(M2_MARKERS)
M3_FMT, M2_FMT = ReplyFormat.from_tokenizer(M3), ReplyFormat.from_tokenizer(M2)


def fn(tool_name, /, **props):
    return {
        "type": "function",
        "function": {"name": tool_name, "parameters": {"type": "object", "properties": props}},
    }


def tool_call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def stream(tokens, fmt=M3_FMT, mode=ADAPTIVE, tools=None, plan=None, **opts):
    """Feed token by token; return (reasoning, content, [(name, args_json)], events)."""
    parser = ReplyParser(fmt, mode, tools, plan, **opts)
    events = [e for tok in tokens for e in parser.feed(*tok)] + parser.finish()
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, ToolCallHeader):
            assert e.index not in calls and e.index == len(calls) and e.id.startswith("call_")
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ToolCallArguments):
            calls[e.index][1] += e.fragment
        else:
            assert e.text
    text = ["".join(e.text for e in events if isinstance(e, kind)) for kind in (ReasoningText, ContentDelta)]
    return text[0], text[1], [tuple(c) for c in calls.values()], events


def parse(*parts, fmt=M3_FMT, tok=M3, mode=ADAPTIVE, tools=None, plan=None, **opts):
    """One-shot parse, checked against streaming; returns (reasoning, content, [(name, args)])."""
    tokens = tok.tokens(*parts)
    one = parse_reply(tokens, fmt, mode, tools, plan, **opts)
    calls = [(c.name, c.arguments) for c in one.tool_calls]
    assert stream(tokens, fmt, mode, tools, plan, **opts)[:3] == (one.reasoning, one.content, calls)
    return one.reasoning, one.content, [(name, json.loads(args)) for name, args in calls]


EXAMPLE = (
    f"text before the calls\n{NS}<tool_call>\n"
    f'{NS}<invoke name="book_room">{NS}<nights>3{NS}</nights>{NS}<guest>{NS}<name>Ada Lovelace{NS}</name>'
    f"{NS}</guest>{NS}<tags>{NS}<item>quiet{NS}</item>{NS}<item>high floor{NS}</item>{NS}</tags>{NS}</invoke>\n"
    f'{NS}<invoke name="notify">{NS}<channel>sms{NS}</channel>{NS}</invoke>\n{NS}</tool_call>'
)
TOOLS = [fn("book_room", nights={"type": "integer"}), fn("notify", channel={"type": "string"})]
BOOK = ("book_room", {"nights": 3, "guest": {"name": "Ada Lovelace"}, "tags": ["quiet", "high floor"]})
NOTIFY = ("notify", {"channel": "sms"})


def test_serving_example():
    assert parse(EXAMPLE, tools=TOOLS) == ("", "text before the calls", [BOOK, NOTIFY])
    reply = parse_reply(M3.tokens(EXAMPLE), M3_FMT, ADAPTIVE, TOOLS)
    message = reply.message()
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["book_room", "notify"]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in message["tool_calls"])
    assert len({c["id"] for c in message["tool_calls"]}) == 2


def test_opener_ns_missing_and_text_form_opener():
    no_ns = EXAMPLE.replace(f"{NS}<tool_call>", "<tool_call>")
    assert parse(no_ns, tools=TOOLS)[2] == [BOOK, NOTIFY]
    # Without a single `<tool_call>` token the text form opens the block, NS or not.
    tok = FakeTokenizer({k: v for k, v in M3_MARKERS.items() if "tool_call" not in k})
    fmt = ReplyFormat.from_tokenizer(tok)
    assert fmt.tools.open_id is None
    for text in (EXAMPLE, no_ns):
        assert parse(text, fmt=fmt, tok=tok, tools=TOOLS) == ("", "text before the calls", [BOOK, NOTIFY])


def invoke(name, body):
    return f'{NS}<tool_call>{NS}<invoke name="{name}">{body}{NS}</invoke>{NS}</tool_call>'


def el(name, inner):
    return f"{NS}<{name}>{inner}{NS}</{name}>"


def test_nested_objects_and_arrays():
    schema = {
        "type": "object",
        "properties": {
            "rows": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            "people": {
                "type": "array",
                "items": {"type": "object", "properties": {"age": {"type": "integer"}}},
            },
            "empty_list": {"type": "array"},
            "empty_obj": {"type": "object"},
            "box": {"type": "object", "properties": {"item": {"type": "boolean"}}},
        },
    }
    rows = el("rows", el("item", el("item", "1") + el("item", "2")) + el("item", ""))
    people = el("people", el("item", el("name", "Ada") + "\n" + el("age", "36")))
    body = "\n".join(
        [rows, people, el("empty_list", ""), el("empty_obj", "\n"), el("box", el("item", "true"))]
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    expected = {
        "rows": [[1, 2], []],
        "people": [{"name": "Ada", "age": 36}],
        "empty_list": [],
        "empty_obj": {},
        "box": {"item": True},
    }
    assert parse(invoke("f", body), tools=tools)[2] == [("f", expected)]
    # Without a schema: structure from the markup, leaves stay strings.
    assert parse(invoke("g", rows), tools=tools)[2] == [("g", {"rows": [["1", "2"], ""]})]


def test_values_are_typed_through_local_refs():
    """Pydantic's nested models come as `$defs` and `$ref`s (LangChain's function calling): the
    values below a ref are typed by what it names, in `anyOf` branches and array items too."""
    person = {"type": "object", "properties": {"age": {"type": "integer"}, "tags": {"type": "array"}}}
    schema = {
        "type": "object",
        "properties": {
            "owner": {"$ref": "#/$defs/Person"},
            "backup": {"anyOf": [{"$ref": "#/$defs/Person"}, {"type": "null"}]},
            "team": {"type": "array", "items": {"$ref": "#/definitions/Alias"}},
        },
        "$defs": {"Person": person},
        "definitions": {"Alias": {"$ref": "#/$defs/Person"}},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    body = el("owner", el("age", "36") + el("tags", "")) + el("backup", "null")
    body += el("team", el("item", el("age", "7")))
    expected = {"owner": {"age": 36, "tags": []}, "backup": None, "team": [{"age": 7}]}
    assert parse(invoke("f", body), tools=tools)[2] == [("f", expected)]


INT, N, B = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


@pytest.mark.parametrize(
    ("schema", "text", "expected"),
    [
        (INT, "3", 3),
        (INT, " 42\n", 42),
        (INT, "3.0", 3),
        (INT, "1e3", 1000),
        (INT, "3.5", "3.5"),
        (INT, "1e999", "1e999"),
        (INT, "nan", "nan"),
        (INT, "0x10", "0x10"),
        (INT, "٣", "٣"),
        (INT, "9" * 500, int("9" * 500)),
        (INT, "9" * 5000, "9" * 5000),
        (N, "2.5", 2.5),
        (N, "-0.5e-3", -0.0005),
        (N, "7", 7),
        (N, "1e999", "1e999"),
        (N, "-1e999", "-1e999"),
        (N, "nan", "nan"),
        (N, "Infinity", "Infinity"),
        (N, "1_000", "1_000"),
        (B, "true", True),
        (B, "False", False),
        (B, "yes", "yes"),
        ({"type": ["string", "null"]}, "null", None),
        ({"type": "string", "nullable": True}, "null", None),
        ({"anyOf": [INT, {"type": "null"}]}, "null", None),
        ({"anyOf": [INT, {"type": "null"}]}, "12", 12),
        ({"type": "string"}, "null", "null"),
        (INT, "null", "null"),
        ({"type": "string"}, " 3 \n", " 3 \n"),
        (None, "3", "3"),
        ({}, "true", "true"),
        ({"type": "object"}, '{"a": [1, "x", null]}', {"a": [1, "x", None]}),
        ({"type": "array"}, "[1, 2.5, true]", [1, 2.5, True]),
        ({"type": "object"}, "[1]", "[1]"),
        ({"type": "object"}, '{"a": 1e999}', '{"a": 1e999}'),
        ({"type": "object"}, '{"a": NaN}', '{"a": NaN}'),
        ({"type": "object"}, '{"a": __import__("os")}', '{"a": __import__("os")}'),
        ({"type": "array"}, "[" * 100 + "]" * 100, "[" * 100 + "]" * 100),
        ({"type": "array"}, "[1,]", "[1,]"),
        ({"type": "object"}, '{"s": "\\ud83d\\ude00 \\ud800"}', {"s": "😀 \ufffd"}),
        ({"enum": [1, "two", None]}, "1", 1),
        ({"enum": [1, "two", None]}, "null", None),
        ({"enum": [1, "two", None]}, "two", "two"),
        ({"enum": ["1", 1]}, "1", "1"),  # the first member written so
        ({"anyOf": [{"const": True}, {"type": "string"}]}, "true", True),
        ({"enum": [" a "]}, " a ", " a "),
        ({"enum": [2.5]}, " 2.5 ", 2.5),
        ({"enum": ["x"]}, "y", "y"),
    ],
)
def test_typed_leaves(schema, text, expected):
    value = type_value(text, schema)
    assert value == expected and type(value) is type(expected)
    tools = [fn("f", p=schema)] if schema is not None else [fn("f")]
    assert parse(invoke("f", el("p", text)), tools=tools)[2] == [("f", {"p": expected})]


def test_bounded_json():
    assert parse_json_bounded(' {"a": {"b": [1, -2.5e3, "x\\n"]}} ') == (
        True,
        {"a": {"b": [1, -2500.0, "x\n"]}},
    )
    for bad in ("", "{", '{"a" 1}', "01", "[1 2]", "'x'", "tru", "[" * 10_000, '"\x01"', "1" * 2000):
        assert parse_json_bounded(bad) == (False, None)


def test_strings_with_markup_like_text():
    tools = [fn("f", s={"type": "string"}, t={"type": "array", "items": {"type": "string"}})]
    s = 'a </item> <b>bold</b> </invoke> <invoke name="x"> & "q"'
    body = el("s", Lit(s)) + el("t", el("item", Lit("</item>")))
    assert parse(invoke("f", body), tools=tools)[2] == [("f", {"s": s, "t": ["</item>"]})]
    # NS not followed by a tag, and block markers inside an invoke, are literal value text.
    literal = f"x {NS} y {NS}</b <tool_call></tool_call> z"
    assert parse(invoke("f", el("s", literal)), tools=tools)[2] == [("f", {"s": literal})]
    # A user typing the marker strings with plain tokens writes content, not calls.
    typed = Lit(f'see {NS}<tool_call>{NS}<invoke name="f">{NS}</invoke>')
    assert parse(typed, tools=tools) == ("", typed, [])
    assert parse(typed, "\ue000\ue001 done", tools=tools)[1] == typed + "\ufffd\ufffd done"


def test_malformed_invokes_are_skipped_and_the_rest_parses(caplog):
    good = f'{NS}<invoke name="notify">{el("channel", "sms")}{NS}</invoke>'
    bad = [
        f'{NS}<invoke name="f">{NS}<a>1{NS}</b>{NS}</invoke>',  # mismatched close
        f'{NS}<invoke name="f">{NS}<a>1{NS}</invoke>',  # unclosed element
        f'{NS}<invoke name="f">{NS}<a>x{el("b", "1")}{NS}</a>{NS}</invoke>',  # text mixed with elements
        f'{NS}<invoke name="f">{{"a": 1}}{NS}</invoke>',  # JSON instead of elements
        f"{NS}<invoke>{el('a', '1')}{NS}</invoke>",  # no name
        f'{NS}<invoke name="">{el("a", "1")}{NS}</invoke>',  # empty name
        f'{NS}<invoke name="f">{el("a", "1")}',  # never closed before the next invoke
        f'{NS}<invoke name="f">{NS}<a>{NS}</a>{NS}</a>{NS}</invoke>',  # extra close
    ]
    with caplog.at_level(logging.WARNING, logger="m3lm.text.tool_calls"):
        for b in bad:
            text = f"hi {NS}<tool_call>\n{b}\n{good}\n{NS}</tool_call> bye"
            assert parse(text, tools=TOOLS) == ("", "hi bye", [NOTIFY]), b
    assert "skipped" in caplog.text
    # Junk between invokes is dropped; an invoke cut off by the end of the reply is skipped.
    assert parse(f"{NS}<tool_call>junk {good} more junk {NS}</tool_call>", tools=TOOLS)[1:] == ("", [NOTIFY])
    assert parse(f'a {NS}<tool_call>{good}{NS}<invoke name="x">{NS}<a>1', tools=TOOLS)[1:] == ("a", [NOTIFY])
    assert parse(f"a {NS}<tool_call>", tools=TOOLS)[1:] == ("a", [])


def test_second_wrapper_unknown_tools_and_filters():
    block = f'{NS}<tool_call>{NS}<invoke name="notify">{el("channel", "sms")}{NS}</invoke>{NS}</tool_call>'
    other = f'{NS}<tool_call>{NS}<invoke name="mystery">{el("n", "3")}{NS}</invoke>{NS}</tool_call>'
    calls = [NOTIFY, ("mystery", {"n": "3"})]
    assert parse(f"a\n{block}\n b \n{other}\n", tools=TOOLS) == ("", "a\nb", calls)
    only = plan_tool_choice(TOOLS, {"type": "function", "function": {"name": "notify"}})
    assert parse(f"{other}{block}", tools=TOOLS, plan=only)[2] == [NOTIFY]
    first = plan_tool_choice(TOOLS, "auto", parallel_tool_calls=False)
    assert parse(f"{block}{other}", tools=TOOLS, plan=first)[2] == [NOTIFY]
    assert parse(f"{other}{block}", tools=TOOLS, plan=first)[2] == [calls[1]]


def test_element_names_that_look_like_invoke():
    body = el("invoke_x", "1") + el("invoker", el("item", "2"))
    assert parse(invoke("f", body), tools=TOOLS)[2] == [("f", {"invoke_x": "1", "invoker": ["2"]})]


def test_format_from_tokenizer():
    assert M3_FMT.tools.family == "m3" and M2_FMT.tools.family == "m2" and M2_FMT.tools.ns_id is None
    assert M3_FMT.reasoning == ReasoningMarkers(502, 503, 501)
    with pytest.raises(ValueError):
        ReplyFormat.from_tokenizer(FakeTokenizer({"<mm:think>": 1, "</mm:think>": 2}))
    with pytest.raises(ValueError):
        ReplyFormat.from_tokenizer(M3, family="m9")


def test_deep_nesting_is_bounded():
    deep = f"{NS}<a>" * 10_000 + "x" + f"{NS}</a>" * 10_000
    assert parse(invoke("f", deep) + invoke("notify", el("channel", "sms")), tools=TOOLS)[2] == [NOTIFY]
    ok = f"{NS}<a>" * 20 + "x" + f"{NS}</a>" * 20
    args = parse(invoke("f", ok), tools=TOOLS)[2][0][1]
    for _ in range(20):
        args = args["a"]
    assert args == "x"


def test_tool_choice_none_passes_text_through():
    plan = plan_tool_choice(TOOLS, "none")
    assert plan == ToolChoicePlan(parse=False)
    _, content, calls = parse(EXAMPLE, tools=TOOLS, plan=plan)
    assert calls == [] and content.startswith("text before the calls\n\n<invoke") and NS not in content


def test_tool_choice_plans_and_finish_reason():
    assert plan_tool_choice(None, "auto") == ToolChoicePlan(parse=False)
    assert plan_tool_choice(TOOLS, None) == ToolChoicePlan(parse=True)
    assert plan_tool_choice(TOOLS, "required") == ToolChoicePlan(parse=True, required=True)
    named = {"type": "function", "function": {"name": "notify"}}
    assert plan_tool_choice(TOOLS, named) == ToolChoicePlan(parse=True, required=True, only="notify")
    for tools, choice in [(TOOLS, "sometimes"), (TOOLS, {"function": {"name": "nope"}}), ([], "required")]:
        with pytest.raises(ValueError):
            plan_tool_choice(tools, choice)
    reply = parse_reply(M3.tokens("just text"), M3_FMT, ADAPTIVE, TOOLS, plan_tool_choice(TOOLS, "required"))
    assert missing_required_call(plan_tool_choice(TOOLS, "required"), reply.tool_calls)
    assert finish_reason(reply.tool_calls, "stop") == "stop" and reply.message()["content"] == "just text"
    calls = parse_reply(M3.tokens(EXAMPLE), M3_FMT, ADAPTIVE, TOOLS).tool_calls
    assert finish_reason(calls, "stop") == "tool_calls" and finish_reason(calls, "length") == "length"


def test_start_in_block_for_a_prefilled_opener():
    rest = EXAMPLE.split(f"{NS}<tool_call>\n", 1)[1] + "\nafter"
    assert parse(rest, tools=TOOLS, start_in_block=True) == ("", "after", [BOOK, NOTIFY])


def test_m2_format():
    tools = [fn("get", city={"type": "string"}, days={"type": "integer"}, opts={"type": "object"})]
    call = (
        '<minimax:tool_call>\n<invoke name="get">\n<parameter name="city">New <York></parameter>\n'
        '<parameter name="days">3</parameter><parameter name="opts">{"units": "C", "n": [1]}</parameter>\n'
        '</invoke>\n<invoke name="get"><parameter name="days">2</invoke>\n</minimax:tool_call>'
    )
    expected = [("get", {"city": "New <York>", "days": 3, "opts": {"units": "C", "n": [1]}})]
    m2 = {"fmt": M2_FMT, "tok": M2, "tools": tools}
    assert parse("<think>", "hmm</think>\n\nok\n", call, **m2) == ("hmm", "\n\nok", expected)
    mode = detect_thinking_mode([601, 7, 8, 602, 9], M2_FMT.reasoning)
    assert mode is ENABLED and parse("hmm</think>ok", call, mode=mode, **m2) == ("hmm", "ok", expected)
    # Without a single opener token, the text form opens the block.
    tok = FakeTokenizer({k: v for k, v in M2_MARKERS.items() if "tool_call" not in k})
    assert parse(call, fmt=ReplyFormat.from_tokenizer(tok), tok=tok, tools=tools)[2] == expected


@pytest.mark.parametrize(
    ("mode", "text", "expected"),
    [
        (ENABLED, "think</mm:think>answer", ("think", "answer")),
        (ENABLED, "<mm:think>think</mm:think>answer", ("think", "answer")),
        (ENABLED, "cut off by max_tokens", ("cut off by max_tokens", "")),
        (ENABLED, "</mm:think>answer", ("", "answer")),
        (DISABLED, "answer", ("", "answer")),
        (DISABLED, "</mm:think>answer", ("", "answer")),
        (DISABLED, "<mm:think>a</mm:think>b", ("", "ab")),
        (ADAPTIVE, "<mm:think>think</mm:think>answer", ("think", "answer")),
        (ADAPTIVE, "</mm:think>answer", ("", "answer")),
        (ADAPTIVE, "</mm:think></mm:think>answer", ("", "answer")),
        (ADAPTIVE, "answer <mm:think> more </mm:think>", ("", "answer  more ")),
        (ADAPTIVE, "<mm:think>open only", ("open only", "")),
        (ADAPTIVE, Lit("<mm:think>typed</mm:think>"), ("", "<mm:think>typed</mm:think>")),
        (ADAPTIVE, "", ("", "")),
    ],
)
def test_reasoning_modes(mode, text, expected):
    markers = M3_FMT.reasoning
    for tokens in (M3.tokens(text), M3.tokens(text, marker_text=True), [(1, ""), *M3.tokens(text)]):
        parser = ReasoningParser(markers, mode)
        deltas = [parser.feed(*t) for t in tokens]
        streamed = ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas))
        assert streamed == tuple(split_reasoning(tokens, markers, mode)) == expected
    assert parse(text, mode=mode)[:2] == expected


def test_detect_thinking_mode():
    markers = ReasoningMarkers(start_id=502, end_id=503, turn_start_id=501)
    history = [501, 1, 2, 503, 3, 9]
    assert detect_thinking_mode([*history, 501, 4, 502], markers) is ENABLED
    assert detect_thinking_mode([*history, 501, 4, 503], markers) is DISABLED
    assert detect_thinking_mode([*history, 501, 4], markers) is ADAPTIVE
    assert detect_thinking_mode([], markers) is ADAPTIVE


def test_openai_deltas_never_mix():
    _, _, _, events = stream(M3.tokens("<mm:think>r</mm:think>", EXAMPLE), tools=TOOLS)
    deltas = [to_openai_delta(e) for e in events]
    assert deltas[0] == {"reasoning_content": "r", "reasoning": "r"}
    assert all(len(d) == 1 or set(d) == {"reasoning_content", "reasoning"} for d in deltas)
    header = next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]
    assert header["function"] == {"name": "book_room", "arguments": ""} and header["type"] == "function"


def test_template_messages():
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "because",
            "tool_calls": [
                tool_call("call_1", "f", '{"a": 1, "b": null, "c": {"d": null, "e": [null]}}'),
                tool_call("call_2", "g", ""),
            ],
        },
        {"role": "assistant", "content": "x", "reasoning_content": "r1", "reasoning": "r2"},
    ]
    out = template_messages(messages)
    assert out[0] == messages[0]
    assert out[1]["reasoning_content"] == "because" and "reasoning" not in out[1]
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "c": {"e": [None]}}
    assert out[1]["tool_calls"][1]["function"]["arguments"] == {}
    assert out[2]["reasoning_content"] == "r1" and "reasoning" not in out[2]
    assert isinstance(messages[1]["tool_calls"][0]["function"]["arguments"], str)
    for args in ("[1]", "{bad", '{"a": 1e999}', "[" * 5000):
        with pytest.raises(ValueError):
            template_messages(
                [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": args}}]}]
            )


KEYS = st.sampled_from(["a", "b_c", "name", "x1", "héllo"])
ATOMS = ["a", "Z", " ", "\n", "<", ">", "/", '"', "=", "&", "é", "😀", "</item>", "<item>", "<b>"]
M3_TEXT = st.lists(
    st.sampled_from([*ATOMS, "</invoke>", '<invoke name="x">', "<tool_call>", "</tool_call>"]), max_size=6
)
M2_TEXT = st.lists(st.sampled_from([*ATOMS, NS, "<tool_call>", "</minimax:tool_call>"]), max_size=6)
TYPED = st.lists(
    st.sampled_from(["a", " ", "\n", "<", "tool_call>", NS, "<tool_call>", "</mm:think>", "é"]), max_size=8
)
LEAF_SCHEMAS = [INT, N, B, {"type": ["string", "null"]}, {"type": "string"}]


def schemas(depth):
    leaf = st.sampled_from(LEAF_SCHEMAS)
    if depth >= 3:
        return leaf
    sub = schemas(depth + 1)
    objects = st.dictionaries(KEYS, sub, max_size=3).map(lambda p: {"type": "object", "properties": p})
    return st.one_of(leaf, objects, sub.map(lambda s: {"type": "array", "items": s}))


def values(schema, text):
    t = schema["type"]
    if t == "object":
        return st.fixed_dictionaries(
            {}, optional={k: values(s, text) for k, s in schema["properties"].items()}
        )
    if t == "array":
        return st.lists(values(schema["items"], text), max_size=3)
    strings = text.map("".join)
    if t == "string":
        return strings
    if t == "integer":
        return st.integers(-(10**20), 10**20)
    if t == "number":
        return st.floats(allow_nan=False, allow_infinity=False)
    if t == "boolean":
        return st.booleans()
    return st.one_of(st.none(), strings.filter(lambda s: s.strip() != "null"))


@st.composite
def calls_and_tools(draw, text):
    props = draw(st.lists(st.tuples(KEYS, schemas(1)), max_size=4, unique_by=lambda kv: kv[0]))
    calls = [
        (f"t{i}", draw(values({"type": "object", "properties": dict(props)}, text)))
        for i in range(draw(st.integers(0, 3)))
    ]
    return calls, [fn(name, **dict(props)) for name, _ in calls]


def render_m3(v):
    if isinstance(v, dict):
        return "".join(el(k, render_m3(x)) for k, x in v.items())
    if isinstance(v, list):
        return "".join(el("item", render_m3(x)) for x in v)
    return v if isinstance(v, str) else json.dumps(v)


def render_m2(calls):
    def value(v):
        return v if isinstance(v, str) else json.dumps(v)

    invokes = [
        f'<invoke name="{n}">\n'
        + "".join(f'<parameter name="{k}">{value(v)}</parameter>\n' for k, v in args.items())
        for n, args in calls
    ]
    return "\n<minimax:tool_call>\n" + "".join(i + "</invoke>\n" for i in invokes) + "</minimax:tool_call>"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), family=st.sampled_from(["m3", "m2"]))
def test_random_chunking_reconstructs_the_reply(data, family):
    mode = data.draw(st.sampled_from([ENABLED, DISABLED, ADAPTIVE]))
    reasoning, before, after = (Lit("".join(data.draw(TYPED))) for _ in range(3))
    calls, tools = data.draw(calls_and_tools(M3_TEXT if family == "m3" else M2_TEXT))
    think = ("<mm:think>", "</mm:think>") if family == "m3" else ("<think>", "</think>")
    shape = data.draw(st.sampled_from(["think", "bare", "none"]))
    parts, expected_reasoning = [], ""
    if mode is ENABLED or (mode is ADAPTIVE and shape == "think"):
        parts, expected_reasoning = ([] if mode is ENABLED else [think[0]]) + [reasoning, think[1]], reasoning
    elif shape == "bare":
        parts = [think[1]]
    block = (
        ("\n" + NS + "<tool_call>\n" + "".join(invoke_body(n, a) for n, a in calls) + NS + "</tool_call>")
        if family == "m3"
        else render_m2(calls)
    )
    parts += [before, block, after] if calls else [before]
    head, tail = before.rstrip(), after.lstrip()
    content = head + (before[len(head) :] + "\n" if head and tail else "") + tail if calls else before
    tok, fmt = (M3, M3_FMT) if family == "m3" else (M2, M2_FMT)
    tokens = tok.tokens(*parts, rng=random.Random(data.draw(st.integers(0, 2**32))))
    one = parse_reply(tokens, fmt, mode, tools)
    assert (one.reasoning, one.content) == (expected_reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in one.tool_calls] == calls
    assert stream(tokens, fmt, mode, tools)[:3] == (
        one.reasoning,
        one.content,
        [(c.name, c.arguments) for c in one.tool_calls],
    )


def invoke_body(name, args):
    return f'{NS}<invoke name="{name}">{render_m3(args)}{NS}</invoke>\n'


M3_FRAGMENTS = [NS, "<tool_call>", "</tool_call>", '<invoke name="f">', "</invoke>", "<a>", "</a>", "<item>"]
M3_FRAGMENTS += ["</item>", "</mm:think>", "<mm:think>", Lit(NS), Lit("<tool_call>"), '<invoke name="f">x']
M2_FRAGMENTS = [
    "<minimax:tool_call>",
    "</minimax:tool_call>",
    '<invoke name="f">',
    "</invoke>",
    "</parameter>",
]
M2_FRAGMENTS += ['<parameter name="a">', "[1, 2]", "{", "<think>", "</think>", Lit("<minimax:tool_call>"), NS]
FRAGMENTS = {"m3": M3_FRAGMENTS, "m2": M2_FRAGMENTS}


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    family=st.sampled_from(["m3", "m2"]),
    seeds=st.tuples(st.integers(0, 99), st.integers(0, 99)),
)
def test_fuzzed_markup_is_total_and_chunking_independent(data, family, seeds):
    parts = data.draw(
        st.lists(st.sampled_from([*FRAGMENTS[family], "x", "3", " ", "\n", "<", ">", "\ue000"]))
    )
    tok, fmt = (M3, M3_FMT) if family == "m3" else (M2, M2_FMT)
    tools = [fn("f", a={"type": "array", "items": {"type": "integer"}})]
    one = parse_reply(tok.tokens(*parts), fmt, ADAPTIVE, tools)
    assert not any(c in one.content for c in "\ue000\ue001\ue002")
    expected = (one.reasoning, one.content, [(c.name, c.arguments) for c in one.tool_calls])
    for seed in seeds:
        assert stream(tok.tokens(*parts, rng=random.Random(seed)), fmt, ADAPTIVE, tools)[:3] == expected


def test_incremental_tool_parser_matches_one_shot_on_split_markers():
    tokens = M3.tokens(EXAMPLE, rng=random.Random(0))
    parser = ToolCallParser(M3_FMT.tools, TOOLS)
    events = [e for t in tokens for e in parser.feed(*t)] + parser.finish()
    assert not any(NS in e.text or "<" in e.text for e in events if isinstance(e, ContentDelta))
    one = parse_tool_calls(tokens, M3_FMT.tools, TOOLS)
    assert [(c.name, c.arguments) for c in parser.calls] == [(c.name, c.arguments) for c in one.calls]


@pytest.mark.skipif(not (FIXTURES / "minimax-m3-tiny").is_dir(), reason=f"no fixtures at {FIXTURES}")
def test_history_round_trip_through_the_fixture_template():
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(FIXTURES / "minimax-m3-tiny"))
    fmt = ReplyFormat.from_tokenizer(tokenizer)
    assert fmt.tools.ns_id == tokenizer.convert_tokens_to_ids(NS) and fmt.tools.open_id is not None
    args = {
        "nights": 3,
        "guest": {"name": "Ada </item> Lovelace", "vip": None},
        "tags": ["quiet", "high floor"],
    }
    history = [
        {"role": "user", "content": "book"},
        {
            "role": "assistant",
            "content": "sure",
            "reasoning": "r",
            "tool_calls": [
                tool_call("call_1", "book_room", json.dumps(args)),
                tool_call("call_2", "notify", '{"channel": "sms"}'),
            ],
        },
    ]
    text = tokenizer.apply_chat_template(template_messages(history), tools=TOOLS, tokenize=False)
    reply = text.rsplit("]~b]ai\n", 1)[1].removesuffix("[e~[\n")
    ids = tokenizer.encode(reply, add_special_tokens=False)
    tokens = [(i, tokenizer.decode([i], skip_special_tokens=True)) for i in ids]
    parsed = parse_reply(tokens, fmt, ADAPTIVE, TOOLS)
    del args["guest"]["vip"]
    assert parsed.content == "sure"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("book_room", args), NOTIFY]
    for mode in ENABLED, DISABLED, ADAPTIVE:
        prompt = tokenizer.apply_chat_template(
            history, add_generation_prompt=True, thinking_mode=mode.value, tokenize=False
        )
        assert detect_thinking_mode(tokenizer.encode(prompt, add_special_tokens=False), fmt.reasoning) is mode
