"""Tool-call parsing for M3's namespaced XML and M2's invoke/parameter XML.

Input representation. The parser consumes `(token_id, text)` pairs like the reasoning parser.
Three token ids are structural and become private sentinel characters in an internal string:
NS (`]<]minimax[>[`, M3 only), the block opener (`<tool_call>` / `<minimax:tool_call>`) and the
block closer. The text of those tokens is ignored, and sentinel characters arriving in ordinary
text are replaced by U+FFFD, so a user who types `]<]minimax[>[` as text can never forge a tag.
When the tokenizer has no single token for the opener, its text form opens a block instead.

Grammar (M3): a block is opened by `NS? <tool_call>` and closed by `NS? </tool_call>`; inside it,
each `NS<invoke name="f">` ... `NS</invoke>` is one call whose body is elements `NS<p>` ...
`NS</p>`. An element with element children is an object, or an array when every child is
`<item>`; otherwise its text is a leaf typed by the tool's JSON schema (`type_value`). An NS not
followed by a tag is literal text of a value. M2: `<invoke name="f"><parameter name="p">value
</parameter></invoke>` inside `<minimax:tool_call>`, values typed the same way.

Choices: a malformed invoke (bad header, unbalanced or mismatched tags, text mixed with
elements, nesting deeper than MAX_DEPTH, never closed) is skipped and logged, the others stand.
Calls to tool names missing from `tools` are kept (the client can answer with an error the
model can learn from) unless `only` names the one allowed function. A second block is parsed
like the first. Inside an invoke the block markers are literal value text, so a value may quote
them. A block and the whitespace around it collapse to the whitespace before it, or to nothing
at either end of the content ("hi <block> bye" -> "hi bye", "text\n<block>\n" -> "text").

Streaming: each invoke is held until it closes, then its header event and its arguments (one
fragment, the final JSON) go out. Holding keeps the stream identical to the one-shot parse and
never announces a call that later proves malformed.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from m3lm.text.schema_values import (
    MAX_DEPTH,
    child_schema,
    new_call_id,
    schema_types,
    tool_schemas,
    type_value,
)

logger = logging.getLogger(__name__)

NS, OPEN, CLOSE = "\ue000", "\ue001", "\ue002"
_SANITIZE = {ord(NS): 0xFFFD, ord(OPEN): 0xFFFD, ord(CLOSE): 0xFFFD}


class _Malformed(Exception):
    """Internal: one invoke cannot be parsed (never escapes this module)."""


@dataclass(frozen=True)
class ToolFormat:
    """Which wire format to parse and the ids of its structural tokens (None: not one token)."""

    family: Literal["m3", "m2"]
    ns_id: int | None = None
    open_id: int | None = None
    close_id: int | None = None

    def to_text(self, token_id: int, text: str) -> str:
        """One token in the parser's representation: a sentinel or sanitized text."""
        if token_id == self.ns_id:
            return NS
        if token_id == self.open_id:
            return OPEN
        if token_id == self.close_id:
            return CLOSE
        return text.translate(_SANITIZE)


@dataclass(frozen=True)
class ContentDelta:
    """Answer text outside any tool-call block."""

    text: str


@dataclass(frozen=True)
class ToolCallHeader:
    """First delta of a call: sent once, before its arguments."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """A fragment of a call's arguments; the fragments of one index concatenate to the JSON."""

    index: int
    fragment: str


ToolEvent = ContentDelta | ToolCallHeader | ToolCallArguments


@dataclass(frozen=True)
class ToolCall:
    """A parsed call; `arguments` is the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The `message.tool_calls[i]` object of the OpenAI API."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolParse:
    """One-shot result: the content outside blocks and the calls, in order."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


_INVOKE = re.compile(
    r"""<invoke\s+name\s*=\s*(?:"([^"<>\n\ue000-\ue002]*)"|'([^'<>\n\ue000-\ue002]*)')\s*>"""
)
_TAG = re.compile(r"""<(/?)([^\s<>/"'=\ue000-\ue002]{1,128})>""")
_PARAM = re.compile(
    r"""\s*<parameter\s+name\s*=\s*(?:"([^"<>\n\ue000-\ue002]*)"|'([^'<>\n\ue000-\ue002]*)')\s*>"""
)


