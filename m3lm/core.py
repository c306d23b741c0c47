"""Plain types shared by the two processes: the server and the engine.

Importing this module imports no torch: the server process shares `SamplingParams`, `StepOutput`
and the request checks, and runs no model. (The model's batch types are `layers.batch`'s.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec


@dataclass(frozen=True)
class StructuredOutput:
    """What the answer must match, compiled into a grammar that masks the logits (xgrammar).

    kind and value: "json" (a JSON schema, as JSON text), "json_object" (any JSON object; value
    unused), "regex", "choice" (a JSON list of strings: the answer is one of them), "grammar" (EBNF
    in xgrammar's dialect), "structural_tag" (xgrammar's structural tag, as JSON text). `markers`
    maps marker texts to special token ids: wherever the grammar writes a marker it must be that
    one token (how M3's tool-call tokens are kept whole), and no other special token is allowed.
    """

    kind: Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
    value: str = ""
    markers: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class ThinkingControl:
    """Where a request's reasoning is, on the think-marker token ids, and how long it may run.

    mode: "enabled" (the reply starts inside reasoning), "disabled" (no reasoning), "adaptive"
    (the first token decides: the opener starts reasoning, the closer or anything else starts the
    answer). A structured output applies to the answer only. `budget`: after that many reasoning
    tokens the closer is forced.
    """

    mode: Literal["enabled", "disabled", "adaptive"]
    start_id: int
    end_id: int
    budget: int | None = None


FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop; the defaults may come from generation_config.json.

    temperature 0 means greedy. top_k <= 0, top_p = 1 and min_p = 0 switch those filters off.
    `logprobs` asks for the chosen token's log-probability plus that many top alternatives
    (0 = the chosen token only, None = none). `seed` makes sampling reproducible per request.
    `logit_bias` adds (token id, bias) to the logits before anything else. Only requests with the
    same `cache_salt` share prefix-cache pages. `prompt_logprobs` asks for each prompt token's
    log-probability under the model (raw log-softmax, no sampling settings) plus that many top
    alternatives; such a request computes its whole prompt (no cached prefix), and with it
    `max_tokens` may be 0 (score the prompt, generate nothing).
    `structured` constrains the answer to a grammar; `thinking` says where the answer starts (and
    may bound the reasoning).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    thinking: ThinkingControl | None = None

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 1024  # entries: more would make every step's bias tensor a request's to size
    INT64_RANGE = (-(2**63), 2**63 - 1)  # seed and top_k: signed 64-bit integers, as the sampler holds them
    # Below this a temperature is greedy: dividing logits by it would overflow float32 (vLLM's bound).
    MIN_TEMPERATURE = 1e-5

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> None:
            value = repr(getattr(self, name))  # shown in part: an error never echoes a huge value
            raise ValueError(f"{name} = {value if len(value) <= 80 else value[:60] + ' ...'}: {rule}")

        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        lo, hi = self.INT64_RANGE
        if any(not 0 <= t <= hi for t in self.stop_token_ids):
            bad("stop_token_ids", "token ids must be in [0, 2^63)")
        if (
            not isinstance(self.max_tokens, int)
            or not (self.prompt_logprobs is None) <= self.max_tokens <= hi
        ):
            bad("max_tokens", "must be an integer in [1, 2^63) (0 only with prompt_logprobs)")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not lo <= self.top_k <= hi:
            bad("top_k", "must be a signed 64-bit integer (<= 0 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        # the sampler holds it as float32: a smaller one would round to 0 and divide logits by it
        if not FLOAT32_TINY <= self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in [{FLOAT32_TINY:.3g}, 10]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= self.MAX_LOGPROBS):
                bad(name, f"must be in [0, {self.MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if self.seed is not None and (not isinstance(self.seed, int) or not lo <= self.seed <= hi):
            bad("seed", "must be a signed 64-bit integer")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
            bad("logit_bias", f"at most {self.MAX_LOGIT_BIAS} entries")
        if any(not 0 <= t <= hi or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            bad("logit_bias", "token ids must be in [0, 2^63) and biases in [-100, 100]")
        if len({t for t, _ in self.logit_bias}) < len(self.logit_bias):
            bad("logit_bias", "names a token id more than once")  # the biases would add up past the cap
        if self.thinking is not None and self.thinking.budget is not None and self.thinking.budget < 0:
            bad("thinking", "budget must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < self.MIN_TEMPERATURE or self.top_k == 1

    @classmethod
    def from_generation_config(cls, gen: dict | None, **overrides) -> SamplingParams:
        """Defaults from a checkpoint's generation_config.json, then the caller's non-None overrides."""
        gen = gen or {}
        base = {}
        if gen.get("do_sample") is False:
            base["temperature"] = 0.0
        else:
            for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
                if isinstance(gen.get(key), (int, float)) and not isinstance(gen.get(key), bool):
                    base[key] = gen[key]
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, best first
    rank: int | None = None  # 1 for the most likely token (prompt logprobs carry it)


class StepOutput(msgspec.Struct, array_like=True):
    """What one request gained in one engine step: the engine fills the ids and sends it to the
    server as it is (`wire.Outputs`); there the text layer (`m3lm.text.TextStream`) fills the text."""

    request_id: str
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    queued_s: float | None = None  # on a request's first output: its wait before it was scheduled
    error: str | None = None  # why, when finish_reason is "error"
    num_prefix_cached: int = 0  # prompt tokens found in the prefix cache
    token_texts: list[str] | None = None  # new_text split by token, when there are several
    # with SamplingParams.prompt_logprobs, on the request's first output: prompt tokens 1, 2, ...
    prompt_logprobs: list[TokenLogprob] | None = None

    def extend(self, later: StepOutput) -> StepOutput:
        """This output followed by a later one of the same request, as one output."""
        texts = (self.token_texts or [self.new_text]) + (later.token_texts or [later.new_text])
        self.token_texts = texts
        self.new_token_ids = self.new_token_ids + later.new_token_ids
        self.new_text += later.new_text
        self.new_logprobs = self.new_logprobs + later.new_logprobs
        self.finished, self.finish_reason, self.error = later.finished, later.finish_reason, later.error
        self.num_prefix_cached = later.num_prefix_cached
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        return self


def check_prompt_length(n: int, max_model_len: int) -> None:
    """Raise ValueError when a prompt of `n` tokens leaves no room for a generated one."""
    if n >= max_model_len:
        raise ValueError(
            f"this model's maximum context length is {max_model_len} tokens and the prompt has "
            f"{n}: the context holds {max_model_len} (prompt plus at least one generated token)"
        )


def validate_request(
    prompt_ids: list[int], params: SamplingParams | None, max_model_len: int, vocab: int
) -> None:
    """Raise ValueError for an empty, too long or out-of-vocabulary prompt, or a logit bias or
    stop token id outside the vocabulary."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    check_prompt_length(len(prompt_ids), max_model_len)
    bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    if params is None:
        return
    bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t in params.stop_token_ids if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
    t = params.thinking if params else None
    if t is not None and not (0 <= t.start_id < vocab and 0 <= t.end_id < vocab):
        raise ValueError(f"thinking: marker ids must be inside the vocabulary [0, {vocab})")
