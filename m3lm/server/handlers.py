"""Chat and text completions: admission, then streamed (SSE) or whole responses.

Admission (validation, the queue) is decided before any response header is sent, so a stream
never starts with 200 and then fails for capacity. Reasoning and tool calls are split from the
answer on token ids (`ReplyParser`); in chat, stop strings apply to the answer only.
"""

from __future__ import annotations

import asyncio
import logging
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
from m3lm.engine.async_engine import (
    AsyncEngine,
    EngineDead,
    Interrupted,
    QueueFull,
    RequestStream,
)
from m3lm.engine.engine import StepOutput, check_prompt_length
from m3lm.server.choice import (
    Choice,
    completion_logprobs,
    echo_logprobs,
    token_logprobs,
    usage,
    vllm_prompt_logprobs,
)
from m3lm.server.metrics import Metrics
from m3lm.server.parsers import ToolChoicePlan, plan_tool_choice, template_messages
from m3lm.server.protocol import ChatCompletionRequest, CompletionRequest, Limits, error_body, error_body_for
from m3lm.server.reasoning import ReplyEvent, ReplyFormat, ReplyParser, detect_thinking_mode
from m3lm.server.structured import chat_rules, completion_rules

_json = msgspec.json.Encoder().encode
log = logging.getLogger("m3lm.server")


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers or {}

    def response(self, path: str = "") -> JSONResponse:
        body = error_body_for(path, self.message, self.type, code=self.status)
        return JSONResponse(body, self.status, headers=self.headers)


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