@dataclass
class _Element:
    name: str | None
    schema: Any
    text: list[str] = field(default_factory=list)
    children: list[tuple[str, Any]] = field(default_factory=list)


def _close_element(el: _Element, literal: dict[int, str]) -> Any:
    text = "".join(el.text)
    if not el.children:
        return type_value(text.translate(literal), el.schema)
    if text.strip():
        raise _Malformed(f"text mixed with elements in <{el.name}>")
    types = schema_types(el.schema)
    object_only = "object" in types and "array" not in types
    if not object_only and all(name == "item" for name, _ in el.children):
        return [v for _, v in el.children]
    return dict(el.children)


def _parse_m3_body(body: str, schema: Any, literal: dict[int, str]) -> dict[str, Any]:
    """Elements after NS -> nested values, with an explicit stack (no recursion on input)."""
    root = _Element(None, schema)
    stack = [root]
    pieces = body.split(NS)
    root.text.append(pieces[0])
    for piece in pieces[1:]:
        m = _TAG.match(piece)
        if not m:
            stack[-1].text.append(NS + piece)  # NS not starting a tag: literal value text
            continue
        closing, name = m.groups()
        if not closing:
            if len(stack) > MAX_DEPTH:
                raise _Malformed(f"elements nested deeper than {MAX_DEPTH}")
            stack.append(_Element(name, child_schema(stack[-1].schema, name)))
        elif len(stack) == 1 and not root.children and "".join(root.text).strip():
            # The first parameter's opening tag elided (M3 does this at times): the text before
            # its closing tag is its value, so the call is kept rather than skipped.
            value = _Element(name, child_schema(schema, name), ["".join(root.text).lstrip()])
            root.text = []
            root.children.append((name, _close_element(value, literal)))
        elif len(stack) == 1 or stack[-1].name != name:
            raise _Malformed(f"unexpected </{name}>")
        else:
            el = stack.pop()
            stack[-1].children.append((name, _close_element(el, literal)))
        stack[-1].text.append(piece[m.end() :])
    if len(stack) > 1:
        raise _Malformed(f"<{stack[-1].name}> never closed")
    if "".join(root.text).strip():
        raise _Malformed("text outside the parameters")
    return dict(root.children)


def _parse_m2_body(body: str, schema: Any, literal: dict[int, str]) -> dict[str, Any]:
    args: dict[str, Any] = {}
    pos = 0
    while m := _PARAM.match(body, pos):
        end = body.find("</parameter>", m.end())
        name = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
        if end < 0 or not name:
            raise _Malformed("unclosed or unnamed <parameter>")
        args[name] = type_value(body[m.end() : end].translate(literal), child_schema(schema, name))
        pos = end + len("</parameter>")
    if body[pos:].strip():
        raise _Malformed("text outside the parameters")
    return args


@dataclass(frozen=True)
class _Grammar:
    openers: tuple[str, ...]
    closers: tuple[str, ...]
    invoke_starts: tuple[str, ...]
    invoke_end: str
    invoke_restart: str
    literal: dict[int, str]
    parse_body: Callable[[str, Any, dict[int, str]], dict[str, Any]]


def _grammar(fmt: ToolFormat) -> _Grammar:
    if fmt.family == "m3":
        text_open = () if fmt.open_id is not None else ("<tool_call>",)
        return _Grammar(
            openers=(NS + OPEN, OPEN, NS + "<tool_call>", *text_open),
            closers=(NS + CLOSE, CLOSE, NS + "</tool_call>", "</tool_call>"),
            invoke_starts=(NS + "<invoke", "<invoke"),
            invoke_end=NS + "</invoke>",
            invoke_restart=NS + "<invoke name=",
            literal={ord(NS): "]<]minimax[>[", ord(OPEN): "<tool_call>", ord(CLOSE): "</tool_call>"},
            parse_body=_parse_m3_body,
        )
    text_open = () if fmt.open_id is not None else ("<minimax:tool_call>",)
    return _Grammar(
        openers=(OPEN, *text_open),
        closers=(CLOSE, "</minimax:tool_call>"),
        invoke_starts=("<invoke",),
        invoke_end="</invoke>",
        invoke_restart="<invoke name=",
        literal={ord(NS): "", ord(OPEN): "<minimax:tool_call>", ord(CLOSE): "</minimax:tool_call>"},
        parse_body=_parse_m2_body,
    )


