"""Plain types shared by the model, the caches and the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class KVStore(Protocol):
    """Where attention layers keep keys of earlier tokens (the caches implement this).

    `update` appends one sequence's new keys/values for a layer and returns all of that
    sequence's keys/values so far ([Tk, K, D] each); `update_index` does the same for the
    index keys of a sparse layer ([Tk, Di]).
    """

    def update(
        self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def update_index(self, layer: int, seq: int, ik: torch.Tensor) -> torch.Tensor: ...


@dataclass
class ForwardBatch:
    """The packed tokens of one forward pass: sequences laid end to end, never padded.

    positions [T] holds each token's absolute position in its own sequence, q_lens the number
    of tokens each sequence contributes. Without `kv` every sequence starts at position 0 and
    attends only to its own tokens of this pass.
    """

    positions: torch.Tensor
    q_lens: list[int]
    kv: KVStore | None = None

    @classmethod
    def full(cls, batch: int, length: int, device: torch.device | str | None = None) -> ForwardBatch:
        """`batch` sequences of `length` tokens each, from position 0, no cache."""
        positions = torch.arange(length, device=device).repeat(batch)
        return cls(positions=positions, q_lens=[length] * batch)
