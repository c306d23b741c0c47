"""`POST /v1/completions`: prompts as text or token ids, written as OpenAI's text completion,
whole or as events; `echo`, `text_offset`, vLLM's `prompt_logprobs` and `return_token_ids`."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from m3lm.core import check_prompt_length
from m3lm.server.choice import (
    Choice,
    check_prompt_logprobs,
    completion_logprobs,
    echo_logprobs,
    token_logprobs,
    usage,
)
from m3lm.server.handlers import (
    ApiError,
    RequestStream,
    ServerState,
    Slots,
    check_output,
    check_rules,
    collect_choices,
    collect_unless_gone,
    merge,
    openai_sse,
    owning_stream,
    prompt_logprobs_field,
    sse,
    tenant_salt,
)
from m3lm.server.protocol import CompletionRequest
from m3lm.server.structured import completion_rules


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
        per_token = (req.prompt_logprobs + 1 if req.prompt_logprobs is not None else 0) + (
            req.logprobs + 1 if req.echo and req.logprobs is not None else 0
        )
        if per_token:
            check_prompt_logprobs(sum(map(len, ids)), per_token, req.n)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params = req.sampling(
            state.defaults, max_tokens, req.logprobs, req.stops(), prompt_logprobs=req.scored_prompt()
        )
        if req.response_format is not None or req.structured_outputs is not None:
            if tok is None:
                raise ValueError("structured output needs the model's tokenizer")
            rules = completion_rules(req)
            await check_rules(state, request, rules)
            params = replace(params, structured=rules)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    slots = Slots(state, getattr(request.state, "tenant", None))
    try:
        for p in ids:
            slots.add(p, params, req.n)
        # echo: the prompt's text as given, or as its ids decode (admitted: ids in the vocabulary)
        echoes = (
            [p if isinstance(p, str) else tok.decode(p) if tok else "" for p in prompts] if req.echo else None
        )
        choices = [
            Choice(index=i, prompt_ids=ids[i // req.n], echo=echoes[i // req.n] if echoes else None)
            for i in range(len(slots.streams))
        ]
        reply = _Reply(state, req, "cmpl-" + secrets.token_hex(12), int(time.time()), sum(map(len, ids)))
        if req.stream:
            return owning_stream(openai_sse(reply.stream(slots.streams, choices)), slots)
        try:
            await collect_unless_gone(request, collect_choices(state, slots.streams, choices))
        finally:
            slots.release()
        return await state.json_reply(reply.whole, choices)
    except BaseException:
        slots.release()
        raise


class _Reply:
    def __init__(
        self, state: ServerState, req: CompletionRequest, rid: str, created: int, prompt_tokens: int
    ):
        self.state, self.req, self.rid, self.created, self.prompt_tokens = (
            state,
            req,
            rid,
            created,
            prompt_tokens,
        )
        # token ids in the reply: asked for, or the only form of the output without a tokenizer
        self.ids = bool(req.return_token_ids) or state.tokenizer is None

    def whole(self, choices: list[Choice]) -> dict:
        state, req = self.state, self.req
        echo_lps = req.echo and req.logprobs is not None
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": state.model_name,
            "choices": [
                {
                    "index": c.index,
                    "text": (c.echo or "") + "".join(c.content),
                    "logprobs": completion_logprobs(
                        (echo_logprobs(state.tokenizer, c) if echo_lps else []) + c.logprobs
                    ),
                    "finish_reason": c.finish,
                    **({"token_ids": c.token_ids} if self.ids else {}),
                    **prompt_logprobs_field(state, req, c),
                }
                for c in choices
            ],
            "usage": usage(self.prompt_tokens, choices, req.n),
        }

    def _chunk(self, choices: list[dict], totals: dict | None = None) -> bytes:
        return sse(
            {
                "id": self.rid,
                "object": "text_completion",
                "created": self.created,
                "model": self.state.model_name,
                "choices": choices,
                "usage": totals,
            }
        )

    def _text(self, index: int, text: str, extra: dict | None = None, finish: str | None = None) -> bytes:
        extra = dict(extra or {})
        logprobs = extra.pop("logprobs", None)
        body = {"index": index, "text": text, **extra, "logprobs": logprobs, "finish_reason": finish}
        return self._chunk([body])

    async def stream(self, streams: list[RequestStream], choices: list[Choice]) -> AsyncIterator[bytes]:
        state, req, tok = self.state, self.req, self.state.tokenizer
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
                check_output(out)
                if c.echo is not None:  # the prompt first: its text, and its tokens' logprobs if asked
                    c.prompt_logprobs = out.prompt_logprobs
                    head = (
                        await self.state.offload(echo_logprobs, tok, c)
                        if c.prompt_logprobs is not None
                        else []
                    )
                    extra = {"logprobs": completion_logprobs(head, c.offset)} if head else {}
                    c.offset += sum(len(e["token"]) for e in head)
                    yield self._text(i, c.echo, extra)
                    c.echo = None
                lps = token_logprobs(tok, out) if out.new_logprobs else []
                deltas = c.consume(out)
                if (lps or (self.ids and out.new_token_ids)) and not deltas:
                    deltas = [{"content": ""}]
                for j, d in enumerate(deltas):
                    extra = {"token_ids": out.new_token_ids} if self.ids and j == 0 else {}
                    if lps and j == 0:
                        extra["logprobs"] = completion_logprobs(lps, c.offset)
                        c.offset += sum(len(e["token"]) for e in lps)
                    yield self._text(i, d.get("content", ""), extra)
                if c.stopped_by_string:
                    streams[i].abort(completed=True)
                if c.finish is not None:
                    yield self._text(i, "", finish=c.finish)
        finally:
            await events.aclose()
        if req.stream_options and req.stream_options.include_usage:
            yield self._chunk([], usage(self.prompt_tokens, choices, req.n))
