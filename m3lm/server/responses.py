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
import secrets
import time

import msgspec
from fastapi import APIRouter, Request

from m3lm.server.choice import Choice
from m3lm.server.handlers import ApiError, ServerState, admit_chat, prepare_chat, served
from m3lm.server.protocol import documented_errors
from m3lm.server.reply_lifecycle import answer
from m3lm.server.responses_request import ResponsesRequest, chat_request, chat_tools
from m3lm.text.reasoning import ReasoningText, ReplyEvent
from m3lm.text.tool_calls import ToolCallArguments, ToolCallHeader

_json = msgspec.json.Encoder().encode


class OutputItems:
    """Output items from a reply's typed events: `write` returns the stream events (without their
    sequence numbers) and `items` holds the output as it grows."""

    def __init__(self, names: dict[str, tuple[str, str]] | None = None) -> None:
        self.items: list[dict] = []
        self.names = names or {}  # flat names of namespaced functions -> (namespace, name)

    @property
    def _open(self) -> dict | None:
        return self.items[-1] if self.items and self.items[-1]["status"] == "in_progress" else None

    def write(self, ev: ReplyEvent) -> list[dict]:
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


class ResponseWriter:
    """One response in the making, whole or as the Responses stream events (`reply_lifecycle`'s
    writer): its request, ids, output items, and the fields every form of it shares. A finished
    response is stored when the request asks for it."""

    def __init__(
        self,
        state: ServerState,
        req: ResponsesRequest,
        prompt_tokens: int,
        history: list[dict],
        c: Choice,
        tenant: str | None,
    ):
        self.req, self.prompt_tokens, self.history, self.c = req, prompt_tokens, history, c
        self.store, self.tenant = state.stored, tenant
        self.id, self.created = _id("resp_"), int(time.time())
        self.model = req.model or state.model_name
        effort = req.reasoning.effort if req.reasoning else None
        self.effort = state.efforts.effective(effort) if state.efforts is not None else effort
        self.out = OutputItems(chat_tools(req.tools or [])[1])
        self.sequence = 0  # of the next stream event

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

    def finish(self) -> dict:
        """The final response (stored when the request asked for it)."""
        response = self.body(self._status(), self.c)
        if self.req.store is not False:
            self.store.put(self.tenant, response, self.history + self.req.input_items() + response["output"])
        return response

    def _status(self) -> str:
        return "incomplete" if self.c.finish == "length" else "completed"

    def _sse(self, data: dict) -> bytes:
        data["sequence_number"], self.sequence = self.sequence, self.sequence + 1
        return b"event: " + data["type"].encode() + b"\ndata: " + _json(data) + b"\n\n"

    def opening(self) -> list[bytes]:
        return [
            self._sse({"type": "response.created", "response": self.body("in_progress")}),
            self._sse({"type": "response.in_progress", "response": self.body("in_progress")}),
        ]

    async def chunks(self, c: Choice, out, events: list[ReplyEvent]) -> list[bytes]:
        return [self._sse(data) for ev in events for data in self.out.write(ev)]

    def keepalive(self) -> bytes:
        return b": keep-alive\n\n"

    def closing(self, choices: list[Choice]) -> list[bytes]:
        data = [self._sse(d) for d in self.out.close(self._status())]
        response = self.finish()
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*data, self._sse({"type": kind, "response": response})]

    def failed(self, e: ApiError) -> list[bytes]:
        failed = self.body("failed", self.c, {"code": "server_error", "message": e.message})
        return [self._sse({"type": "response.failed", "response": failed})]

    def take(self, c: Choice, events: list[ReplyEvent]) -> None:
        for ev in events:
            self.out.write(ev)

    def whole(self, choices: list[Choice]) -> dict:
        self.out.close(self._status())
        return self.finish()


async def create_response(state: ServerState, req: ResponsesRequest, request: Request):
    tenant = getattr(request.state, "tenant", None)
    history: list[dict] = []
    if req.previous_response_id is not None:
        entry = state.stored.get(tenant, req.previous_response_id)
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
    writer = ResponseWriter(state, req, len(prompt.ids), history, choices[0], tenant)
    return await answer(state, request, slots, choices, writer, req.stream)


ERRORS = documented_errors(400, 401, 404, 413, 422, 431, 500, 503)
REPLY = {
    "content": {"application/json": {}, "text/event-stream": {}},
    "description": "a response or its events",
}
router = APIRouter()


@router.post("/v1/responses", responses={**ERRORS, 200: REPLY})
async def responses(req: ResponsesRequest, request: Request):
    return await create_response(served(request, req), req, request)


@router.get("/v1/responses/{response_id}", responses=ERRORS)
async def get_response(response_id: str, request: Request):
    state: ServerState = request.app.state.m3lm
    entry = state.stored.get(getattr(request.state, "tenant", None), response_id)
    if entry is None:
        raise ApiError(404, f"response {response_id!r} not found", "not_found_error")
    return entry[0]
