"""Split a reply into reasoning and answer on the think-marker token ids.

The markers (`<mm:think>`/`</mm:think>` for M3, `<think>`/`</think>` for M2) are single special
tokens, so the split is decided on token ids: a user or the model writing the marker text with
ordinary tokens never moves the boundary. Every parser here consumes `(token_id, text)` pairs,
where `text` is the detokenized piece of that token; the text of a marker token is ignored.

Modes (from the end of the prompt, see `detect_thinking_mode`):
- enabled: the prompt ended with the opener, so the reply starts inside reasoning;
- disabled: the prompt ended with the closer; the whole reply is content;
- adaptive: the reply starts with either `opener ... closer answer` or a bare `closer answer`.
In every mode one stray closer at the very start of a reply is dropped, and marker tokens never
reach the reasoning or the content text.

The split is the first stage of parsing a reply, so the whole-reply entry points live here too:
`ReplyParser` (streaming) routes every answer token on to the tool-call parser, and
`parse_reply` is its one-shot twin with the same result. Events are `ReasoningText`,
`ContentDelta`, `ToolCallHeader` and `ToolCallArguments`; one event never mixes kinds, so content
and tool-call deltas never share a chunk (`to_openai_delta` makes the chunk's delta).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from m3lm.text.schema_values import ToolChoicePlan, plan_tool_choice
from m3lm.text.tool_calls import (
    ContentDelta,
    ToolCall,
    ToolCallArguments,
    ToolCallHeader,
    ToolCallParser,
    ToolFormat,
    parse_tool_calls,
)


class ThinkingMode(enum.Enum):
    """How the prompt left the reasoning section: open, closed, or up to the model."""

    ENABLED = "enabled"
    DISABLED = "disabled"
    ADAPTIVE = "adaptive"


class Channel(enum.Enum):
    """Where one reply token belongs."""

    REASONING = "reasoning"
    CONTENT = "content"
    DROP = "drop"


@dataclass(frozen=True)
class ReasoningMarkers:
    """Token ids of the think markers (and of the turn start, to find the generation prompt)."""

    start_id: int
    end_id: int
    turn_start_id: int | None = None


class ReasoningDelta(NamedTuple):
    """Text added to the reasoning and to the content by one increment (either may be empty)."""

    reasoning: str
    content: str


def detect_thinking_mode(prompt_ids: Sequence[int], markers: ReasoningMarkers) -> ThinkingMode:
    """The mode the chat template left the prompt in.

    Only the generation prompt counts (the tokens after the last turn start), because every
    assistant turn of the history also carries a closer. Templates may pre-fill the opener plus a
    newline (M2 does), so the last marker there decides, not the very last token.
    """
    tail_start = max(0, len(prompt_ids) - 8)
    if markers.turn_start_id is not None:
        for i in range(len(prompt_ids) - 1, -1, -1):
            if prompt_ids[i] == markers.turn_start_id:
                tail_start = i + 1
                break
    for tid in reversed(prompt_ids[tail_start:]):
        if tid == markers.start_id:
            return ThinkingMode.ENABLED
        if tid == markers.end_id:
            return ThinkingMode.DISABLED
    return ThinkingMode.ADAPTIVE


class ReasoningParser:
    """Incremental splitter: feed reply tokens one at a time, get deltas back.

    States: `start` (nothing seen yet: an opener enters reasoning, a closer is the stray one and
    is dropped), `reasoning`, `content`. Tokens with empty text do not leave `start`, so a
    detokenizer that delays a split multi-byte character cannot hide the stray closer.
    """

    def __init__(self, markers: ReasoningMarkers, mode: ThinkingMode) -> None:
        self.markers = markers
        self.mode = mode
        self._state = "reasoning" if mode is ThinkingMode.ENABLED else "start"

    @property
    def in_reasoning(self) -> bool:
        """True while tokens go to the reasoning (a reply cut here has no answer yet)."""
        return self._state == "reasoning"

    def route(self, token_id: int, text: str = "") -> Channel:
        """Advance the state by one token and say where that token belongs."""
        start, end = self.markers.start_id, self.markers.end_id
        if token_id == start:
            if self._state == "start" and self.mode is ThinkingMode.ADAPTIVE:
                self._state = "reasoning"
            elif self._state == "start":
                self._state = "content"
            return Channel.DROP
        if token_id == end:
            self._state = "content"
            return Channel.DROP
        if self._state == "reasoning":
            return Channel.REASONING
        if self._state == "start" and text:
            self._state = "content"
        return Channel.CONTENT

    def feed(self, token_id: int, text: str) -> ReasoningDelta:
        """Consume one token; return what it adds to the reasoning and to the content."""
        channel = self.route(token_id, text)
        if channel is Channel.REASONING:
            return ReasoningDelta(text, "")
        if channel is Channel.CONTENT:
            return ReasoningDelta("", text)
        return ReasoningDelta("", "")


def split_reasoning(
    tokens: Iterable[tuple[int, str]], markers: ReasoningMarkers, mode: ThinkingMode
) -> ReasoningDelta:
    """One-shot split of a whole reply into (reasoning, content).

    Written independently of `ReasoningParser` (index arithmetic on the whole list) so the two
    check each other in the tests.
    """
    toks = list(tokens)
    ids = [tid for tid, _ in toks]
    marker_ids = (markers.start_id, markers.end_id)
    first_text = next((i for i, (tid, text) in enumerate(toks) if tid in marker_ids or text), len(toks))
    reasoning_start = reasoning_end = 0
    if mode is ThinkingMode.ENABLED:
        reasoning_end = ids.index(markers.end_id) if markers.end_id in ids else len(ids)
    elif mode is ThinkingMode.ADAPTIVE and first_text < len(ids) and ids[first_text] == markers.start_id:
        reasoning_start = first_text + 1
        rest = ids[reasoning_start:]
        reasoning_end = reasoning_start + rest.index(markers.end_id) if markers.end_id in rest else len(ids)
    reasoning = "".join(t for tid, t in toks[reasoning_start:reasoning_end] if tid not in marker_ids)
    content_start = max(reasoning_end, reasoning_start)
    content = "".join(t for tid, t in toks[content_start:] if tid not in marker_ids)
    return ReasoningDelta(reasoning, content)


@dataclass(frozen=True)
class ReasoningText:
    """Reasoning text; the server sends it as both `reasoning_content` and `reasoning`."""

    text: str


ReplyEvent = ReasoningText | ContentDelta | ToolCallHeader | ToolCallArguments


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` when the tokenizer has it as one token (never an unknown-token id)."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(tid, int) or tid < 0 or tokenizer.convert_ids_to_tokens(tid) != token:
        return None
    return tid


# family -> (think opener/closer, tool-call block opener/closer, namespace marker)
_FAMILY_MARKERS = {
    "m3": (("<mm:think>", "</mm:think>"), ("<tool_call>", "</tool_call>"), "]<]minimax[>["),
    "m2": (("<think>", "</think>"), ("<minimax:tool_call>", "</minimax:tool_call>"), None),
}


@dataclass(frozen=True)
class ReplyFormat:
    """Marker token ids of one checkpoint family, read from its tokenizer (never hard-coded)."""

    reasoning: ReasoningMarkers
    tools: ToolFormat

    @property
    def marker_ids(self) -> frozenset[int]:
        """Every structural token id; their text never reaches the content."""
        ids = (self.reasoning.start_id, self.reasoning.end_id, self.tools.ns_id)
        return frozenset(i for i in (*ids, self.tools.open_id, self.tools.close_id) if i is not None)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, family: str | None = None) -> ReplyFormat:
        """M3 when the tokenizer has `<mm:think>`, else M2 (`<think>`); `family` forces one."""
        if family is None:
            family = "m3" if _token_id(tokenizer, "<mm:think>") is not None else "m2"
        if family not in _FAMILY_MARKERS:
            raise ValueError(
                f"unknown reply format family {family!r}; expected one of {sorted(_FAMILY_MARKERS)}"
            )
        think, block, ns = _FAMILY_MARKERS[family]
        start, end = (_token_id(tokenizer, t) for t in think)
        ns_id = _token_id(tokenizer, ns) if ns else None
        if start is None or end is None or (ns is not None and ns_id is None):
            raise ValueError(f"tokenizer lacks the {family} marker tokens {think} / {ns}")
        markers = ReasoningMarkers(start, end, _token_id(tokenizer, "]~b]"))
        tools = ToolFormat(family, ns_id, _token_id(tokenizer, block[0]), _token_id(tokenizer, block[1]))
        return cls(markers, tools)


class ReplyParser:
    """Streaming parser of one reply: reasoning split first, then tool calls in the answer.

    `plan` defaults to `plan_tool_choice(tools)` ("auto"); `tool_options` go to `ToolCallParser`
    (`start_in_block`, `new_id`). `reasoning.in_reasoning` tells the server whether stop
    strings apply yet (they apply to the answer only).
    """

    def __init__(
        self,
        fmt: ReplyFormat,
        mode: ThinkingMode,
        tools: Sequence[Mapping[str, Any]] | None = None,
        plan: ToolChoicePlan | None = None,
        **tool_options: Any,
    ) -> None:
        self.fmt = fmt
        self.reasoning = ReasoningParser(fmt.reasoning, mode)
        plan = plan or plan_tool_choice(tools)
        self.tools: ToolCallParser | None = None
        if plan.parse:
            opts = {"only": plan.only, "max_calls": plan.max_calls, **tool_options}
            self.tools = ToolCallParser(fmt.tools, tools, **opts)
        self._markers = fmt.marker_ids

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls completed so far."""
        return self.tools.calls if self.tools else []

    def feed(self, token_id: int, text: str) -> list[ReplyEvent]:
        """Consume one generated token; return the events it completes."""
        channel = self.reasoning.route(token_id, "" if token_id in self._markers else text)
        if channel is Channel.REASONING:
            return [ReasoningText(text)] if text and token_id not in self._markers else []
        if channel is Channel.DROP:
            return []
        if self.tools is not None:
            return list(self.tools.feed(token_id, text))
        return [ContentDelta(text)] if text and token_id not in self._markers else []

    def finish(self) -> list[ReplyEvent]:
        """End of the reply: flush what was held back."""
        return list(self.tools.finish()) if self.tools else []


