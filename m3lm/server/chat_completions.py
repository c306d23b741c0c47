"""`POST /v1/chat/completions`: the chat pipeline (`handlers.prepare_chat`) written as OpenAI's
chat completion, whole or as `chat.completion.chunk` events."""

from __future__ import annotations

import secrets
import time

from fastapi import Request

from m3lm.core import StepOutput
from m3lm.server.choice import Choice, OpenAIWriter, prompt_logprobs_field, token_logprobs, usage
from m3lm.server.handlers import ServerState, admit_chat, prepare_chat
from m3lm.server.protocol import ChatCompletionRequest
from m3lm.server.reply_lifecycle import answer
from m3lm.text.reasoning import ReplyEvent, to_openai_delta


async def chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    prompt = await prepare_chat(state, req, request)
    slots, choices = admit_chat(state, prompt, request)
    writer = ChatWriter(req, state, "chatcmpl-" + secrets.token_hex(12), int(time.time()), len(prompt.ids))
    return await answer(state, request, slots, choices, writer, req.stream)


class ChatWriter(OpenAIWriter):
    object = "chat.completion.chunk"

    def __init__(
        self, req: ChatCompletionRequest, state: ServerState, rid: str, created: int, prompt_tokens: int
    ):
        super().__init__(req, state.model_name, rid, created, prompt_tokens)
        self.tokenizer = state.tokenizer

    def whole(self, choices: list[Choice]) -> dict:
        req = self.req
        return {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": c.index,
                    "message": c.message(),
                    "logprobs": {"content": c.logprobs} if c.logprobs else None,
                    "finish_reason": c.finish,
                    **prompt_logprobs_field(self.tokenizer, req, c),
                }
                for c in choices
            ],
            "usage": usage(self.prompt_tokens, choices, req.n),
        }

    def _delta(self, index: int, delta: dict, logprobs=None, finish: str | None = None) -> bytes:
        return self.chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

    def opening(self) -> list[bytes]:
        return [self._delta(i, {"role": "assistant", "content": ""}) for i in range(self.req.n)]

    async def chunks(self, c: Choice, out: StepOutput, events: list[ReplyEvent]) -> list[bytes]:
        """One delta a reply event (the first carries the output's logprobs), then the finish."""
        lps = token_logprobs(self.tokenizer, out) if out.new_logprobs else []
        deltas = [to_openai_delta(ev) for ev in events] or ([{}] if lps else [])
        data = [
            self._delta(c.index, d, {"content": lps} if lps and j == 0 else None)
            for j, d in enumerate(deltas)
        ]
        if c.finish is not None:
            data.append(self._delta(c.index, {}, finish=c.finish))
        return data
