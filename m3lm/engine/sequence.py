"""A request as the engine tracks it: token ids, cache progress, finish reason."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from m3lm.core import SamplingParams, TokenLogprob


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_limit: int  # tokens it may generate: params.max_tokens, capped by what the context leaves
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # positions whose keys are in the cache
    num_prefix_cached: int = 0  # prompt positions found in the prefix cache when first admitted
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1, 2, ...
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    constraint: object = None  # constraints.Constraint, for structured output or a thinking budget
    draft_ids: list[int] = field(default_factory=list)  # speculated tokens the next step verifies
    num_drafts: int = 0  # verification steps with drafts (speculative decoding)
    num_accepted: int = 0  # drafts those steps accepted
    lookup: object = None  # speculative.ngram.Lookup, with prompt lookup drafting

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
    def scores_prompt(self) -> bool:
        """Whether prompt logprobs are asked for and not all computed yet: then every prompt
        position is computed (no cached prefix), since each one's logits score the next token."""
        p = self.params.prompt_logprobs is not None
        return p and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    def prompt_rows(self, start: int, n: int) -> range:
        """The positions of the chunk [start, start + n) whose logits score a prompt token not
        scored yet (position p scores token p + 1)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(start + n, len(self.prompt_ids) - 1))

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
