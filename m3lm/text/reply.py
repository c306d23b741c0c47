"""One reply as it streams: the reasoning split and tool calls (`ReplyParser`), then the answer's
own stop strings, as typed events (`ReasoningText`, `ContentDelta`, tool-call headers and
argument fragments). Each API writes its wire format of these; `LLM.chat` keeps the parsed reply."""

from __future__ import annotations

from dataclasses import dataclass, field

from m3lm.core import StepOutput
from m3lm.text.detokenize import StopStrings
from m3lm.text.reasoning import ParsedReply, ReasoningText, ReplyEvent, ReplyParser
from m3lm.text.schema_values import finish_reason
from m3lm.text.tool_calls import ContentDelta, ToolCall


@dataclass
class ReplyText:
    """A reply's text state: its parser (None: all of it is content), the answer's stop strings,
    what it has said so far, and how it finished."""

    parser: ReplyParser | None = None
    stops: StopStrings | None = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tokens: int = 0
    reasoning_tokens: int = 0  # of `tokens`, those inside the reasoning (its markers included)
    token_ids: list[int] = field(default_factory=list)
    finish: str | None = None
    stopped_by_string: bool = False  # the caller aborts the engine's request then

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.parser.tool_calls if self.parser else []

    def parsed(self) -> ParsedReply:
        return ParsedReply("".join(self.reasoning), "".join(self.content), self.tool_calls)

    def events(self, out: StepOutput) -> list[ReplyEvent]:
        """The typed reply events of one engine output (its text made), after the answer's stop strings."""
        self.tokens += len(out.new_token_ids)
        self.token_ids += out.new_token_ids
        events = self._parse(out)
        if self.stops is not None:
            events = self._stop(events, out.finished)
        for ev in events:
            if isinstance(ev, ContentDelta):
                self.content.append(ev.text)
            elif isinstance(ev, ReasoningText):
                self.reasoning.append(ev.text)
        if self.stopped_by_string:
            self.finish = "stop"
        elif out.finished:
            self.finish = finish_reason(self.tool_calls, out.finish_reason or "stop")
        return events

    def _parse(self, out: StepOutput) -> list[ReplyEvent]:
        """The output's reasoning, answer and tool calls, token by token (all answer without a parser)."""
        if self.parser is None:
            return [ContentDelta(out.new_text)] if out.new_text else []
        parsed: list[ReplyEvent] = []
        n = len(out.new_token_ids)  # none: a prompt scored with max_tokens 0
        texts = out.token_texts or ([""] * (n - 1) + [out.new_text] if n else [])
        for tid, text in zip(out.new_token_ids, texts, strict=True):
            was = self.parser.reasoning.in_reasoning
            parsed += self.parser.feed(tid, text)
            self.reasoning_tokens += was or self.parser.reasoning.in_reasoning
        if out.finished:
            parsed += self.parser.finish()
        return parsed

    def _stop(self, parsed: list[ReplyEvent], finished: bool) -> list[ReplyEvent]:
        """`parsed` up to the answer's first stop string (reasoning and tool calls pass as they are);
        at the end, the answer's held-back tail."""
        events: list[ReplyEvent] = []
        for ev in parsed:
            if not isinstance(ev, ContentDelta):
                events.append(ev)
                continue
            text, hit = self.stops.cut(ev.text)
            if text:
                events.append(ContentDelta(text))
            if hit:
                self.stopped_by_string = True
                return events
        if finished and (rest := self.stops.flush()):
            events.append(ContentDelta(rest))
        return events
