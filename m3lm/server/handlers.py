"""Chat and text completions: admission, then streamed (SSE) or whole responses.

Admission (validation, the queue) is decided before any response header is sent, so a stream
never starts with 200 and then fails for capacity. Reasoning and tool calls are split from the
answer on token ids (`ReplyParser`); in chat, stop strings apply to the answer only.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from m3lm.core import SamplingParams
from m3lm.engine.async_engine import AsyncEngine, EngineDead, Interrupted, QueueFull, RequestStream
from m3lm.engine.engine import StepOutput
from m3lm.server.choice import Choice, completion_logprobs, token_logprobs, usage
from m3lm.server.metrics import Metrics
from m3lm.server.parsers import plan_tool_choice, template_messages
from m3lm.server.protocol import ChatCompletionRequest, CompletionRequest, Limits, error_body
from m3lm.server.reasoning import ReplyFormat, ReplyParser, detect_thinking_mode
from m3lm.server.structured import chat_rules, completion_rules

_json = msgspec.json.Encoder().encode


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.type, code=self.status), self.status, headers=self.headers
        )


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    limits: Limits
    metrics: Metrics
    defaults: SamplingParams
    fmt: ReplyFormat | None = None
    draining: bool = False
    salt_by_tenant: bool = False  # prefix-cache pages shared only among requests with one API key

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len - 1  # the context holds the prompt and at least one new token


def tenant_salt(state: ServerState, request: Request, salt: str | None) -> str | None:
    """The request's cache salt: its own, within its API key's namespace when salting by key."""
    if not state.salt_by_tenant:
        return salt
    return f"{request.state.tenant}:{salt or ''}"


def submit(state: ServerState, prompt_ids: list[int], params: SamplingParams, n: int) -> list[RequestStream]:
    """Admit n samples of one prompt, or none of them."""
    if params.max_tokens > state.max_model_len:
        raise ApiError(
            400, f"max_tokens = {params.max_tokens} exceeds the context length {state.max_model_len}"
        )
    if state.draining:
        raise ApiError(503, "the server is shutting down", "service_unavailable", {"Retry-After": "5"})
    streams: list[RequestStream] = []
    try:
        for i in range(n):
            p = params if n == 1 or params.seed is None else _with_seed(params, _nth_seed(params.seed, i))
            streams.append(state.engine.add(prompt_ids, p))
    except QueueFull as e:
        state.metrics.rejections.labels(state.model_name).inc()
        _abort(streams)
        raise ApiError(503, str(e), "service_unavailable", {"Retry-After": "1"}) from None
    except EngineDead as e:
        _abort(streams)
        raise ApiError(503, f"the engine has stopped: {e}", "service_unavailable") from None
    except ValueError as e:
        _abort(streams)
        raise ApiError(400, str(e)) from None
    return streams


def _nth_seed(seed: int, i: int) -> int:
    """The seed of a request's i-th choice: seed + i, wrapping around the signed 64-bit range."""
    return (seed + i + 2**63) % 2**64 - 2**63


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)


