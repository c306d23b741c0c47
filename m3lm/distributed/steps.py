"""Step messages from rank 0 to the followers: plain int64 tensors over the control group.

Every message is a fixed header [op, T, B, R, W] then, when it has one, a payload:
INIT   payload [num_pages, has_window, index_fp8, table_width, window bits]: a new engine's KV
       pool, MSA option and decode table width
STEP   payload tokens [T], q_lens [B], starts [B], logits rows [R], block tables [B, W] (-1 pad)
STOP   no payload: the followers leave their loop
No pickle: a message is numbers only, decoded by shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from m3lm.distributed.parallel import ParallelConfig

STOP, INIT, STEP = 0, 1, 2
HEADER = 5


@dataclass(frozen=True)
class Step:
    tokens: list[int]
    q_lens: list[int]
    starts: list[int]
    rows: list[int]
    tables: list[list[int]]


INIT_SIZE = 5  # num_pages, has a window, index_fp8, table_width, the window's float64 bits


@dataclass(frozen=True)
class Init:
    num_pages: int
    msa_dense_window: float | None
    index_fp8: bool = False
    table_width: int = 0  # pages per row of the decode rows' block table (`forward_step`)


def encode_step(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """-> header [5], payload [T + 2B + R + B*W] (int64)."""
    b = len(step.q_lens)
    width = max((len(t) for t in step.tables), default=0)
    tables = [t + [-1] * (width - len(t)) for t in step.tables]
    flat = [*step.tokens, *step.q_lens, *step.starts, *step.rows, *(x for t in tables for x in t)]
    header = torch.tensor([STEP, len(step.tokens), b, len(step.rows), width], dtype=torch.int64)
    return header, torch.tensor(flat, dtype=torch.int64)


def decode_step(header: torch.Tensor, payload: torch.Tensor) -> Step:
    _, t, b, r, w = header.tolist()
    flat = payload.tolist()
    tokens, q_lens, starts, rows = flat[:t], flat[t : t + b], flat[t + b : t + 2 * b], flat[t + 2 * b :][:r]
    body = flat[t + 2 * b + r :]
    tables = [[x for x in body[i * w : (i + 1) * w] if x >= 0] for i in range(b)]
    return Step(tokens, q_lens, starts, rows, tables)


def encode_init(init: Init) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.tensor([init.msa_dense_window or 0.0], dtype=torch.float64).view(torch.int64)
    has = int(init.msa_dense_window is not None)
    head = [init.num_pages, has, int(init.index_fp8), init.table_width]
    payload = torch.cat([torch.tensor(head, dtype=torch.int64), window])
    return torch.tensor([INIT, 0, 0, 0, 0], dtype=torch.int64), payload


def decode_init(payload: torch.Tensor) -> Init:
    num_pages, has, index_fp8, width = payload[:4].tolist()
    window = float(payload[4:].view(torch.float64)[0])
    return Init(num_pages, window if has else None, bool(index_fp8), width)


def send(pc: ParallelConfig, message: Step | Init | None) -> None:
    """Rank 0: broadcast a step, an engine's init, or STOP (None) to the followers."""
    if pc.world == 1:
        return
    if message is None:
        header, payload = torch.tensor([STOP, 0, 0, 0, 0], dtype=torch.int64), None
    elif isinstance(message, Init):
        header, payload = encode_init(message)
    else:
        header, payload = encode_step(message)
    dist.broadcast(header, 0, group=pc.control)
    if payload is not None:
        dist.broadcast(payload, 0, group=pc.control)


def receive(pc: ParallelConfig) -> Step | Init | None:
    """A follower: wait for rank 0's next message (None = STOP)."""
    header = torch.empty(HEADER, dtype=torch.int64)
    dist.broadcast(header, 0, group=pc.control)
    op, t, b, r, w = header.tolist()
    if op == STOP:
        return None
    size = INIT_SIZE if op == INIT else t + 2 * b + r + b * w
    payload = torch.empty(size, dtype=torch.int64)
    dist.broadcast(payload, 0, group=pc.control)
    return decode_init(payload) if op == INIT else decode_step(header, payload)
