"""The OpenAI Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`).

A translation layer: the request's items become a chat completion request (`chat_request`) and
go through the chat path's rendering, sampling, tool plan and admission (`prepare_chat`,
`admit_chat`); the reply's typed events become output items (`OutputItems`): a `reasoning` item
(its text as `reasoning_text` content), a `message` item (`output_text`) and `function_call`
items, whole or as the Responses stream events, each item keeping one id from its first event to
the final response.

The mapping:
- `instructions` is the system message (not carried to a later response, as OpenAI does);
  `input` text is a user message; message items keep their role (text parts joined with
  newlines); `function_call` items are the assistant's tool calls and `function_call_output`
  items tool messages; `reasoning` items sent back are the turn's reasoning (their
  `reasoning_text` content, else their summary text);
- `reasoning.effort` picks the template's `thinking_mode`: `none` and `minimal` disabled, `low`
  adaptive, `medium` and above enabled; without it the template's default (adaptive) holds;
- function `tools`, `tool_choice` (`auto`, `none`, `required`, a named function) and
  `parallel_tool_calls` as in chat, with the same enforcement; `max_output_tokens` is
  `max_tokens`; `text.format` is chat's `response_format`, with the same support;
  `text.verbosity` is accepted and ignored;
- `previous_response_id` continues a stored response: responses made with `store` (default
  true) are kept in this process (`response_store`: bounded, fair between keys), each within its
  API key's namespace, and `GET /v1/responses/{id}` returns them;
- accepted and ignored: `include` (`reasoning.encrypted_content`: the reasoning text is always in
  the reasoning item), `prompt_cache_key` (prefix caching is automatic), `client_metadata`,
  `metadata` (echoed), `user`, `service_tier`, `safety_identifier`, `truncation: "disabled"`;
  refused: other tool types and `include` values, `background`, `conversation`, `prompt`,
  `truncation: "auto"`, `top_logprobs`, `max_tool_calls`, image, file and audio parts.
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from m3lm.engine.async_engine import RequestStream
from m3lm.server.choice import Choice
from m3lm.server.handlers import (
    ApiError,
    ServerState,
    admit_chat,
    collect_unless_gone,
    owning_stream,
    prepare_chat,
    reply_events,
)
from m3lm.server.protocol import ChatCompletionRequest, _Body, documented_errors
from m3lm.server.response_store import ResponseStore
from m3lm.text.reasoning import ReasoningText, ReplyEvent
from m3lm.text.tool_calls import ToolCallArguments, ToolCallHeader

_json = msgspec.json.Encoder().encode
log = logging.getLogger("m3lm.server")
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512  # OpenAI's limits
_EFFORT_MODES = {
    "none": "disabled",
    "minimal": "disabled",
    "low": "adaptive",
    "medium": "enabled",
    "high": "enabled",
    "xhigh": "enabled",
    "max": "enabled",
}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # ids, status, phase, ...


class Part(_Item):
    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[Part] = []
    content: list[Part] | None = None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(lambda v: v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)),
]


class FunctionTool(_Item):
    type: str
    name: str | None = Field(None, min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(_Item):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None


class TextConfig(_Item):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_items(cls, data: Any) -> Any:
        """Name an item or part type this server cannot read rather than its shape."""
        items = data.get("input") if isinstance(data, dict) else None
        for item in items if isinstance(items, list) else ():
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if isinstance(kind, str) and kind not in _ITEM_TYPES:
                raise ValueError(
                    f"input items of type {kind!r} are not supported (only {', '.join(_ITEM_TYPES)})"
                )
            parts = item.get("content") if isinstance(item, dict) and kind == "message" else None
            for part in parts if isinstance(parts, list) else ():
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind not in _TEXT_PARTS:
                    raise ValueError(f"{kind} parts are not supported: this model reads text")
        return data

    def check_supported(self) -> None:
        """Refuse the fields this server cannot honour (ValueError: a 400)."""
        refused = {
            "background": self.background,
            "conversation": self.conversation is not None,
            "prompt": self.prompt is not None,
            "top_logprobs": bool(self.top_logprobs),
            "max_tool_calls": self.max_tool_calls is not None,
        }
        if named := [k for k, v in refused.items() if v]:
            raise ValueError(f"{', '.join(named)}: not supported by this server")
        check_metadata(self.metadata)
        if self.truncation == "auto":
            raise ValueError(
                'truncation "auto" is not supported: a conversation longer than the context is refused'
            )
        if bad := [i for i in self.include or () if i != "reasoning.encrypted_content"]:
            raise ValueError(f"include {bad} is not supported (only reasoning.encrypted_content)")

    def input_items(self) -> list[dict]:
        """The input as items (text is one user message), as stored for a later response."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [i.model_dump(exclude_none=True) for i in self.input]


def _text(content: str | list) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text") or p.get("refusal") or "" for p in content)


