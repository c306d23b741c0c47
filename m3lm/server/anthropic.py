"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`).

A translation layer: a Messages request becomes a chat completion request (`chat_request`) and
goes through the chat path's rendering, sampling, tool plan and admission (`prepare_chat`,
`admit_chat`); the reply's typed events (reasoning, answer text, tool calls) become Anthropic's
content blocks (`ContentBlocks`), whole or as Anthropic's stream events.

The mapping:
- `system` (a string or text blocks) is the system message; roles other than `user` and
  `assistant` are read as `user`; text blocks of one message are joined with newlines;
- `tool_use` blocks are the assistant's tool calls, `tool_result` blocks tool messages (an error
  result's text is prefixed with "Error: "); `thinking` blocks are the turn's reasoning, and
  must carry the signature this server issued for exactly that text (else a 400);
  `redacted_thinking` blocks are accepted and skipped (this server never redacts, so they hold
  nothing it could render); `cache_control` markers are accepted (prefix caching is automatic);
- `thinking` `enabled` / `adaptive` / `disabled` is the template's `thinking_mode`; without it the
  template's default (adaptive) holds; with `enabled`, `budget_tokens` is chat's
  `thinking_token_budget` (after that many thinking tokens the closer is forced; it must be
  under `max_tokens`, as Anthropic's rule says; budgets under Anthropic's 1,024 are accepted);
- `tool_choice` `auto` / `none` / `any` / `tool` is chat's `auto` / `none` / `required` / a named
  function, with the same enforcement (`parsers.plan_tool_choice`); `disable_parallel_tool_use`
  is `parallel_tool_calls: false`;
- `output_config.format` (a JSON schema) is chat's `response_format`, with the same support;
  `output_config.effort` is chat's `reasoning_effort`, a level of the served model's
  (`effort.Efforts`): on M3 (`low` / `medium` / `high` / `max`) a thinking mode and a reasoning
  budget (512 / 2048 / 8192 tokens / unbounded) where `thinking` sets neither; on M3.1-Flash
  (`xhigh` too) the template's `reasoning_effort`, and `thinking` `disabled` is refused;
- `stop_sequences` are stop strings on the answer; `metadata`, `service_tier` and other fields
  are accepted and ignored (logged once); a final assistant message (prefill) is refused.

A thinking block's signature is an HMAC-SHA256 of its text under a secret of this server
process: a restarted server refuses the signatures of the one before it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from typing import Annotated, Any, Literal

import msgspec
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from m3lm.server.choice import Choice
from m3lm.server.effort import ANTHROPIC_FIELD
from m3lm.server.handlers import ApiError, ServerState, admit_chat, prepare_chat, served
from m3lm.server.protocol import ChatCompletionRequest, _Body, anthropic_error_body
from m3lm.server.reply_lifecycle import answer
from m3lm.text.reasoning import ReasoningText, ReplyEvent
from m3lm.text.tool_calls import ToolCallArguments, ToolCallHeader

_json = msgspec.json.Encoder().encode


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # cache_control, citations, ...


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


InputBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[InputBlock]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        """Name a block type this server cannot read (images, documents) rather than its shape."""
        content = data.get("content") if isinstance(data, dict) else None
        blocks = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
        for b in list(blocks):  # and the blocks of tool results
            if b.get("type") == "tool_result" and isinstance(b.get("content"), list):
                blocks += [x for x in b["content"] if isinstance(x, dict)]
        for b in blocks:
            kind = b.get("type")
            if isinstance(kind, str) and kind not in _BLOCK_TYPES:
                raise ValueError(
                    f"{kind} blocks are not supported: this model reads {', '.join(_BLOCK_TYPES)}"
                )
        return data


class AnthropicTool(_Block):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; Anthropic's server tools are refused


class ToolChoice(_Block):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Block):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None


class OutputConfig(_Block):
    effort: str | None = None  # a level of the served model's (`effort.Efforts`)
    format: dict[str, Any] | None = None


class CountTokensRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