def _abort(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def merge(
    streams: list[RequestStream], tick: float | None = None
) -> AsyncIterator[tuple[int, StepOutput] | None]:
    """Outputs of several streams as (index, output), in arrival order; closing aborts them all.

    With `tick`, None comes after every `tick` seconds without an output (for keep-alives); waiting
    is never what ends a stream: a queued or slow request keeps its place.
    """
    if len(streams) == 1:  # the common case, without a task and a queue between
        try:
            while True:
                try:
                    out = await streams[0].next(tick)
                except StopAsyncIteration:
                    return
                yield None if out is None else (0, out)
        finally:
            _abort(streams)
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await q.put((i, out))
        except BaseException as e:
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            try:
                i, item = await asyncio.wait_for(q.get(), tick)
            except asyncio.TimeoutError:
                yield None
                continue
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        _abort(streams)


async def chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    tok = state.tokenizer
    if tok is None or not tok.has_chat_template:
        raise ApiError(400, "this model has no chat template; use /v1/completions")
    tool_dicts = [t.model_dump(exclude_none=True) for t in req.tools or []]
    try:
        req.check_limits(state.limits)
        req.cache_salt = tenant_salt(state, request, req.cache_salt)
        plan = plan_tool_choice(tool_dicts, req.tool_choice, req.parallel_tool_calls)
        messages = template_messages([m.for_template() for m in req.messages])
        tools = tool_dicts if req.tools and req.tool_choice != "none" else None
        prompt_ids = await run_in_threadpool(
            tok.chat_prompt, messages, tools, True, req.chat_template_kwargs, state.max_prompt_tokens
        )
        # Unset: until the context ends, as vLLM does (the engine clamps to what is left).
        max_tokens = req.max_completion_tokens or req.max_tokens or state.max_model_len
        params = req.sampling(state.defaults, max_tokens, req.requested_logprobs(), [])
        mode = detect_thinking_mode(prompt_ids, state.fmt.reasoning) if state.fmt else None
        rules, thinking = await run_in_threadpool(chat_rules, req, tool_dicts, plan, state.fmt, mode)
        params = replace(params, structured=rules, thinking=thinking)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    streams = submit(state, prompt_ids, params, req.n)
    from m3lm.tokenizer import StopStrings

    stops = req.stops()
    choices = [
        Choice(
            i,
            ReplyParser(state.fmt, mode, tool_dicts, plan) if state.fmt else None,
            StopStrings(stops) if stops else None,
        )
        for i in range(req.n)
    ]
    return await _respond(state, req, request, streams, choices, len(prompt_ids), chat=True)


async def completion(state: ServerState, req: CompletionRequest, request: Request):
    tok = state.tokenizer
    try:
        req.check_limits(state.limits)
        req.cache_salt = tenant_salt(state, request, req.cache_salt)
        prompts = req.prompts()
        if len(prompts) * req.n > state.limits.max_n:
            raise ValueError(
                f"{len(prompts)} prompts x n = {req.n} exceed the limit of {state.limits.max_n} choices"
            )
        ids = []
        for p in prompts:
            if isinstance(p, str):
                if tok is None:
                    raise ValueError("this model has no tokenizer; send token ids")
                tok.check_fits(p, state.max_prompt_tokens)
                p = await run_in_threadpool(tok.encode, p)
            ids.append(list(p))
        params = req.sampling(state.defaults, req.max_tokens or 16, req.logprobs, req.stops())
        if req.response_format is not None or req.structured_outputs is not None:
            if tok is None:
                raise ValueError("structured output needs the model's tokenizer")
            params = replace(params, structured=await run_in_threadpool(completion_rules, req))
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    streams: list[RequestStream] = []
    try:
        for p in ids:
            streams += submit(state, p, params, req.n)
    except ApiError:
        _abort(streams)
        raise
    choices = [Choice(i, None) for i in range(len(streams))]
    return await _respond(state, req, request, streams, choices, sum(len(p) for p in ids), chat=False)


async def _respond(state, req, request, streams, choices, prompt_tokens, chat: bool):
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    created = int(time.time())
    # token ids in the reply: asked for, or the only form of the output when there is no tokenizer
    ids = not chat and (req.return_token_ids or state.tokenizer is None)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(state, rid, created, streams, choices, prompt_tokens, chat, include_usage, req.n, ids)
        return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    await _collect_unless_gone(request, _collect(state, streams, choices), streams)
    totals = usage(prompt_tokens, choices, req.n)
    if chat:
        body = [
            {
                "index": c.index,
                "message": c.message(),
                "logprobs": {"content": c.logprobs} if c.logprobs else None,
                "finish_reason": c.finish,
            }
            for c in choices
        ]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": state.model_name,
            "choices": body,
            "usage": totals,
        }
    body = [
        {
            "index": c.index,
            "text": "".join(c.content),
            "logprobs": completion_logprobs(c),
            "finish_reason": c.finish,
            **({"token_ids": c.token_ids} if ids else {}),
        }
        for c in choices
    ]
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": state.model_name,
        "choices": body,
        "usage": totals,
    }