def chat_messages(items: list[dict]) -> list[dict]:
    """Responses items -> chat messages: reasoning, assistant text and function calls that follow
    one another are one assistant turn; a reasoning item after text or calls starts the next."""
    out: list[dict] = []
    turn: dict | None = None
    for item in items:
        kind = item.get("type", "message")
        if kind in ("reasoning", "function_call") or (kind == "message" and item["role"] == "assistant"):
            ends_turn = {"reasoning": ("content", "tool_calls"), "message": ("tool_calls",)}.get(kind, ())
            if turn is not None and any(turn[k] for k in ends_turn):
                out.append(turn)
                turn = None
            turn = turn or {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}
            if kind == "function_call":
                fn = {"name": item["name"], "arguments": item["arguments"]}
                turn["tool_calls"].append({"id": item["call_id"], "type": "function", "function": fn})
            else:
                key = "reasoning_content" if kind == "reasoning" else "content"
                text = _text(item.get("content") or item.get("summary") or [])
                turn[key] = f"{turn[key]}\n{text}" if turn[key] else text
            continue
        if turn is not None:
            out.append(turn)
            turn = None
        if kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
        else:
            out.append({"role": item["role"], "content": _text(item["content"])})
    if turn is not None:
        out.append(turn)
    return [{k: v for k, v in m.items() if v or k == "content"} for m in out]


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice {choice!r} is not supported (auto, none, required or a function)")


def _response_format(fmt: dict | None) -> dict | None:
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        keys = ("name", "schema", "strict", "description")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
    return {"type": fmt.get("type")}


def chat_request(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat completion request a Responses request means, after the `history` items of the
    response it continues (ValueError: a 400)."""
    req.check_supported()
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += chat_messages(history + req.input_items())
    if not messages:
        raise ValueError("input is empty")
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function" or t.name is None:
            raise ValueError(f"tools.{i}: tools of type {t.type!r} are not supported (only function tools)")
        fn = t.model_dump(exclude_none=True, exclude={"type"})
        tools.append({"type": "function", "function": fn})
    body: dict[str, Any] = {
        "messages": messages,
        "tools": tools or None,
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "response_format": _response_format(req.text.format if req.text else None),
    }
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["chat_template_kwargs"] = {"thinking_mode": _EFFORT_MODES[req.reasoning.effort]}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        raise ValueError(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None


class OutputItems:
    """Output items from a reply's typed events: `feed` returns the stream events (without their
    sequence numbers) and `items` holds the output as it grows."""

    def __init__(self) -> None:
        self.items: list[dict] = []

    @property
    def _open(self) -> dict | None:
        return self.items[-1] if self.items and self.items[-1]["status"] == "in_progress" else None

    def feed(self, ev: ReplyEvent) -> list[dict]:
        if isinstance(ev, ToolCallHeader):
            item = {
                "id": _id("fc_"),
                "type": "function_call",
                "call_id": ev.id,
                "name": ev.name,
                "arguments": "",
            }
            return self.close() + self._add(item)
        if isinstance(ev, ToolCallArguments):
            self.items[-1]["arguments"] += ev.fragment
            return [{"type": "response.function_call_arguments.delta", **self._where(), "delta": ev.fragment}]
        if not ev.text:
            return []
        kind = "reasoning" if isinstance(ev, ReasoningText) else "message"
        events: list[dict] = []
        if self._open is None or self._open["type"] != kind:
            events = self.close()
            if kind == "reasoning":
                item = {"id": _id("rs_"), "type": "reasoning", "summary": [], "content": []}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": _id("msg_"), "type": "message", "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._add(item)
            self.items[-1]["content"].append(part)
            events.append(
                {
                    "type": "response.content_part.added",
                    **self._where(),
                    "content_index": 0,
                    "part": dict(part),
                }
            )
        self.items[-1]["content"][0]["text"] += ev.text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [*events, {"type": delta, **self._where(), "content_index": 0, "delta": ev.text, **extra}]

    def close(self, status: str = "completed") -> list[dict]:
        """End the open item with `status`."""
        item = self._open
        if item is None:
            return []
        where, events = self._where(), []
        if item["type"] == "function_call":
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        else:
            part = item["content"][0]
            done = (
                "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            )
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            events.append({"type": done, **where, "content_index": 0, "text": part["text"], **extra})
            events.append(
                {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)}
            )
        item["status"] = status
        events.append(
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": copy.deepcopy(item),
            }
        )
        return events

    def _add(self, item: dict) -> list[dict]:
        item["status"] = "in_progress"
        self.items.append(item)
        return [
            {
                "type": "response.output_item.added",
                "output_index": len(self.items) - 1,
                "item": copy.deepcopy(item),
            }
        ]

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's limits on `metadata`: 16 pairs, keys of 64 characters, values of 512."""
    if metadata is None:
        return
    if len(metadata) > METADATA_PAIRS:
        raise ValueError(f"metadata: {len(metadata)} pairs, at most {METADATA_PAIRS}")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY:
            raise ValueError(f"metadata: a key of {len(key)} characters, at most {METADATA_KEY}")
        if len(value) > METADATA_VALUE:
            raise ValueError(f"metadata[{key!r}]: {len(value)} characters, at most {METADATA_VALUE}")


