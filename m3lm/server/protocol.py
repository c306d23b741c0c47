"""Request bodies of the OpenAI-compatible API, their limits, and the error object.

Unknown fields are accepted and ignored (logged, a bounded summary per request), as vLLM does;
wrong types, out-of-range values, unpaired surrogates in text, containers nested deeper than
MAX_NESTING, and fields whose meaning the server does not implement (rather than silently
ignoring them) are a 400.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from m3lm.core import SamplingParams

log = logging.getLogger("m3lm.server")
_warned_fields: set[str] = set()  # unknown names already logged, at most _MAX_WARNED of them
_MAX_WARNED = 256
_NAMES_PER_LINE = 8
_TOKEN_ID = re.compile(r"[0-9]{1,18}")  # ASCII digits only: str.isdigit() also takes "١٢" or "²"


MAX_NESTING = 64  # containers within containers in a request body: no schema or template needs more
_SCALARS = frozenset({int, float, bool, type(None)})
BODY_SLACK = 1 << 20  # room in a request body for what is not its prompts: sampling fields, stops, ...


def check_json(value: Any) -> None:
    """Raise ValueError for a body nested deeper than MAX_NESTING, or holding a string (key or
    value) with an unpaired UTF-16 surrogate, which JSON can escape ("\\ud800") but no UTF-8 text
    can hold. Walked with a stack of its own, so no input can exhaust the interpreter's."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            _check_text(v, where)
            continue
        if isinstance(v, dict):
            items: Any = v.items()
        elif isinstance(v, list):
            if _SCALARS.issuperset(map(type, v)):  # token ids: one pass in C, nothing to look into
                continue
            items = enumerate(v)
        else:
            continue
        if depth >= MAX_NESTING:
            raise ValueError(f"{where or 'the request'} nests containers deeper than {MAX_NESTING} levels")
        for k, x in items:
            if isinstance(k, str):
                _check_text(k, where)
            # only what can fail is pushed (a long list of token ids costs a type check each)
            if isinstance(x, (dict, list)) or (isinstance(x, str) and not x.isascii()):
                stack.append(
                    (x, depth + 1, f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}".lstrip("."))
                )


def _check_text(text: str, where: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where or 'a string'} holds an unpaired surrogate (invalid Unicode)") from None


class _Body(BaseModel):
    """A request body: bounded nesting, valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_json(cls, data: Any) -> Any:
        check_json(data)
        return data

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
    # with several API keys, engine requests (running and waiting) one may hold at once; None: half
    # of what the server holds (max_num_seqs + max_queue), so that one key cannot fill it for the rest
    max_requests_per_key: int | None = None
    keepalive_s: float = 10.0  # a stream with nothing to send sends an SSE comment this often
    header_timeout_s: float = 10.0  # for a request's headers to arrive, from the connection's start
    body_timeout_s: float = 30.0  # for its body to arrive, once the headers have
    idle_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    write_timeout_s: float = 30.0  # a client that reads nothing of a response for this long is cut off
    engine_timeout_s: float = 5.0  # the engine not heard from this long is stalled (heartbeats: 5x as often)
    max_connections: int = 4096  # beyond this the longest idle connection is closed, or the new one gets 503


def body_bound(limits: Limits, max_prompt_tokens: int, max_token_chars: int | None) -> int:
    """The largest request body worth reading, so that a body that cannot be a request is refused
    (413) before it is read and parsed: `max_n` prompts of `max_prompt_tokens` tokens, each token
    written at its longest in JSON (a character escaped as a surrogate pair is 12 bytes; an id, its
    comma and a space 24), plus `BODY_SLACK`. `max_token_chars` None: text prompts have no such
    bound (the tokenizer may drop characters), so only `limits.max_body_bytes` applies."""
    if max_token_chars is None:
        return limits.max_body_bytes
    per_token = max(24, 12 * max_token_chars)
    return min(limits.max_body_bytes, limits.max_n * max_prompt_tokens * per_token + BODY_SLACK)


# OpenAI's `code` is a string or null (its clients type it so); the HTTP status is the response's
_OPENAI_CODES = {
    401: "invalid_api_key",
    404: "not_found",
    408: "timeout",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "service_unavailable",
}


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, status: int | None = None
) -> dict:
    """OpenAI's error object; `status` (the HTTP status) picks its `code`."""
    code = _OPENAI_CODES.get(status) if status is not None else None
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ANTHROPIC_PATH = "/v1/messages"  # its routes answer errors in Anthropic's shape
_ANTHROPIC_TYPES = {"service_unavailable": "overloaded_error", "internal_error": "api_error"}