async def _collect_unless_gone(request: Request, collect, streams: list[RequestStream]) -> None:
    """Run `collect` unless the client disconnects first; then its requests are aborted."""
    task = asyncio.ensure_future(collect)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled
        gone.cancel()
        left = not task.done()
        if left:
            task.cancel()
            _abort(streams)
    if left:
        raise ApiError(499, "client disconnected")
    task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already, so only a disconnect comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(state: ServerState, streams: list[RequestStream], choices: list[Choice]) -> None:
    try:
        async for i, out in merge(streams):  # type: ignore[misc]  # no tick: never None
            _check(out)
            c = choices[i]
            c.consume(out)
            if state.tokenizer is not None and out.new_logprobs:
                c.logprobs += token_logprobs(state.tokenizer, out)
            if c.stopped_by_string:
                streams[i].abort()
    except EngineDead as e:
        raise ApiError(500, f"the engine stopped: {e}", "internal_error") from None
    except Interrupted as e:
        raise ApiError(503, str(e), "service_unavailable") from None
    for c in choices:
        c.finish = c.finish or "abort"


def _check(out: StepOutput) -> None:
    if out.finish_reason == "error":
        detail = out.error or "unknown error"
        raise ApiError(500, f"generation failed: {detail}", "internal_error")


def _sse(obj: dict) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"


async def _stream(
    state, rid, created, streams, choices, prompt_tokens, chat, include_usage, per_prompt, ids=False
) -> AsyncIterator[bytes]:
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, payload: dict, finish: str | None = None) -> str:
        body = {"index": index, **payload, "logprobs": payload.pop("logprobs", None), "finish_reason": finish}
        return _sse(
            {
                "id": rid,
                "object": kind,
                "created": created,
                "model": state.model_name,
                "choices": [body],
                "usage": None,
            }
        )

    if chat:
        for c in choices:
            yield chunk(c.index, {"delta": {"role": "assistant", "content": ""}})
    events = merge(streams, state.limits.keepalive_s)
    try:
        async for event in events:
            if event is None:
                yield b": keep-alive\n\n"
                continue
            i, out = event
            c = choices[i]
            if c.finish is not None:
                continue
            _check(out)
            lps = token_logprobs(state.tokenizer, out) if out.new_logprobs else []
            deltas = c.consume(out)
            if (lps or (ids and out.new_token_ids)) and not deltas:
                deltas = [{}] if chat else [{"content": ""}]
            for j, d in enumerate(deltas):
                extra = {"token_ids": out.new_token_ids} if ids and j == 0 else {}
                if lps and j == 0:
                    extra["logprobs"] = (
                        {"content": lps} if chat else completion_logprobs(Choice(0, None, logprobs=lps))
                    )
                yield chunk(i, {"delta": d, **extra} if chat else {"text": d.get("content", ""), **extra})
            if c.stopped_by_string:
                streams[i].abort()
            if c.finish is not None:
                yield chunk(i, {"delta": {}} if chat else {"text": ""}, c.finish)
        if include_usage:
            yield _sse(
                {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": state.model_name,
                    "choices": [],
                    "usage": usage(prompt_tokens, choices, per_prompt),
                }
            )
    except ApiError as e:
        yield _sse(error_body(e.message, e.type, code=e.status))
    except EngineDead as e:
        yield _sse(error_body(f"the engine stopped: {e}", "internal_error", code=500))
    except Interrupted as e:
        yield _sse(error_body(str(e), "service_unavailable", code=503))
    finally:
        await events.aclose()
    yield b"data: [DONE]\n\n"