class ThinkingSigner:
    """Signs the thinking this server writes, so that a thinking block sent back is known to be
    this server's and unchanged: HMAC-SHA256 of the text under a secret of this process."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._key = secret or secrets.token_bytes(32)

    def sign(self, thinking: str) -> str:
        mac = hmac.new(self._key, b"m3lm thinking\0" + thinking.encode(), hashlib.sha256).digest()
        return base64.b64encode(mac).decode()

    def verify(self, thinking: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(thinking).encode(), signature.encode())


def _text(blocks: str | list[TextBlock]) -> str:
    return blocks if isinstance(blocks, str) else "\n".join(b.text for b in blocks)


def _user_turn(i: int, content: str | list) -> list[dict]:
    """A user message -> chat messages: tool results as tool messages, text runs as user ones."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict] = []
    texts: list[str] = []
    for j, b in enumerate(content):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            result = _text(b.content)
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": b.tool_use_id,
                    "content": f"Error: {result}" if b.is_error else result,
                }
            )
        else:
            raise ValueError(f"messages.{i}.content.{j}: a user message cannot hold a {b.type} block")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(i: int, content: str | list, signer: ThinkingSigner) -> dict:
    """An assistant message -> one chat message with its reasoning and tool calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for j, b in enumerate(content):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ThinkingBlock):
            if not signer.verify(b.thinking, b.signature):
                raise ValueError(
                    f"messages.{i}.content.{j}: the thinking block's signature is invalid (send thinking "
                    "blocks back unchanged, as this server issued them)"
                )
            reasoning.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        elif isinstance(b, ToolResultBlock):
            raise ValueError(
                f"messages.{i}.content.{j}: an assistant message cannot hold a tool_result block"
            )
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tool_choice(choice: ToolChoice | None) -> str | dict | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise ValueError('tool_choice of type "tool" needs a name')
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_request(req: CountTokensRequest, signer: ThinkingSigner) -> ChatCompletionRequest:
    """The chat completion request a Messages request means (ValueError: a 400)."""
    body: dict[str, Any] = {
        "messages": _chat_messages(req, signer),
        "tools": [_chat_tool(i, t) for i, t in enumerate(req.tools or [])] or None,
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": not (req.tool_choice and req.tool_choice.disable_parallel_tool_use),
    }
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"thinking_mode": req.thinking.type}
    fmt = req.output_config.format if req.output_config else None
    if fmt is not None:  # structured output, as chat's response_format
        schema = {"name": "output", "schema": fmt.get("schema"), "strict": True}
        body["response_format"] = {"type": fmt.get("type"), "json_schema": schema}
    if isinstance(req, MessagesRequest):
        body.update(_sampling(req))
    body["reasoning_effort"] = req.output_config.effort if req.output_config else None  # `thinking` wins
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise ValueError(f"{loc}: {first['msg']}") from None


def _chat_messages(req: CountTokensRequest, signer: ThinkingSigner) -> list[dict]:
    """The system prompt and the turns as chat messages; a final assistant turn is refused."""
    messages: list[dict] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system)})
    for i, m in enumerate(req.messages):
        if m.role == "assistant":
            messages.append(_assistant_turn(i, m.content, signer))
        else:
            messages += _user_turn(i, m.content)
    if req.messages[-1].role == "assistant":
        raise ValueError("the last message is the assistant's: continuing a reply (prefill) is not supported")
    return messages


def _chat_tool(i: int, t: AnthropicTool) -> dict:
    """A client tool as chat's function tool (server tools are refused)."""
    if t.type not in (None, "custom"):
        raise ValueError(f"tools.{i}: tools of type {t.type!r} are not supported (only client tools)")
    if t.input_schema is None:
        raise ValueError(f"tools.{i}: input_schema is required")
    fn = {"name": t.name, "parameters": t.input_schema}
    if t.description is not None:
        fn["description"] = t.description
    return {"type": "function", "function": fn}


def _sampling(req: MessagesRequest) -> dict:
    """A Messages request's sampling and length fields under chat's names; an `enabled` thinking
    budget is chat's `thinking_token_budget`, on Anthropic's rule (under `max_tokens`)."""
    fields = {
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop": req.stop_sequences,
        "stream": req.stream,
    }
    budget = req.thinking.budget_tokens if req.thinking and req.thinking.type == "enabled" else None
    if budget is not None:
        if budget < 1 or budget >= req.max_tokens:
            raise ValueError("`max_tokens` must be greater than `thinking.budget_tokens`")
        fields["thinking_token_budget"] = budget
    return fields


def _tool_id(call_id: str) -> str:
    """Anthropic's spelling of a tool call id."""
    return "toolu_" + call_id.removeprefix("call_")


