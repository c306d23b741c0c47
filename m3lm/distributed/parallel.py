"""The process group of a sharded model and its collectives (no-ops on one process).

Activations are replicated on every rank; a layer whose weights are split leaves a partial sum
(row-parallel projections, local experts) that `all_reduce` completes, and the vocab-parallel
lm_head leaves a slice of the logits that `all_gather` joins. Step messages from rank 0 go over a
separate gloo group with a long timeout, so idle followers can wait for requests indefinitely
while the compute group keeps a short timeout that turns a dead peer into an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class ParallelConfig:
    """This process's place in a tensor-parallel group of `world` ranks.

    `ep` partitions the routed experts across ranks (whole experts per rank); without it every
    expert's width I is split. `control` is the gloo group that carries step messages.
    """

    world: int = 1
    rank: int = 0
    ep: bool = False
    control: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"tensor-parallel size {self.world!r} must be an integer >= 1")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside [0, {self.world})")


SINGLE = ParallelConfig()


def init_group(
    pc: ParallelConfig, backend: str, init_method: str = "env://", timeout_s: float = 600.0
) -> ParallelConfig:
    """Join the default process group (compute) and create the control group; returns pc with it."""
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=pc.rank,
        world_size=pc.world,
        timeout=timedelta(seconds=timeout_s),
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return replace(pc, control=control)


def all_reduce(x: torch.Tensor, pc: ParallelConfig) -> torch.Tensor:
    """Sum of the ranks' partial results (in place); x itself on one process."""
    if pc.world == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, pc: ParallelConfig) -> torch.Tensor:
    """The ranks' slices [..., n] joined along the last dim -> [..., world * n]."""
    if pc.world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(pc.world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
