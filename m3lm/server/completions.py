"""`POST /v1/completions`: prompts as text or token ids, written as OpenAI's text completion,
whole or as events; `echo`, `text_offset`, vLLM's `prompt_logprobs` and `return_token_ids`."""

from __future__ import annotations

import secrets
import time
from dataclasses import replace

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from m3lm.core import StepOutput
from m3lm.server.choice import (
    Choice,
    OpenAIWriter,
    check_prompt_logprobs,
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs_field,
    token_logprobs,
    usage,
)
from m3lm.server.handlers import ApiError, ServerState, Slots, check_rules, tenant_salt
from m3lm.server.protocol import CompletionRequest
from m3lm.server.reply_lifecycle import answer
from m3lm.server.structured import completion_rules
from m3lm.text.reasoning import ReplyEvent
from m3lm.text.tool_calls import ContentDelta


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
        ids = [await _prompt_ids(state, p) for p in prompts]
        per_token = (req.prompt_logprobs + 1 if req.prompt_logprobs is not None else 0) + (
            req.logprobs + 1 if req.echo and req.logprobs is not None else 0
        )
        if per_token:
            check_prompt_logprobs(sum(map(len, ids)), per_token, req.n)
        params = req.sampling(
            state.defaults, req.output_limit(), req.logprobs, req.stops(), prompt_logprobs=req.scored_prompt()
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
    except BaseException:
        slots.release()
        raise
    writer = CompletionWriter(
        req, state, "cmpl-" + secrets.token_hex(12), int(time.time()), sum(map(len, ids))
    )
    return await answer(state, request, slots, choices, writer, req.stream)


async def _prompt_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    """A prompt's ids: text tokenized (refused unread when it cannot fit), ids as they are (they
    are checked once, as every prompt is, on admission: `AsyncEngine.add`)."""
    if not isinstance(prompt, str):
        return list(prompt)
    if state.tokenizer is None:
        raise ValueError("this model has no tokenizer; send token ids")
    state.tokenizer.check_fits(prompt, state.max_prompt_tokens)
    return await run_in_threadpool(state.tokenizer.encode, prompt)


class CompletionWriter(OpenAIWriter):
    object = "text_completion"

    def __init__(
        self, req: CompletionRequest, state: ServerState, rid: str, created: int, prompt_tokens: int
    ):
        super().__init__(req, state.model_name, rid, created, prompt_tokens)
        self.state, self.tokenizer = state, state.tokenizer
        # token ids in the reply: asked for, or the only form of the output without a tokenizer
        self.ids = bool(req.return_token_ids) or state.tokenizer is None

    def whole(self, choices: list[Choice]) -> dict:
        req, tok = self.req, self.tokenizer
        echo_lps = req.echo and req.logprobs is not None
        return {
            "id": self.rid,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": c.index,
                    "text": (c.echo or "") + "".join(c.content),
                    "logprobs": completion_logprobs((echo_logprobs(tok, c) if echo_lps else []) + c.logprobs),
                    "finish_reason": c.finish,
                    **({"token_ids": c.token_ids} if self.ids else {}),
                    **prompt_logprobs_field(tok, req, c),
                }
                for c in choices
            ],
            "usage": usage(self.prompt_tokens, choices, req.n),
        }

    def _text(self, index: int, text: str, extra: dict | None = None, finish: str | None = None) -> bytes:
        extra = dict(extra or {})
        logprobs = extra.pop("logprobs", None)
        return self.chunk(
            [{"index": index, "text": text, **extra, "logprobs": logprobs, "finish_reason": finish}]
        )

    async def chunks(self, c: Choice, out: StepOutput, events: list[ReplyEvent]) -> list[bytes]:
        """The echoed prompt first (with its logprobs if asked), then a piece of text a reply
        event with the output's token ids and logprobs on the first, then the finish."""
        data = [await self._echo(c, out)] if c.echo is not None else []
        lps = token_logprobs(self.tokenizer, out) if out.new_logprobs else []
        texts = [ev.text for ev in events if isinstance(ev, ContentDelta)]
        if (lps or (self.ids and out.new_token_ids)) and not texts:
            texts = [""]
        for j, text in enumerate(texts):
            extra = {"token_ids": out.new_token_ids} if self.ids and j == 0 else {}
            if lps and j == 0:
                extra["logprobs"] = completion_logprobs(lps, c.offset)
                c.offset += sum(len(e["token"]) for e in lps)
            data.append(self._text(c.index, text, extra))
        if c.finish is not None:
            data.append(self._text(c.index, "", finish=c.finish))
        return data

    async def _echo(self, c: Choice, out: StepOutput) -> bytes:
        """The prompt's text, and its tokens' logprobs when asked (built off the event loop)."""
        c.prompt_logprobs = out.prompt_logprobs
        head = (
            await self.state.offload(echo_logprobs, self.tokenizer, c)
            if c.prompt_logprobs is not None
            else []
        )
        extra = {"logprobs": completion_logprobs(head, c.offset)} if head else {}
        c.offset += sum(len(e["token"]) for e in head)
        echo, c.echo = c.echo, None
        return self._text(c.index, echo, extra)