class ContentBlocks:
    """Anthropic content blocks from a reply's typed events: `write` returns the stream events
    (data objects, each with its `type`) and `blocks` holds the whole content as it grows."""

    def __init__(self, signer: ThinkingSigner) -> None:
        self.signer = signer
        self.blocks: list[dict] = []
        self._open: str | None = None  # the type of the block still open
        self._json = ""  # the open tool_use block's input so far

    def write(self, ev: ReplyEvent) -> list[dict]:
        if isinstance(ev, ToolCallHeader):
            events = self.close()
            block = {"type": "tool_use", "id": _tool_id(ev.id), "name": ev.name, "input": {}}
            return events + self._start(block)
        if isinstance(ev, ToolCallArguments):
            self._json += ev.fragment
            return [self._delta({"type": "input_json_delta", "partial_json": ev.fragment})]
        if not ev.text:
            return []
        kind = "thinking" if isinstance(ev, ReasoningText) else "text"
        events = []
        if self._open != kind:
            events = self.close()
            events += self._start(
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
        self.blocks[-1][kind] += ev.text
        return [*events, self._delta({"type": f"{kind}_delta", kind: ev.text})]

    def close(self) -> list[dict]:
        """End the open block (a thinking block gets its signature first)."""
        if self._open is None:
            return []
        block, events = self.blocks[-1], []
        if self._open == "thinking":
            block["signature"] = self.signer.sign(block["thinking"])
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        elif self._open == "tool_use":
            block["input"] = json.loads(self._json) if self._json else {}
            self._json = ""
        self._open = None
        return [*events, {"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _start(self, block: dict) -> list[dict]:
        self.blocks.append(block)
        self._open = block["type"]
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}


def stop_reason(c: Choice) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` of a finished choice."""
    if c.stopped_by_string:
        return "stop_sequence", c.stops.matched
    return {"tool_calls": "tool_use", "length": "max_tokens"}.get(c.finish or "", "end_turn"), None


def _usage(prompt_tokens: int, c: Choice) -> dict:
    """Anthropic's usage: input_tokens counts what was not read from the cache."""
    return {
        "input_tokens": prompt_tokens - c.cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": c.cached,
        "output_tokens": c.tokens,
    }


def _message(rid: str, model: str, content: list, c: Choice | None, usage: dict) -> dict:
    reason, sequence = stop_reason(c) if c is not None else (None, None)
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
    }


def _sse(data: dict) -> bytes:
    return b"event: " + data["type"].encode() + b"\ndata: " + _json(data) + b"\n\n"


async def create_message(state: ServerState, signer: ThinkingSigner, req: MessagesRequest, request: Request):
    try:
        chat = chat_request(req, signer)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    prompt = await prepare_chat(state, chat, request, ANTHROPIC_FIELD)
    slots, choices = admit_chat(state, prompt, request)
    rid, model = "msg_" + secrets.token_hex(12), req.model or state.model_name
    writer = MessageWriter(signer, rid, model, len(prompt.ids), choices[0])
    return await answer(state, request, slots, choices, writer, req.stream)


class MessageWriter:
    """Anthropic's message of one choice, whole or as its events (`reply_lifecycle`'s writer).
    `message_start` waits for the first output, whose prefix-cache count its usage needs (so it is
    the usage of the whole reply), or for the first keep-alive of a long prefill."""

    def __init__(self, signer: ThinkingSigner, rid: str, model: str, prompt_tokens: int, c: Choice) -> None:
        self.blocks = ContentBlocks(signer)
        self.rid, self.model, self.prompt_tokens, self.c = rid, model, prompt_tokens, c
        self.started = False

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        usage = {**_usage(self.prompt_tokens, self.c), "output_tokens": 0}
        return [_sse({"type": "message_start", "message": _message(self.rid, self.model, [], None, usage)})]

    def opening(self) -> list[bytes]:
        return []

    async def chunks(self, c: Choice, out, events: list[ReplyEvent]) -> list[bytes]:
        return self._start() + [_sse(data) for ev in events for data in self.blocks.write(ev)]

    def keepalive(self) -> bytes:
        return b"".join(self._start()) + _sse({"type": "ping"})

    def closing(self, choices: list[Choice]) -> list[bytes]:
        c = self.c
        data = self._start() + [_sse(d) for d in self.blocks.close()]
        reason, sequence = stop_reason(c)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        data.append(_sse({"type": "message_delta", "delta": delta, "usage": _usage(self.prompt_tokens, c)}))
        return [*data, _sse({"type": "message_stop"})]

    def failed(self, e: ApiError) -> list[bytes]:
        return [_sse(anthropic_error_body(e.message, e.type, e.status))]

    def take(self, c: Choice, events: list[ReplyEvent]) -> None:
        for ev in events:
            self.blocks.write(ev)

    def whole(self, choices: list[Choice]) -> dict:
        self.blocks.close()
        c = self.c
        return _message(self.rid, self.model, self.blocks.blocks, c, _usage(self.prompt_tokens, c))


ERRORS = {c: {"model": AnthropicError} for c in (400, 401, 404, 413, 422, 431, 500, 503)}
REPLY = {
    "content": {"application/json": {}, "text/event-stream": {}},
    "description": "a message or its events",
}
router = APIRouter()


@router.post("/v1/messages", responses={**ERRORS, 200: REPLY})
async def messages(req: MessagesRequest, request: Request):
    state = served(request, req)
    return await create_message(state, ThinkingSigner(state.thinking_key), req, request)


@router.post("/v1/messages/count_tokens", responses=ERRORS)
async def count_tokens(req: CountTokensRequest, request: Request):
    """The prompt tokens `/v1/messages` would use for the same request."""
    state: ServerState = request.app.state.m3lm
    state.check_model(req.model)
    try:
        chat = chat_request(req, ThinkingSigner(state.thinking_key))
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    prompt = await prepare_chat(state, chat, request, ANTHROPIC_FIELD)
    return {"input_tokens": len(prompt.ids)}
