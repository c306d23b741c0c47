"""`POST /v1/chat/completions`: the chat pipeline (`handlers.prepare_chat`) written as OpenAI's
chat completion, whole or as `chat.completion.chunk` events."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

from fastapi import Request

from m3lm.server.choice import Choice, token_logprobs, usage
from m3lm.server.handlers import (
    RequestStream,
    ServerState,
    admit_chat,
    check_output,
    collect_choices,
    collect_unless_gone,
    merge,
    openai_sse,
    owning_stream,
    prepare_chat,
    prompt_logprobs_field,
    sse,
)
from m3lm.server.protocol import ChatCompletionRequest


async def chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    prompt = await prepare_chat(state, req, request)
    slots, choices = admit_chat(state, prompt, request)
    reply = _Reply(state, req, "chatcmpl-" + secrets.token_hex(12), int(time.time()), len(prompt.ids))
    try:
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
        self, state: ServerState, req: ChatCompletionRequest, rid: str, created: int, prompt_tokens: int
    ):
        self.state, self.req, self.rid, self.created, self.prompt_tokens = (
            state,
            req,
            rid,
            created,
            prompt_tokens,
        )

    def whole(self, choices: list[Choice]) -> dict:
        state, req = self.state, self.req
        return {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": state.model_name,
            "choices": [
                {
                    "index": c.index,
                    "message": c.message(),
                    "logprobs": {"content": c.logprobs} if c.logprobs else None,
                    "finish_reason": c.finish,
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
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.state.model_name,
                "choices": choices,
                "usage": totals,
            }
        )

    def _delta(self, index: int, delta: dict, logprobs=None, finish: str | None = None) -> bytes:
        return self._chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

    async def stream(self, streams: list[RequestStream], choices: list[Choice]) -> AsyncIterator[bytes]:
        state, req = self.state, self.req
        for c in choices:
            yield self._delta(c.index, {"role": "assistant", "content": ""})
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
                lps = token_logprobs(state.tokenizer, out) if out.new_logprobs else []
                deltas = c.consume(out) or ([{}] if lps else [])
                for j, d in enumerate(deltas):
                    yield self._delta(i, d, {"content": lps} if lps and j == 0 else None)
                if c.stopped_by_string:
                    streams[i].abort(completed=True)
                if c.finish is not None:
                    yield self._delta(i, {}, finish=c.finish)
        finally:
            await events.aclose()
        if req.stream_options and req.stream_options.include_usage:
            yield self._chunk([], usage(self.prompt_tokens, choices, req.n))
