"""Plain types shared by the two processes: the server and the engine.

Importing this module imports no torch: the server process shares `SamplingParams`, `StepOutput`
and the request checks, and runs no model. (The model's batch types are `layers.batch`'s.)
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, NoReturn

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
class Bound:
    """The range a numeric sampling setting must lie in: [low, high], or (low, high] if `open_low`.

    `integer`: the value must also be an int. `optional`: None is allowed too (the setting is off).
    `rule` is what an error says when the plain "must be in [low, high]" would say it badly.
    """

    low: float
    high: float
    open_low: bool = False
    integer: bool = False
    optional: bool = False
    rule: str = ""

    def admits(self, value) -> bool:
        """Whether `value` lies in the range (and is an int, where one is asked for)."""
        if value is None and self.optional:
            return True
        if self.integer and not isinstance(value, int):
            return False
        return self.low < value <= self.high if self.open_low else self.low <= value <= self.high

    def describe(self) -> str:
        """The rule an error states, such as "must be in (0, 1]"."""
        return self.rule or f"must be in {'(' if self.open_low else '['}{self.low:.3g}, {self.high:.3g}]"


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
    # The settings a checkpoint's generation_config.json may give defaults for.
    GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    # The range each numeric setting must lie in, in the order they are checked (an error names the
    # first bad one). The sampler holds repetition_penalty as float32: a smaller one would round to 0
    # and divide logits by it.
    BOUNDS = MappingProxyType(
        {
            "temperature": Bound(0.0, 100.0),
            "top_p": Bound(0.0, 1.0, open_low=True),
            "top_k": Bound(
                *INT64_RANGE, integer=True, rule="must be a signed 64-bit integer (<= 0 disables it)"
            ),
            "min_p": Bound(0.0, 1.0),
            "repetition_penalty": Bound(FLOAT32_TINY, 10.0),
            "presence_penalty": Bound(-2.0, 2.0),
            "frequency_penalty": Bound(-2.0, 2.0),
            "logprobs": Bound(0, MAX_LOGPROBS, integer=True, optional=True),
            "prompt_logprobs": Bound(0, MAX_LOGPROBS, integer=True, optional=True),
        }
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        lo, hi = self.INT64_RANGE
        if any(not 0 <= t <= hi for t in self.stop_token_ids):
            self._bad("stop_token_ids", "token ids must be in [0, 2^63)")
        if (
            not isinstance(self.max_tokens, int)
            or not (self.prompt_logprobs is None) <= self.max_tokens <= hi
        ):
            self._bad("max_tokens", "must be an integer in [1, 2^63) (0 only with prompt_logprobs)")
        for name, bound in self.BOUNDS.items():
            if not bound.admits(getattr(self, name)):
                self._bad(name, bound.describe())
        if any(not isinstance(s, str) or not s for s in self.stop):
            self._bad("stop", "must be non-empty strings")
        if self.seed is not None and (not isinstance(self.seed, int) or not lo <= self.seed <= hi):
            self._bad("seed", "must be a signed 64-bit integer")
        self._settle_logit_bias()
        if self.thinking is not None and self.thinking.budget is not None and self.thinking.budget < 0:
            self._bad("thinking", "budget must be >= 0")

    def _bad(self, name: str, rule: str) -> NoReturn:
        """Raise the ValueError that names a setting, its value and the rule it breaks."""
        value = repr(getattr(self, name))  # shown in part: an error never echoes a huge value
        raise ValueError(f"{name} = {value if len(value) <= 80 else value[:60] + ' ...'}: {rule}")

    def _settle_logit_bias(self) -> None:
        """Make logit_bias (int, float) pairs and check their count, ranges and that ids are unique."""
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
            self._bad("logit_bias", f"at most {self.MAX_LOGIT_BIAS} entries")
        if any(not 0 <= t <= self.INT64_RANGE[1] or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            self._bad("logit_bias", "token ids must be in [0, 2^63) and biases in [-100, 100]")
        if len({t for t, _ in self.logit_bias}) < len(self.logit_bias):
            self._bad("logit_bias", "names a token id more than once")  # the biases would add up past the cap

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
            for key in cls.GENERATION_DEFAULTS:
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
