"""What one forward pass of the model reads besides its tokens: the batch (positions, sequence
lengths, where keys are kept) and its RoPE tables, made once per pass and shared by every layer.

Shapes: T packed tokens, K KV heads, D head width, Di index-key width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from m3lm.layers.rotary import rope_cos_sin, rope_rows


class KVStore(Protocol):
    """Where attention layers keep keys of earlier tokens (the caches implement this).

    `update` appends one sequence's new keys/values for a layer and returns all of that
    sequence's keys/values so far ([Tk, K, D] each); `update_index` does the same for the
    index keys of a sparse layer ([Tk, Di]). `starts` holds each sequence's first new position.
    """

    starts: list[int]

    def update(
        self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def update_index(self, layer: int, seq: int, ik: torch.Tensor) -> torch.Tensor: ...


@dataclass
class ForwardBatch:
    """The packed tokens of one forward pass: sequences laid end to end, never padded.

    positions [T] holds each token's absolute position in its own sequence, q_lens the number
    of tokens each sequence contributes. Without `kv` every sequence starts at position 0 and
    attends only to its own tokens of this pass. With `decode` (B rows) the first B sequences
    are one new token each over the paged caches: their attention is one batched launch per
    layer (the decode kernels), the other sequences' one per sequence.
    """

    positions: torch.Tensor
    q_lens: list[int]
    kv: KVStore | None = None
    msa_dense_window: float | None = None  # opt-in approximation, see EngineConfig
    decode: DecodeBatch | None = None
    # layer id -> the residual stream entering that layer [T, C] (id = layers: the last layer's
    # output), filled by the forward for the ids given (a speculative drafter's inputs)
    capture: dict[int, torch.Tensor | None] | None = None
    _rope: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def rope(self, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R/2] fp32 of `positions`, made on first use (after the first layer's
        projections are queued: a prefill's GPU then starts on a product, not on these small
        launches) and shared by every layer."""
        return _rope_table(self._rope, self.positions, rotary_dim, theta)

    def rope_rows(self, rotary_dim: int, theta: float, head_dim: int) -> tuple[torch.Tensor, ...]:
        """`rotary.rope_rows` of `rope`, made on first use and shared by every layer."""
        return _rope_rows(self._rope, self.positions, rotary_dim, theta, head_dim)

    def first_position(self, seq: int) -> int:
        """Position of sequence `seq`'s first token in this pass (host side, no device read)."""
        return self.kv.starts[seq] if self.kv is not None else 0

    @classmethod
    def full(cls, batch: int, length: int, device: torch.device | str | None = None) -> ForwardBatch:
        """`batch` sequences of `length` tokens each, from position 0, no cache."""
        import torch

        positions = torch.arange(length, device=device).repeat(batch)
        return cls(positions=positions, q_lens=[length] * batch)


@dataclass
class DecodeBatch:
    """One new token for each of B sequences, over the paged caches (the GPU decode path).

    positions [B] long: the new token's position; lens [B] int32 = positions + 1; tables
    [B, MAXP] int32: each sequence's pages; pages/slots [B]: where the new token's keys go.
    A sequence that verifies drafts is several rows at consecutive positions over the same
    table: each row attends to the keys up to its own, written in the same step before any row
    reads them, and selects its own MSA blocks, exactly as one decode step per position would.
    `capture` as in `ForwardBatch`.
    """

    positions: torch.Tensor
    lens: torch.Tensor
    tables: torch.Tensor
    pages: torch.Tensor
    slots: torch.Tensor
    cache: object  # KVCache
    capture: dict[int, torch.Tensor | None] | None = None
    _rope: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def rope(self, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, R/2] fp32 of `positions`, made on first use and shared by every layer."""
        return _rope_table(self._rope, self.positions, rotary_dim, theta)

    def rope_rows(self, rotary_dim: int, theta: float, head_dim: int) -> tuple[torch.Tensor, ...]:
        """`rotary.rope_rows` of `rope`, made on first use and shared by every layer."""
        return _rope_rows(self._rope, self.positions, rotary_dim, theta, head_dim)

    @classmethod
    def build(
        cls, positions: torch.Tensor, tables: torch.Tensor, cache, page_size: int, capture=None
    ) -> DecodeBatch:
        import torch

        pages = tables.gather(1, (positions // page_size)[:, None])[:, 0].long()
        lens = (positions + 1).to(torch.int32)
        return cls(positions, lens, tables, pages, positions % page_size, cache, capture)


def _rope_table(tables: dict, positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple:
    key = (rotary_dim, float(theta))
    if key not in tables:
        tables[key] = rope_cos_sin(positions, rotary_dim, theta)
    return tables[key]


def _rope_rows(tables: dict, positions: torch.Tensor, rotary_dim: int, theta: float, head_dim: int) -> tuple:
    key = (rotary_dim, float(theta), head_dim)
    if key not in tables:
        tables[key] = rope_rows(*_rope_table(tables, positions, rotary_dim, theta), head_dim)
    return tables[key]