def _id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class _Reply:
    """One response in the making: its request, ids and the fields every form of it shares."""

    def __init__(self, state: ServerState, req: ResponsesRequest, prompt_tokens: int, history: list[dict]):
        self.req, self.prompt_tokens, self.history = req, prompt_tokens, history
        self.id, self.created = _id("resp_"), int(time.time())
        self.model = req.model or state.model_name
        self.out = OutputItems()

    def body(self, status: str, c: Choice | None = None, error: dict | None = None) -> dict:
        req = self.req
        usage = None
        if c is not None:
            usage = {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": c.cached, "cache_write_tokens": 0},
                "output_tokens": c.tokens,
                "output_tokens_details": {"reasoning_tokens": c.reasoning_tokens},
                "total_tokens": self.prompt_tokens + c.tokens,
            }
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": copy.deepcopy(self.out.items),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store is not False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": (req.text.format if req.text else None) or {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "truncation": req.truncation or "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def finish(self, c: Choice, store: ResponseStore, tenant: str | None) -> dict:
        """The final response (stored when the request asked for it)."""
        response = self.body("incomplete" if c.finish == "length" else "completed", c)
        if self.req.store is not False:
            store.put(tenant, response, self.history + self.req.input_items() + response["output"])
        return response


async def create_response(state: ServerState, store: ResponseStore, req: ResponsesRequest, request: Request):
    tenant = getattr(request.state, "tenant", None)
    history: list[dict] = []
    if req.previous_response_id is not None:
        entry = store.get(tenant, req.previous_response_id)
        if entry is None:
            raise ApiError(
                404, f"previous response {req.previous_response_id!r} not found", "not_found_error"
            )
        history = entry[1]
    try:
        chat = chat_request(req, history)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    prompt = await prepare_chat(state, chat, request)
    slots, choices = admit_chat(state, prompt, request)
    reply = _Reply(state, req, len(prompt.ids), history)
    c = choices[0]
    if req.stream:  # the response owns the slots from here
        return owning_stream(_stream(state, store, tenant, reply, slots.streams, c), slots)

    async def collect() -> None:
        async for _, events in reply_events(slots.streams, choices):  # type: ignore[misc]  # no tick: never None
            for ev in events:
                reply.out.feed(ev)
        reply.out.close("incomplete" if c.finish == "length" else "completed")

    try:
        await collect_unless_gone(request, collect())
    finally:
        slots.release()
    return reply.finish(c, store, tenant)


async def _stream(
    state: ServerState,
    store: ResponseStore,
    tenant: str | None,
    reply: _Reply,
    streams: list[RequestStream],
    c: Choice,
) -> AsyncIterator[bytes]:
    sequence = 0

    def sse(data: dict) -> bytes:
        nonlocal sequence
        data["sequence_number"], sequence = sequence, sequence + 1
        return b"event: " + data["type"].encode() + b"\ndata: " + _json(data) + b"\n\n"

    yield sse({"type": "response.created", "response": reply.body("in_progress")})
    yield sse({"type": "response.in_progress", "response": reply.body("in_progress")})
    events = reply_events(streams, [c], state.limits.keepalive_s)
    try:
        async for item in events:
            if item is None:
                yield b": keep-alive\n\n"
                continue
            for ev in item[1]:
                for data in reply.out.feed(ev):
                    yield sse(data)
        for data in reply.out.close("incomplete" if c.finish == "length" else "completed"):
            yield sse(data)
        response = reply.finish(c, store, tenant)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield sse({"type": kind, "response": response})
    except Exception as e:  # an ApiError, or a fault of ours: the response still fails in its words
        if not isinstance(e, ApiError):
            log.exception("a stream failed")
        message = e.message if isinstance(e, ApiError) else f"internal error: {type(e).__name__}"
        failed = reply.body("failed", c, {"code": "server_error", "message": message})
        yield sse({"type": "response.failed", "response": failed})
    finally:
        await events.aclose()


def register(app: FastAPI, state: ServerState, check_model) -> None:
    """Add the Responses routes to `app`, with their store of responses."""
    store = ResponseStore()
    errors = documented_errors(400, 401, 404, 413, 422, 431, 500, 503)
    reply = {
        "content": {"application/json": {}, "text/event-stream": {}},
        "description": "a response or its events",
    }

    @app.post("/v1/responses", responses={**errors, 200: reply})
    async def responses(req: ResponsesRequest, request: Request):
        check_model(req.model)
        req.warn_unknown()
        return await create_response(state, store, req, request)

    @app.get("/v1/responses/{response_id}", responses=errors)
    async def get_response(response_id: str, request: Request):
        entry = store.get(getattr(request.state, "tenant", None), response_id)
        if entry is None:
            raise ApiError(404, f"response {response_id!r} not found", "not_found_error")
        return entry[0]
