"""One choice of an OpenAI reply (its text is `m3lm.text.reply.ReplyText`'s), the usage and
logprob objects of the OpenAI responses, and what OpenAI's two writers share (`OpenAIWriter`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from m3lm.core import StepOutput, TokenLogprob
from m3lm.server.protocol import error_body
from m3lm.text.reasoning import ReplyEvent
from m3lm.text.reply import ReplyText


@dataclass
class Choice(ReplyText):
    """One choice of an OpenAI reply: its text (`ReplyText`), logprobs, echo and cached tokens."""

    index: int = 0
    logprobs: list[dict] = field(default_factory=list)
    cached: int = 0  # prompt tokens found in the prefix cache
    prompt_ids: list[int] | None = None
    echo: str | None = None  # the prompt's text, to come before the reply (completions' echo)
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1, 2, ..., when scored
    offset: int = 0  # text_offset of the next logprob entry (streaming)

    def events(self, out: StepOutput) -> list[ReplyEvent]:
        self.cached = out.num_prefix_cached
        return super().events(out)

    def message(self) -> dict:
        return self.parsed().message()


# Prompt logprob entries one reply may list (prompt tokens x alternatives x choices): such a
# reply grows with the prompt, so past this it is a 400 before anything runs.
MAX_PROMPT_LOGPROBS = 1 << 18


def check_prompt_logprobs(prompt_tokens: int, per_token: int, n: int) -> None:
    """ValueError when a reply scoring `prompt_tokens` tokens with `per_token` entries each (the
    token and its alternatives, in every form asked for) in each of `n` choices is too large."""
    entries = prompt_tokens * per_token * n
    if entries > MAX_PROMPT_LOGPROBS:
        raise ValueError(
            f"this reply would list {entries:,} prompt logprobs ({prompt_tokens} prompt tokens x "
            f"{per_token} entries x n = {n}), over this server's bound of {MAX_PROMPT_LOGPROBS:,}: "
            "ask for fewer alternatives, fewer choices or a shorter prompt"
        )


# What a logprob that is -inf (a token structured output forbids) is sent as, whole and streamed:
# JSON has no infinity, and OpenAI's schema has no null there.
LOGPROB_FLOOR = -9999.0


def _floor(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR


def _token_text(tokenizer, tid: int) -> str:
    return tokenizer.decode([tid]) if tokenizer is not None else str(tid)


def _entries(tokenizer, lps: list[TokenLogprob]) -> list[dict]:
    def entry(tid: int, lp: float | None) -> dict:
        text = _token_text(tokenizer, tid)
        return {"token": text, "logprob": _floor(lp), "bytes": list(text.encode())}

    return [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
    ]


def token_logprobs(tokenizer, out: StepOutput) -> list[dict]:
    return _entries(tokenizer, out.new_logprobs)


def echo_logprobs(tokenizer, c: Choice) -> list[dict]:
    """Logprob entries of the prompt's tokens: the first has none (nothing scores it)."""
    first = _token_text(tokenizer, c.prompt_ids[0])
    head = {"token": first, "logprob": None, "bytes": list(first.encode()), "top_logprobs": None}
    return [head, *_entries(tokenizer, c.prompt_logprobs or [])]


def vllm_prompt_logprobs(tokenizer, c: Choice, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None, then for each later prompt token a map from token id (as
    a string) to its logprob, rank and text, for the token and the k most likely ones."""

    def one(lp: TokenLogprob) -> dict:
        top = {str(t): (v, r) for r, (t, v) in enumerate(lp.top[:k], 1)}
        top.setdefault(str(lp.token_id), (lp.logprob, lp.rank))
        return {
            t: {"logprob": _floor(v), "rank": r, "decoded_token": _token_text(tokenizer, int(t))}
            for t, (v, r) in top.items()
        }

    return [None, *(one(lp) for lp in c.prompt_logprobs or [])]


def usage(prompt_tokens: int, choices: list[Choice], per_prompt: int = 1) -> dict:
    """The usage object; choices are `per_prompt` consecutive ones for each prompt, and a
    prompt's cached tokens are the fewest any of its choices found."""
    completion = sum(c.tokens for c in choices)
    groups = [choices[i : i + per_prompt] for i in range(0, len(choices), per_prompt)]
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": sum(min(c.cached for c in g) for g in groups)},
        "completion_tokens_details": {"reasoning_tokens": sum(c.reasoning_tokens for c in choices)},
    }


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict | None:
    """The legacy completions `logprobs` object of logprob entries; `text_offset` counts the
    entries' token texts from `offset` (as the tokens list them)."""
    if not entries:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
            for e in entries
        ],
        "text_offset": offsets,
    }


def prompt_logprobs_field(tokenizer, req, c: Choice) -> dict:
    """vLLM's `prompt_logprobs` of a choice, when the request asked for it."""
    if req.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": vllm_prompt_logprobs(tokenizer, c, req.prompt_logprobs)}


_json = msgspec.json.Encoder().encode


def sse(obj: dict) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"


class OpenAIWriter:
    """What chat completions and completions write alike (`reply_lifecycle`'s writer): comment
    keep-alives, an error event and `[DONE]` after a failure, the usage chunk when
    `stream_options.include_usage` asks, then `[DONE]`. Each chunk carries the reply's id, object
    name, creation time and model."""

    object = ""

    def __init__(self, req, model: str, rid: str, created: int, prompt_tokens: int):
        self.req, self.model, self.rid, self.created, self.prompt_tokens = (
            req,
            model,
            rid,
            created,
            prompt_tokens,
        )

    def opening(self) -> list[bytes]:
        return []

    def keepalive(self) -> bytes:
        return b": keep-alive\n\n"

    def take(self, c: Choice, events: list) -> None:
        pass  # the whole reply is written from its choices

    def chunk(self, choices: list[dict], totals: dict | None = None) -> bytes:
        body = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model}
        return sse({**body, "choices": choices, "usage": totals})

    def closing(self, choices: list[Choice]) -> list[bytes]:
        req, done = self.req, [b"data: [DONE]\n\n"]
        if req.stream_options and req.stream_options.include_usage:
            return [self.chunk([], usage(self.prompt_tokens, choices, req.n)), *done]
        return done

    def failed(self, e) -> list[bytes]:
        return [sse(error_body(e.message, e.type, status=e.status)), b"data: [DONE]\n\n"]
