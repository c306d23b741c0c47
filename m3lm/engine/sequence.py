"""A request as the engine tracks it: token ids, cache progress, text state, finish reason."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from m3lm.core import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, best first


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, capped by the context length
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # positions whose keys are in the cache
    num_prefix_cached: int = 0  # prompt positions found in the prefix cache when first admitted
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""  # emitted text so far (stop strings removed)
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    text_state: object = None  # OutputText, when the engine detokenizes
    constraint: object = None  # constraints.Constraint, for structured output or a thinking budget

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without concatenating prompt and output."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.num_tokens - 1