@dataclass(frozen=True)
class ParsedReply:
    """A whole reply split into reasoning, answer content and tool calls."""

    reasoning: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The `choices[i].message` object: content null when only calls came back."""
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": self.content or (None if self.tool_calls else ""),
        }
        if self.reasoning:
            msg["reasoning_content"] = msg["reasoning"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


def parse_reply(
    tokens: Iterable[tuple[int, str]],
    fmt: ReplyFormat,
    mode: ThinkingMode,
    tools: Sequence[Mapping[str, Any]] | None = None,
    plan: ToolChoicePlan | None = None,
    **tool_options: Any,
) -> ParsedReply:
    """One-shot parse of a finished reply; agrees with feeding `ReplyParser` token by token."""
    router = ReasoningParser(fmt.reasoning, mode)
    reasoning: list[str] = []
    answer: list[tuple[int, str]] = []
    for tid, text in tokens:
        channel = router.route(tid, "" if tid in fmt.marker_ids else text)
        if channel is Channel.REASONING and tid not in fmt.marker_ids:
            reasoning.append(text)
        elif channel is Channel.CONTENT:
            answer.append((tid, text))
    plan = plan or plan_tool_choice(tools)
    if not plan.parse:
        content = "".join(text for tid, text in answer if tid not in fmt.marker_ids)
        return ParsedReply("".join(reasoning), content)
    opts = {"only": plan.only, "max_calls": plan.max_calls, **tool_options}
    result = parse_tool_calls(answer, fmt.tools, tools, **opts)
    return ParsedReply("".join(reasoning), result.content, result.calls)


def to_openai_delta(event: ReplyEvent) -> dict[str, Any]:
    """The `choices[i].delta` object of one streamed chunk."""
    if isinstance(event, ReasoningText):
        return {"reasoning_content": event.text, "reasoning": event.text}
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ToolCallHeader):
        fn = {"name": event.name, "arguments": ""}
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function", "function": fn}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]}
