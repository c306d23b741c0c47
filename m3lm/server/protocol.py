"""Request bodies of the OpenAI-compatible API, their limits, and the error object.

Unknown fields are accepted and ignored (logged, a bounded summary per request), as vLLM does;
wrong types, out-of-range values, unpaired surrogates in text, and fields whose meaning the server
does not implement (rather than silently ignoring them) are a 400.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from m3lm.core import SamplingParams

log = logging.getLogger("m3lm.server")
_warned_fields: set[str] = set()  # unknown names already logged, at most _MAX_WARNED of them
_MAX_WARNED = 256
_NAMES_PER_LINE = 8


def _reject_surrogates(value: Any, where: str = "") -> None:
    """Raise ValueError for a string (key or value) holding an unpaired UTF-16 surrogate, which
    JSON can escape ("\\ud800") but no UTF-8 text can hold."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(
                    f"{where or 'a string'} holds an unpaired surrogate (invalid Unicode)"
                ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _reject_surrogates(k, where)
            _reject_surrogates(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _reject_surrogates(v, f"{where}[{i}]")


class _Body(BaseModel):
    """A request body: its text must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _reject_surrogates(data)
        return data


@dataclass(frozen=True)
class Limits:
    """Caps on amplifying fields, request sizes, connections and the time a client may take."""

    max_n: int = 8
    max_stop: int = 16
    max_stop_chars: int = 256
    max_top_logprobs: int = SamplingParams.MAX_LOGPROBS
    max_messages: int = 4096
    max_body_bytes: int = 8 << 20
    max_header_bytes: int = 32 << 10
    max_queue: int = 256
    keepalive_s: float = 10.0  # a stream with nothing to send sends an SSE comment this often
    header_timeout_s: float = 10.0  # for a request's headers to arrive, from the connection's start
    body_timeout_s: float = 30.0  # for its body to arrive, once the headers have
    idle_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 1024  # connections and requests beyond this get 503


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: int | None = None
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def documented_errors(*codes: int) -> dict:
    """OpenAPI `responses` entries for the error statuses a route can answer."""
    return {c: {"model": ErrorResponse} for c in codes}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _Request(_Body):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=SamplingParams.INT64_RANGE[0], le=SamplingParams.INT64_RANGE[1])
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=SamplingParams.INT64_RANGE[0], le=SamplingParams.INT64_RANGE[1])
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension: json, regex, choice, grammar

    def warn_unknown(self) -> None:
        """One log line for the unknown fields not logged before (remembering a bounded number)."""
        new = sorted((self.model_extra or {}).keys() - _warned_fields)
        if not new:
            return
        room = max(0, _MAX_WARNED - len(_warned_fields))
        _warned_fields.update(new[:room])
        shown = ", ".join(repr(n[:64]) for n in new[:_NAMES_PER_LINE])
        more = f" and {len(new) - _NAMES_PER_LINE} more" if len(new) > _NAMES_PER_LINE else ""
        log.info("ignoring unknown request field(s) %s%s", shown, more)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_limits(self, limits: Limits) -> None:
        """Refuse amplifying values (ValueError -> 400)."""
        if self.n > limits.max_n:
            raise ValueError(f"n = {self.n} exceeds the limit of {limits.max_n}")
        stops = self.stops()
        if len(stops) > limits.max_stop:
            raise ValueError(f"{len(stops)} stop strings exceed the limit of {limits.max_stop}")
        if any(len(s) > limits.max_stop_chars for s in stops):
            raise ValueError(f"stop strings are limited to {limits.max_stop_chars} characters")
        if len(self.stop_token_ids or []) > 256:
            raise ValueError("at most 256 stop_token_ids")

    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs; its keys are token ids written as strings."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or len(key) > 12:
                raise ValueError(f"logit_bias: {key[:32]!r} is not a token id")
            pairs.append((int(key), value))
        return tuple(pairs)

    def sampling(
        self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None, stops: list[str]
    ) -> SamplingParams:
        fields = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
        }
        base = {
            k: getattr(defaults, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        }
        base.update({k: v for k, v in fields.items() if v is not None})
        return SamplingParams(
            **base,
            stop=tuple(stops),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.bias(),
            cache_salt=self.cache_salt,
        )


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    def for_template(self) -> dict[str, Any]:
        msg = self.model_dump(exclude_none=True, exclude={"content"})
        if isinstance(self.content, list):
            msg["content"] = "".join(p.text for p in self.content)
        else:
            msg["content"] = self.content or ""
        return msg


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true: calls always follow `parameters` (constrained decoding)


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"] = "function"
    function: FunctionDef


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's field: reasoning tokens after which the closer is forced
    thinking_token_budget: int | None = Field(None, ge=0)

    def check_limits(self, limits: Limits) -> None:
        super().check_limits(limits)
        if len(self.messages) > limits.max_messages:
            raise ValueError(f"{len(self.messages)} messages exceed the limit of {limits.max_messages}")
        if (self.top_logprobs or 0) > limits.max_top_logprobs:
            raise ValueError(
                f"top_logprobs = {self.top_logprobs} exceeds the limit of {limits.max_top_logprobs}"
            )

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    return_token_ids: bool = False  # each choice (each chunk, streaming) lists its new token ids
    best_of: int | None = None
    suffix: str | None = None

    def check_limits(self, limits: Limits) -> None:
        super().check_limits(limits)
        if (self.logprobs or 0) > limits.max_top_logprobs:
            raise ValueError(f"logprobs = {self.logprobs} exceeds the limit of {limits.max_top_logprobs}")
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported (only 1); use n for several choices")
        if self.suffix:
            raise ValueError("suffix is not supported: this model does not fill in the middle")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        if not p:
            raise ValueError("the prompt is empty")
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(_Body):
    model_config = ConfigDict(strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    model: str | None = None
    tokens: list[int]
