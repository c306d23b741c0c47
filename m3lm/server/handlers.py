"""Admission, which every API shares: `Slots` (the engine requests of one HTTP request and the
one way to free them) and the chat pipeline (`prepare_chat`, `admit_chat`).

Admission (validation, the queue) is decided before any response header is sent, so a stream
never starts with 200 and then fails for capacity. Every API that speaks in messages comes
through `prepare_chat` and `admit_chat`; reasoning and tool calls are split from the answer on
token ids (`ReplyParser`), and in chat, stop strings apply to the answer only. What follows
admission is `reply_lifecycle.answer`'s, with each API's writer: `chat_completions`,
`completions`, `responses`, `anthropic`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from m3lm.core import SamplingParams, StructuredOutput
from m3lm.server.choice import Choice, check_prompt_logprobs
from m3lm.server.effort import Efforts
from m3lm.server.engine_client import AsyncEngine, EngineDead, Interrupted, QueueFull, RequestStream
from m3lm.server.grammar_checks import ChecksBusy, GrammarChecks
from m3lm.server.metrics import Metrics
from m3lm.server.protocol import ChatCompletionRequest, Limits, error_body_for
from m3lm.server.response_store import ResponseStore
from m3lm.server.structured import chat_rules
from m3lm.text.detokenize import StopStrings
from m3lm.text.reasoning import ReplyFormat, ReplyParser, ThinkingMode, detect_thinking_mode
from m3lm.text.schema_values import ToolChoicePlan, plan_tool_choice, template_messages

_json = msgspec.json.Encoder().encode
log = logging.getLogger("m3lm.server")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        headers: dict | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers or {}
        self.param = param

    def response(self, path: str = "") -> JSONResponse:
        body = error_body_for(path, self.message, self.type, self.param, self.status)
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
    efforts: Efforts | None = None  # the served model's effort levels (None: no chat template)
    draining: bool = False
    salt_by_tenant: bool = False  # prefix-cache pages shared only among requests with one API key
    checks: GrammarChecks = field(default_factory=GrammarChecks)  # structured output's, bounded
    # whole replies built and encoded off the event loop: their logprobs grow with the prompt
    replies: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, "m3lm-reply"))
    keys_share: bool = False  # several API keys: each holds at most `max_requests_per_key`
    open_by_key: dict[str, int] = field(default_factory=dict)  # engine requests each API key holds
    created: int = field(default_factory=lambda: int(time.time()))  # the model card's
    stored: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's
    thinking_key: bytes = field(default_factory=lambda: secrets.token_bytes(32))  # signs Anthropic's thinking

    def check_model(self, name: str | None) -> None:
        """A 404 for a request naming a model other than this server's (no name: this one)."""
        if name is not None and name != self.model_name:
            raise ApiError(
                404,
                f"the model {name!r} does not exist (this server serves {self.model_name!r})",
                "not_found_error",
            )

    @property
    def max_requests_per_key(self) -> int:
        cap = self.limits.max_requests_per_key
        return (
            cap if cap is not None else max(1, (self.engine.info.max_num_seqs + self.limits.max_queue) // 2)
        )

    async def offload(self, fn, *args):
        """fn(*args) on the replies' threads (what grows with a prompt never runs on the loop)."""
        return await asyncio.wrap_future(self.replies.submit(fn, *args))

    async def json_reply(self, build, *args) -> Response:
        """The JSON response of build(*args), built and encoded on the replies' threads."""
        return Response(await self.offload(lambda: _json(build(*args))), media_type="application/json")

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len - 1  # the context holds the prompt and at least one new token


def served(request: Request, req) -> ServerState:
    """The app's state for a generation request `req` naming this server's model (else a 404);
    the fields it sent that nothing reads are logged once."""
    state: ServerState = request.app.state.m3lm
    state.check_model(req.model)
    req.warn_unknown()
    return state


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

    When the server has several API keys, a key holds at most `ServerState.max_requests_per_key`
    engine requests at once (429 past it): one client's flood, or its abandoned requests, cannot
    fill the queue for the others. `tenant` is the request's key digest.
    """

    def __init__(self, state: ServerState, tenant: str | None = None):
        self.state, self.tenant = state, tenant if state.keys_share else None
        self.streams: list[RequestStream] = []
        self._counted = 0  # of the streams, those counted against the tenant's share

    def add(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[RequestStream]:
        state = self.state  # a max_tokens past what the context leaves is capped there by the engine
        if state.draining:
            raise ApiError(503, "the server is shutting down", "service_unavailable", {"Retry-After": "5"})
        if self.tenant is not None:
            held, cap = state.open_by_key.get(self.tenant, 0), state.max_requests_per_key
            if held + n > cap:
                state.metrics.rejections.labels(state.model_name).inc()
                raise ApiError(
                    429,
                    f"this API key holds {held} requests (a choice each) and asks for {n} more; "
                    f"at most {cap} at once: retry when some finish",
                    "rate_limit_error",
                    {"Retry-After": "1"},
                )
        added: list[RequestStream] = []
        try:
            for i in range(n):
                p = params if n == 1 or params.seed is None else _with_seed(params, _nth_seed(params.seed, i))
                added.append(state.engine.add(prompt_ids, p))
        except BaseException as e:
            _abort(added)
            raise _admission_error(state, e) from None
        self.streams += added
        if self.tenant is not None:
            self.state.open_by_key[self.tenant] = self.state.open_by_key.get(self.tenant, 0) + len(added)
            self._counted += len(added)
        return added

    def release(self) -> None:
        _abort(self.streams)
        if self._counted:
            held = self.state.open_by_key.pop(self.tenant) - self._counted
            if held:
                self.state.open_by_key[self.tenant] = held
            self._counted = 0


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


def _nth_seed(seed: int, i: int) -> int:
    """The seed of a request's i-th choice: seed + i, wrapping around the signed 64-bit range."""
    return (seed + i + 2**63) % 2**64 - 2**63


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)