class Slots:
    """The engine requests of one HTTP request, and the one way to free them.

    `add` admits n samples of a prompt (all or none); `release` aborts every one still running and
    may be called any number of times. A handler releases on every way out until a response takes
    the slots over; the response releases them once it is sent, failed or cut off
    (`_OwningStream`), so an error, an abort, a hang-up or a cancelled task after admission cannot
    keep a place in the queue or a KV page.
    """

    def __init__(self, state: ServerState):
        self.state = state
        self.streams: list[RequestStream] = []

    def add(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[RequestStream]:
        state = self.state
        if params.max_tokens > state.max_model_len:
            raise ApiError(
                400, f"max_tokens = {params.max_tokens} exceeds the context length {state.max_model_len}"
            )
        if state.draining:
            raise ApiError(503, "the server is shutting down", "service_unavailable", {"Retry-After": "5"})
        added: list[RequestStream] = []
        try:
            for i in range(n):
                p = params if n == 1 or params.seed is None else _with_seed(params, _nth_seed(params.seed, i))
                added.append(state.engine.add(prompt_ids, p))
        except BaseException as e:
            _abort(added)
            raise _admission_error(state, e) from None
        self.streams += added
        return added

    def release(self) -> None:
        _abort(self.streams)


def _admission_error(state: ServerState, e: BaseException) -> BaseException:
    if isinstance(e, QueueFull):
        state.metrics.rejections.labels(state.model_name).inc()
        return ApiError(503, str(e), "service_unavailable", {"Retry-After": "1"})
    if isinstance(e, EngineDead):
        return ApiError(503, f"the engine has stopped: {e}", "service_unavailable")
    if isinstance(e, Interrupted):  # the engine is not answering
        return ApiError(503, str(e), "service_unavailable", {"Retry-After": "5"})
    if isinstance(e, ValueError):
        return ApiError(400, str(e))
    return e


class _OwningStream(StreamingResponse):
    """A streamed reply that releases its request's slots however the sending ends."""

    def __init__(self, content, slots: Slots, **kwargs):
        super().__init__(content, **kwargs)
        self.slots = slots

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slots.release()


def owning_stream(body: AsyncIterator[bytes], slots: Slots) -> StreamingResponse:
    """An SSE reply that takes `slots` over: they are released once it is sent, failed or cut off."""
    return _OwningStream(body, slots, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


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
    """Outputs of several streams as (index, output), in arrival order (their `Slots` free them).

    With `tick`, None comes after every `tick` seconds without an output (for keep-alives); waiting
    is never what ends a stream: a queued or slow request keeps its place.
    """
    if len(streams) == 1:  # the common case, without a task and a queue between
        while True:
            try:
                out = await streams[0].next(tick)
            except StopAsyncIteration:
                return
            yield None if out is None else (0, out)
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


@dataclass
class ChatPrompt:
    """A validated chat request made ready for admission: its prompt ids, sampling and reply rules.
    Every API that speaks in messages (chat completions, Responses, Anthropic Messages) comes
    through here, so a conversation renders and samples alike whichever API it arrives by."""

    ids: list[int]
    params: SamplingParams
    plan: ToolChoicePlan
    tools: list[dict]
    stops: list[str]
    n: int


async def prepare_chat(state: ServerState, req: ChatCompletionRequest, request: Request) -> ChatPrompt:
    """Validate and render a chat request (400 for what cannot be served); nothing is admitted."""
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
        max_tokens = next(
            (m for m in (req.max_completion_tokens, req.max_tokens) if m is not None), state.max_model_len
        )
        params = req.sampling(
            state.defaults, max_tokens, req.requested_logprobs(), [], prompt_logprobs=req.prompt_logprobs
        )
        mode = detect_thinking_mode(prompt_ids, state.fmt.reasoning) if state.fmt else None
        rules, thinking = await run_in_threadpool(chat_rules, req, tool_dicts, plan, state.fmt, mode)
        params = replace(params, structured=rules, thinking=thinking)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return ChatPrompt(prompt_ids, params, plan, tool_dicts, req.stops(), req.n)


def admit_chat(state: ServerState, prompt: ChatPrompt) -> tuple[Slots, list[Choice]]:
    """Admit a prepared chat request (or refuse it whole): its slots and one Choice each. The
    caller owns the slots from here (`Slots`)."""
    from m3lm.tokenizer import StopStrings

    slots = Slots(state)
    try:
        slots.add(prompt.ids, prompt.params, prompt.n)
        mode = detect_thinking_mode(prompt.ids, state.fmt.reasoning) if state.fmt else None
        choices = [
            Choice(
                i,
                ReplyParser(state.fmt, mode, prompt.tools, prompt.plan) if state.fmt else None,
                StopStrings(prompt.stops) if prompt.stops else None,
            )
            for i in range(prompt.n)
        ]
    except BaseException:
        slots.release()
        raise
    return slots, choices


async def chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    prompt = await prepare_chat(state, req, request)
    slots, choices = admit_chat(state, prompt)
    try:
        return await _respond(state, req, request, slots, choices, len(prompt.ids), chat=True)
    except BaseException:
        slots.release()
        raise


async def reply_events(
    streams: list[RequestStream], choices: list[Choice], tick: float | None = None
) -> AsyncIterator[tuple[Choice, list[ReplyEvent]] | None]:
    """Each engine output of admitted choices as (choice, its typed reply events), for the
    translation layers; None every `tick` seconds without output (their keep-alives). A failure
    is an ApiError. Choices the streams left unfinished end "abort"."""
    events = merge(streams, tick)
    try:
        async for item in events:
            if item is None:
                yield None
                continue
            i, out = item
            c = choices[i]
            if c.finish is not None:
                continue
            _check(out)
            evs = c.events(out)
            if c.stopped_by_string:
                streams[i].abort(completed=True)
            yield c, evs
    except EngineDead as e:
        raise ApiError(500, f"the engine stopped: {e}", "internal_error") from None
    except Interrupted as e:
        raise ApiError(503, str(e), "service_unavailable") from None
    finally:
        await events.aclose()
    for c in choices:
        c.finish = c.finish or "abort"


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
            else:  # before any copy of a long list
                check_prompt_length(len(p), state.max_model_len)
            ids.append(list(p))
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params = req.sampling(
            state.defaults, max_tokens, req.logprobs, req.stops(), prompt_logprobs=req.scored_prompt()
        )
        if req.response_format is not None or req.structured_outputs is not None:
            if tok is None:
                raise ValueError("structured output needs the model's tokenizer")
            params = replace(params, structured=await run_in_threadpool(completion_rules, req))
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    slots = Slots(state)
    try:
        for p in ids:
            slots.add(p, params, req.n)
        # echo: the prompt's text as given, or as its ids decode (admitted: ids in the vocabulary)
        echoes = (
            [p if isinstance(p, str) else tok.decode(p) if tok else "" for p in prompts] if req.echo else None
        )
        choices = [
            Choice(i, None, prompt_ids=ids[i // req.n], echo=echoes[i // req.n] if echoes else None)
            for i in range(len(slots.streams))
        ]
        return await _respond(state, req, request, slots, choices, sum(len(p) for p in ids), chat=False)
    except BaseException:
        slots.release()
        raise


async def _respond(state, req, request, slots: Slots, choices, prompt_tokens, chat: bool):
    """The reply: a stream that takes the slots over, or a whole reply collected here."""
    streams = slots.streams
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    created = int(time.time())
    # token ids in the reply: asked for, or the only form of the output when there is no tokenizer
    ids = not chat and (req.return_token_ids or state.tokenizer is None)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(state, rid, created, streams, choices, prompt_tokens, chat, include_usage, req.n, ids)
        return owning_stream(body, slots)
    try:
        await collect_unless_gone(request, _collect(state, streams, choices))
    finally:
        slots.release()
    totals = usage(prompt_tokens, choices, req.n)
    if chat:
        body = [
            {
                "index": c.index,
                "message": c.message(),
                "logprobs": {"content": c.logprobs} if c.logprobs else None,
                "finish_reason": c.finish,
                **_prompt_logprobs_field(state, req, c),
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
            "text": (c.echo or "") + "".join(c.content),
            "logprobs": completion_logprobs(
                (echo_logprobs(state.tokenizer, c) if req.echo and req.logprobs is not None else [])
                + c.logprobs
            ),
            "finish_reason": c.finish,
            **({"token_ids": c.token_ids} if ids else {}),
            **_prompt_logprobs_field(state, req, c),
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


async def collect_unless_gone(request: Request, collect) -> None:
    """Run `collect` unless the client disconnects first (the caller then releases the slots)."""
    task = asyncio.ensure_future(collect)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled
        gone.cancel()
        left = not task.done()
        if left:
            task.cancel()
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
            c.prompt_logprobs = c.prompt_logprobs or out.prompt_logprobs
            if c.stopped_by_string:
                streams[i].abort(completed=True)
    except EngineDead as e:
        raise ApiError(500, f"the engine stopped: {e}", "internal_error") from None
    except Interrupted as e:
        raise ApiError(503, str(e), "service_unavailable") from None
    for c in choices:
        c.finish = c.finish or "abort"


def _prompt_logprobs_field(state: ServerState, req, c: Choice) -> dict:
    """vLLM's `prompt_logprobs` of a choice, when the request asked for it."""
    if req.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": vllm_prompt_logprobs(state.tokenizer, c, req.prompt_logprobs)}


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
            if c.echo is not None:  # the prompt first: its text, and its tokens' logprobs if asked
                c.prompt_logprobs = out.prompt_logprobs
                head = echo_logprobs(state.tokenizer, c) if c.prompt_logprobs is not None else []
                extra = {"logprobs": completion_logprobs(head, c.offset)} if head else {}
                c.offset += sum(len(e["token"]) for e in head)
                yield chunk(i, {"text": c.echo, **extra})
                c.echo = None
            lps = token_logprobs(state.tokenizer, out) if out.new_logprobs else []
            deltas = c.consume(out)
            if (lps or (ids and out.new_token_ids)) and not deltas:
                deltas = [{}] if chat else [{"content": ""}]
            for j, d in enumerate(deltas):
                extra = {"token_ids": out.new_token_ids} if ids and j == 0 else {}
                if lps and j == 0:
                    extra["logprobs"] = {"content": lps} if chat else completion_logprobs(lps, c.offset)
                    c.offset += sum(len(e["token"]) for e in lps)
                yield chunk(i, {"delta": d, **extra} if chat else {"text": d.get("content", ""), **extra})
            if c.stopped_by_string:
                streams[i].abort(completed=True)
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
    except Exception as e:  # a fault of ours: the client still gets an error event and the end
        log.exception("a stream failed")
        yield _sse(error_body(f"internal error: {type(e).__name__}", "internal_error", code=500))
    finally:
        await events.aclose()
    yield b"data: [DONE]\n\n"
