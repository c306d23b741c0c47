"""The OpenAI Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`).

A translation layer: the request's items become a chat completion request (`chat_request`) and
go through the chat path's rendering, sampling, tool plan and admission (`prepare_chat`,
`admit_chat`); the reply's typed events become output items (`OutputItems`): a `reasoning` item
(its text as `reasoning_text` content), a `message` item (`output_text`) and `function_call`
items, whole or as the Responses stream events, each item keeping one id from its first event to
the final response.

The request, its fields and its translation: `responses_request`.
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI, Request

from m3lm.server.choice import Choice
from m3lm.server.engine_client import RequestStream
from m3lm.server.handlers import (
    ApiError,
    ServerState,
    admit_chat,
    collect_unless_gone,
    owning_stream,
    prepare_chat,
    reply_events,
)
from m3lm.server.protocol import documented_errors
from m3lm.server.response_store import ResponseStore
from m3lm.server.responses_request import ResponsesRequest, chat_request, chat_tools
from m3lm.text.reasoning import ReasoningText, ReplyEvent
from m3lm.text.tool_calls import ToolCallArguments, ToolCallHeader

_json = msgspec.json.Encoder().encode
log = logging.getLogger("m3lm.server")


class OutputItems:
    """Output items from a reply's typed events: `feed` returns the stream events (without their
    sequence numbers) and `items` holds the output as it grows."""

    def __init__(self, names: dict[str, tuple[str, str]] | None = None) -> None:
        self.items: list[dict] = []
        self.names = names or {}  # flat names of namespaced functions -> (namespace, name)

    @property
    def _open(self) -> dict | None:
        return self.items[-1] if self.items and self.items[-1]["status"] == "in_progress" else None

    def feed(self, ev: ReplyEvent) -> list[dict]:
        if isinstance(ev, ToolCallHeader):
            namespace, name = self.names.get(ev.name, (None, ev.name))
            item = {
                "id": _id("fc_"),
                "type": "function_call",
                "call_id": ev.id,
                "name": name,
                **({"namespace": namespace} if namespace else {}),
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


def _id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class _Reply:
    """One response in the making: its request, ids and the fields every form of it shares."""

    def __init__(self, state: ServerState, req: ResponsesRequest, prompt_tokens: int, history: list[dict]):
        self.req, self.prompt_tokens, self.history = req, prompt_tokens, history
        self.id, self.created = _id("resp_"), int(time.time())
        self.model = req.model or state.model_name
        effort = req.reasoning.effort if req.reasoning else None
        self.effort = state.efforts.effective(effort) if state.efforts is not None else effort
        self.out = OutputItems(chat_tools(req.tools or [])[1])

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
            "reasoning": {"effort": self.effort, "summary": None},
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
    prompt = await prepare_chat(state, chat, request, "reasoning.effort")
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