def _find_first(buf: str, start: int, patterns: Sequence[str]) -> tuple[int, str]:
    """Earliest occurrence of any pattern at or after start (longest on ties), or (-1, "")."""
    best, best_pat = -1, ""
    for p in patterns:
        i = buf.find(p, start)
        if i >= 0 and (best < 0 or i < best or (i == best and len(p) > len(best_pat))):
            best, best_pat = i, p
    return best, best_pat


def _partial_len(buf: str, start: int, patterns: Sequence[str]) -> int:
    """Length of the longest suffix of buf[start:] that could still grow into a pattern."""
    n = len(buf) - start
    return max(
        (k for p in patterns for k in range(min(len(p) - 1, n), 0, -1) if buf.endswith(p[:k])), default=0
    )


def _unmarked(text: str) -> str:
    """Content text without stray NS or closer tokens (never shown, like any special token)."""
    return text.replace(NS, "").replace(CLOSE, "")


def _ws_start(buf: str, start: int, end: int) -> int:
    """Start of the whitespace run ending at `end`: held back in case a block follows it."""
    while end > start and (buf[end - 1].isspace() or buf[end - 1] in (NS, CLOSE)):
        end -= 1
    return end


class ToolCallParser:
    """Incremental tool-call parser: `feed` tokens, then `finish`; events come back as lists.

    `only` keeps just the calls to that function (named `tool_choice`); `max_calls` drops calls
    past that many (`parallel_tool_calls: false`); `start_in_block` is for a server that
    pre-filled the block opener into the prompt to force a call.
    """

    def __init__(
        self,
        fmt: ToolFormat,
        tools: Iterable[Mapping[str, Any]] | None = None,
        *,
        only: str | None = None,
        max_calls: int | None = None,
        start_in_block: bool = False,
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self.fmt, self._g = fmt, _grammar(fmt)
        self._schemas = tool_schemas(tools)
        self._only, self._max_calls, self._new_id = only, max_calls, new_id
        self._state = "block" if start_in_block else "content"
        self._buf, self._start, self._scan = "", 0, 0
        self._lstrip, self._sep, self._emitted = False, "", False
        self.calls: list[ToolCall] = []

    def feed(self, token_id: int, text: str) -> list[ToolEvent]:
        """Consume one token; return the events it completes (possibly none)."""
        self._buf += self.fmt.to_text(token_id, text)
        return self._process(final=False)

    def finish(self) -> list[ToolEvent]:
        """End of reply: flush held-back content; an invoke still open is skipped."""
        return self._process(final=True)

    def _process(self, final: bool) -> list[ToolEvent]:
        """Run the buffer through the states (content, block, invoke) as far as it is decided;
        keep what is not (a tail that may yet become a marker, an invoke still open)."""
        buf, pos, more = self._buf, 0, True
        events: list[ToolEvent] = []
        while more:
            pos, more = self._STATES[self._state](self, buf, pos, final, events)
        self._buf = buf[pos:]
        self._start, self._scan = self._start - pos, self._scan - pos
        return events

    def _in_content(self, buf: str, pos: int, final: bool, events: list[ToolEvent]) -> tuple[int, bool]:
        """Answer text up to the next block opener, which enters the block; else all of it but a
        tail that may yet open one. Returns (the position reached, whether to go on)."""
        g = self._g
        if self._lstrip:
            while pos < len(buf) and (buf[pos].isspace() or buf[pos] == CLOSE):
                pos += 1
            if pos == len(buf):
                return pos, False
            self._lstrip = False
        idx, pat = _find_first(buf, pos, g.openers)
        if idx >= 0:
            seg = _unmarked(buf[pos:idx])
            text = seg.rstrip()
            self._content(events, text)
            self._sep = seg[len(text) :] if text else self._sep or seg
            self._state = "block"
            return idx + len(pat), True
        end = len(buf) if final else _ws_start(buf, pos, len(buf) - _partial_len(buf, pos, g.openers))
        self._content(events, _unmarked(buf[pos:end]))
        return end, False

    def _in_block(self, buf: str, pos: int, final: bool, events: list[ToolEvent]) -> tuple[int, bool]:
        """Inside a block: the closer goes back to content, an invoke's start enters the invoke,
        and text between them is dropped. Returns (the position reached, whether to go on)."""
        g = self._g
        i_idx, i_pat = _find_first(buf, pos, g.invoke_starts)
        c_idx, c_pat = _find_first(buf, pos, g.closers)
        if c_idx >= 0 and (i_idx < 0 or c_idx < i_idx):
            _note_junk(buf[pos:c_idx])
            self._state, self._lstrip = "content", True
            return c_idx + len(c_pat), True
        if i_idx >= 0:
            _note_junk(buf[pos:i_idx])
            pos = self._start = i_idx + len(i_pat) - len("<invoke")
            self._scan, self._state = self._start + len("<invoke"), "invoke"
            return pos, True
        end = len(buf) if final else len(buf) - _partial_len(buf, pos, g.invoke_starts + g.closers)
        _note_junk(buf[pos:end])
        return end, False

    def _in_invoke(self, buf: str, pos: int, final: bool, events: list[ToolEvent]) -> tuple[int, bool]:
        """Inside an invoke: at its end it becomes a call; one never closed (another starts, or
        the reply ends) is skipped. Returns (the position reached, whether to go on)."""
        g = self._g
        idx, pat = _find_first(buf, self._scan, (g.invoke_end, g.invoke_restart))
        if idx >= 0:
            if pat == g.invoke_end:
                self._call(events, buf[self._start : idx])
                pos = idx + len(pat)
            else:
                logger.warning(
                    "skipped an invoke never closed before the next one: %r", buf[self._start : idx][:200]
                )
                pos = idx
            self._state = "block"
            return pos, True
        if final:
            logger.warning("skipped an invoke never closed: %r", buf[self._start :][:200])
            pos = len(buf)
        else:
            self._scan = max(self._scan, len(buf) - max(len(g.invoke_end), len(g.invoke_restart)) + 1)
        return pos, False

    # what to do in each state: (self, buf, pos, final, events) -> (position reached, go on?)
    _STATES: ClassVar[dict[str, Callable[..., tuple[int, bool]]]] = {
        "content": _in_content,
        "block": _in_block,
        "invoke": _in_invoke,
    }

    def _content(self, events: list[ToolEvent], text: str) -> None:
        if text:
            events.append(ContentDelta(self._sep + text if self._emitted else text))
            self._sep, self._emitted = "", True

    def _call(self, events: list[ToolEvent], text: str) -> None:
        m = _INVOKE.match(text)
        name = next((n for n in m.groups() if n is not None), "").strip() if m else ""
        if not m or not name or len(name) > 256:
            logger.warning("skipped an invoke with a bad header: %r", text[:200])
            return
        try:
            args = self._g.parse_body(text[m.end() :], self._schemas.get(name), self._g.literal)
        except _Malformed as e:
            logger.warning("skipped a malformed invoke of %r: %s", name, e)
            return
        if self._only is not None and name != self._only:
            logger.warning("dropped a call to %r: tool_choice names %r", name, self._only)
            return
        if self._max_calls is not None and len(self.calls) >= self._max_calls:
            logger.warning("dropped a call to %r past max_calls=%d", name, self._max_calls)
            return
        if self._schemas and name not in self._schemas:
            logger.warning("kept a call to unknown tool %r", name)
        call = ToolCall(self._new_id(), name, json.dumps(args, ensure_ascii=False))
        index = len(self.calls)
        self.calls.append(call)
        events += [ToolCallHeader(index, call.id, name), ToolCallArguments(index, call.arguments)]


def _note_junk(text: str) -> None:
    if _unmarked(text).strip():
        logger.warning("dropped text inside a tool-call block: %r", text[:200])


def parse_tool_calls(
    tokens: Iterable[tuple[int, str]],
    fmt: ToolFormat,
    tools: Iterable[Mapping[str, Any]] | None = None,
    **options: Any,
) -> ToolParse:
    """One-shot parse of a whole reply; takes the same options as `ToolCallParser`."""
    parser = ToolCallParser(fmt, tools, **options)
    parser._buf = "".join(fmt.to_text(t, x) for t, x in tokens)
    events = parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return ToolParse(content, parser.calls)