def _abort(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


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
    mode: ThinkingMode | None  # the thinking mode the prompt leaves the reply in (`detect_thinking_mode`)


async def prepare_chat(
    state: ServerState, req: ChatCompletionRequest, request: Request, effort_field: str = "reasoning_effort"
) -> ChatPrompt:
    """Validate and render a chat request (400 for what cannot be served); nothing is admitted.
    `effort_field`: what the request's API calls its `reasoning_effort`."""
    tok = state.tokenizer
    if tok is None or not tok.has_chat_template or state.efforts is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions")
    tool_dicts = [t.model_dump(exclude_none=True) for t in req.tools or []]
    try:
        req.chat_template_kwargs, req.thinking_token_budget = state.efforts.resolve(
            req.reasoning_effort, effort_field, req.chat_template_kwargs, req.thinking_token_budget
        )
        req.check_limits(state.limits)
        req.cache_salt = tenant_salt(state, request, req.cache_salt)
        plan = plan_tool_choice(tool_dicts, req.tool_choice, req.parallel_tool_calls)
        messages = template_messages([m.for_template() for m in req.messages])
        tools = tool_dicts if req.tools and req.tool_choice != "none" else None
        prompt_ids = await run_in_threadpool(
            tok.chat_prompt, messages, tools, True, req.chat_template_kwargs, state.max_prompt_tokens
        )
        limit = req.output_limit(state.max_model_len)
        params = req.sampling(
            state.defaults, limit, req.requested_logprobs(), [], prompt_logprobs=req.prompt_logprobs
        )
        if req.prompt_logprobs is not None:
            check_prompt_logprobs(len(prompt_ids), req.prompt_logprobs + 1, req.n)
        mode = detect_thinking_mode(prompt_ids, state.fmt.reasoning) if state.fmt else None
        rules, thinking = await run_in_threadpool(chat_rules, req, tool_dicts, plan, state.fmt, mode)
        await check_rules(state, request, rules)
        params = replace(params, structured=rules, thinking=thinking)
    except ValueError as e:
        raise ApiError(400, str(e), param=getattr(e, "param", None)) from None
    return ChatPrompt(prompt_ids, params, plan, tool_dicts, req.stops(), req.n, mode)


async def check_rules(state: ServerState, request: Request, rules: StructuredOutput | None) -> None:
    """Whether `rules` can be enforced (`GrammarChecks`): ValueError naming why not (a 400), or
    an ApiError when the checks cannot take it now (429, 503)."""
    if rules is None:
        return
    try:
        await state.checks.check(rules, getattr(request.state, "tenant", None), request.is_disconnected)
    except ChecksBusy as e:
        kind = "rate_limit_error" if e.status == 429 else "server_error"
        raise ApiError(e.status, str(e), kind, headers={"Retry-After": "1"}) from None


def admit_chat(state: ServerState, prompt: ChatPrompt, request: Request) -> tuple[Slots, list[Choice]]:
    """Admit a prepared chat request (or refuse it whole): its slots and one Choice each. The
    caller owns the slots from here (`Slots`)."""
    slots = Slots(state, getattr(request.state, "tenant", None))
    try:
        slots.add(prompt.ids, prompt.params, prompt.n)
        choices = [
            Choice(
                index=i,
                parser=ReplyParser(state.fmt, prompt.mode, prompt.tools, prompt.plan) if state.fmt else None,
                stops=StopStrings(prompt.stops) if prompt.stops else None,
            )
            for i in range(prompt.n)
        ]
    except BaseException:
        slots.release()
        raise
    return slots, choices
