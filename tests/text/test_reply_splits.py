"""A reply streams the same however the engine groups its tokens into outputs: real token ids
and texts from the embedded model's tokenizer (with M3's special tokens, multi-byte characters
split across byte tokens), fed to one choice's text state in every split into two and three
outputs, against the whole reply parsed at once."""

import itertools
import json

import pytest

import m3lm
from m3lm.core import StepOutput
from m3lm.server.choice import Choice
from m3lm.text.detokenize import IncrementalDetokenizer
from m3lm.text.reasoning import ReplyFormat, ReplyParser, ThinkingMode, parse_reply, to_openai_delta
from m3lm.tokenizer import load_tokenizer

NS = "]<]minimax[>["
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "book_room",
            "parameters": {
                "type": "object",
                "properties": {"nights": {"type": "integer"}, "guest": {"type": "object"}},
            },
        },
    },
    {"type": "function", "function": {"name": "notify", "parameters": {"type": "object"}}},
]
NOTIFY = f'{NS}<invoke name="notify">{NS}<channel>sms 📱{NS}</channel>{NS}</invoke>'
REPLIES = {
    # reasoning handing off to a call in the same breath, then a call with 4-byte characters
    "handoff": f"<mm:think>Plan: book it, café ☕</mm:think>{NS}<tool_call>\n{NOTIFY}\n{NS}</tool_call>",
    # the first parameter's opener elided, a call cut off mid-value, text around the block
    "elided": (
        f'Sure — 🐶!\n{NS}<tool_call>\n{NS}<invoke name="book_room">3{NS}</nights>'
        f"{NS}<guest>{NS}<name>Zoë{NS}</name>{NS}</guest>{NS}</invoke>\n{NOTIFY}\n{NS}</tool_call> done"
    ),
    "truncated": f'<mm:think>ok</mm:think>Ça va {NS}<tool_call>\n{NOTIFY}\n{NS}<invoke name="notify">{NS}<channel>s',
    # a malformed call between good ones, markup-like text in the answer
    "malformed": (
        f'a < b and </tool_call> in text {NS}<tool_call>{NOTIFY}{NS}<invoke name="notify">'
        f"{NS}<x>1{NS}</y>{NS}</invoke>{NOTIFY}{NS}</tool_call>"
    ),
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(m3lm.DEFAULT_MODEL)


def engine_tokens(tok, text: str) -> list[tuple[int, str]]:
    """The reply as the engine emits it: ids, and each one's text from the incremental
    detokenizer (special tokens shown, a split character held until it completes)."""
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    texts = [detok.add(t) for t in ids]
    texts[-1] += detok.flush()
    return list(zip(ids, texts, strict=True))


def feed(fmt, tokens, cuts) -> tuple[list[dict], Choice]:
    """Deltas of one choice fed the tokens as outputs split at `cuts`."""
    choice = Choice(index=0, parser=ReplyParser(fmt, ThinkingMode.ADAPTIVE, TOOLS))
    bounds = [0, *cuts, len(tokens)]
    deltas = []
    for a, b in itertools.pairwise(bounds):
        part = tokens[a:b]
        out = StepOutput(
            "r",
            [t for t, _ in part],
            "".join(x for _, x in part),
            finished=b == len(tokens),
            finish_reason="stop" if b == len(tokens) else None,
            token_texts=[x for _, x in part] if len(part) > 1 else None,
        )
        deltas += [to_openai_delta(ev) for ev in choice.events(out)]
    return deltas, choice


def summary(deltas: list[dict], choice: Choice) -> tuple:
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                calls[c["index"]] = [c["function"]["name"], ""]
            calls[c["index"]][1] += c["function"]["arguments"]
    return reasoning, content, [(n, json.loads(a)) for n, a in calls.values()], choice.finish


@pytest.mark.parametrize("name", REPLIES)
def test_every_split_streams_like_the_whole_reply(tok, name):
    fmt = ReplyFormat.from_tokenizer(tok.hf)
    tokens = engine_tokens(tok, REPLIES[name])
    whole = parse_reply(tokens, fmt, ThinkingMode.ADAPTIVE, TOOLS)
    calls = [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
    want = (whole.reasoning, whole.content, calls, "tool_calls" if calls else "stop")
    n = len(tokens)
    splits = [(i,) for i in range(1, n)] + [(i, j) for i in range(1, n) for j in range(i + 1, n)]
    for cuts in [(), *splits]:
        deltas, choice = feed(fmt, tokens, cuts)
        assert summary(deltas, choice) == want, cuts
        for d in deltas:
            assert len(d) == 1 or set(d) == {"reasoning_content", "reasoning"}, d  # one kind a delta
            text = d.get("content", "") + d.get("reasoning_content", "")
            assert NS not in text and "<invoke" not in text and "\ufffd" not in text, (cuts, d)


def test_what_the_replies_hold(tok):
    """The cases above parse as intended: the hand-off keeps its call, the elided opener keeps
    its call, a cut-off or malformed call drops only itself."""
    fmt = ReplyFormat.from_tokenizer(tok.hf)
    notify = ("notify", {"channel": "sms 📱"})

    def parsed(name):
        r = parse_reply(engine_tokens(tok, REPLIES[name]), fmt, ThinkingMode.ADAPTIVE, TOOLS)
        return r.reasoning, r.content, [(c.name, json.loads(c.arguments)) for c in r.tool_calls]

    assert parsed("handoff") == ("Plan: book it, café ☕", "", [notify])
    book = ("book_room", {"nights": 3, "guest": {"name": "Zoë"}})
    assert parsed("elided") == ("", "Sure — 🐶!\ndone", [book, notify])
    assert parsed("truncated") == ("ok", "Ça va", [notify])
    # "</tool_call>" in the answer is the marker token (the tokenizer reads it so): never shown
    assert parsed("malformed") == ("", "a < b and  in text", [notify, notify])