def anthropic_error_body(
    message: str, type_: str = "invalid_request_error", status: int | None = None
) -> dict:
    """Anthropic's error object, its type named in Anthropic's words."""
    kind = "request_too_large" if status == 413 else _ANTHROPIC_TYPES.get(type_, type_)
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(
    path: str,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    status: int | None = None,
) -> dict:
    """The error object of the API `path` belongs to: Anthropic's under /v1/messages, else OpenAI's."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return anthropic_error_body(message, type_, status)
    return error_body(message, type_, param, status)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def documented_errors(*codes: int) -> dict:
    """OpenAPI `responses` entries for the error statuses a route can answer."""
    return {c: {"model": ErrorResponse} for c in codes}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


def _bounded(name: str):
    """An optional sampling field within `SamplingParams.BOUNDS[name]`, the one home of the ranges."""
    b = SamplingParams.BOUNDS[name]
    return Field(None, **({"gt": b.low} if b.open_low else {"ge": b.low}), le=b.high)


class _Request(_Body):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0: only with echo or prompt_logprobs
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    top_k: int | None = _bounded("top_k")
    min_p: float | None = _bounded("min_p")
    presence_penalty: float | None = _bounded("presence_penalty")
    frequency_penalty: float | None = _bounded("frequency_penalty")
    repetition_penalty: float | None = _bounded("repetition_penalty")
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
    prompt_logprobs: int | None = Field(None, ge=0)  # vLLM's: each prompt token's logprob + top k
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension: json, regex, choice, grammar

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
        if not all(stops):
            raise ValueError("stop strings must not be empty")
        if (self.prompt_logprobs or 0) > limits.max_top_logprobs:
            raise ValueError(
                f"prompt_logprobs = {self.prompt_logprobs} exceeds the limit of {limits.max_top_logprobs}"
            )
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream = true")
        if len(self.stop_token_ids or []) > 256:
            raise ValueError("at most 256 stop_token_ids")

    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs; its keys are token ids written as decimal strings,
        and two spellings of one id ("17", "017") are refused rather than added up."""
        pairs: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"logit_bias: {key[:32]!r} is not a token id")
            if (tid := int(key)) in pairs:
                raise ValueError(f"logit_bias: token id {tid} is named more than once")
            pairs[tid] = value
        return tuple(pairs.items())

    def sampling(
        self,
        defaults: SamplingParams,
        max_tokens: int | None,
        logprobs: int | None,
        stops: list[str],
        prompt_logprobs: int | None = None,
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
        base = {k: getattr(defaults, k) for k in SamplingParams.GENERATION_DEFAULTS}
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
            prompt_logprobs=prompt_logprobs,
        )


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


def check_text_parts(parts: Any, text_types: tuple[str, ...]) -> None:
    """Name a content part this model cannot read (an image, audio, a file) rather than its shape."""
    for part in parts if isinstance(parts, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in text_types:
            raise ValueError(f"{kind} parts are not supported: this model reads text")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        check_text_parts(data.get("content") if isinstance(data, dict) else None, ("text",))
        return data

    def for_template(self) -> dict[str, Any]:
        """The fields the API defines (unknown ones are ignored, not shown to the template)."""
        msg = self.model_dump(exclude_none=True, exclude={"content", *(self.model_extra or {})})
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
    # a level of the served model's (`effort.Efforts`), applied when the request is prepared
    reasoning_effort: str | None = None

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

    def output_limit(self, max_model_len: int) -> int:
        """max_completion_tokens, else max_tokens; unset: until the context ends, as vLLM does (the
        engine caps it to what the context leaves)."""
        given = (m for m in (self.max_completion_tokens, self.max_tokens) if m is not None)
        return next(given, max_model_len)


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
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported (only 1); use n for several choices")
        if self.suffix:
            raise ValueError("suffix is not supported: this model does not fill in the middle")

    def output_limit(self) -> int:
        """max_tokens; unset: 16, OpenAI's default for completions."""
        return 16 if self.max_tokens is None else self.max_tokens

    def scored_prompt(self) -> int | None:
        """How many alternatives to score each prompt token with (None: no prompt scoring):
        for prompt_logprobs, for echo with logprobs, and for echo alone with max_tokens 0."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        if not asked and self.echo and self.max_tokens == 0:
            asked = [0]
        return max(asked, default=None)

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
    tools: list[Tool] | None = None  # rendered with the messages, as chat renders them
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model_config = ConfigDict(strict=True)

    model: str | None = None
    tokens: list[int]
