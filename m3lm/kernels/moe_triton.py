"""Fused MoE on the GPU (Triton), next to `moe.py`'s reference: grouped GEMM over routed experts.

Token-expert pairs are sorted by expert and each expert's group is padded to BLOCK_M rows
(`align`), so one program multiplies BLOCK_M rows of one expert by a BLOCK_N slice of its
weights; every expert's weights are read once per step however many tokens chose it. In
prefill (128-row blocks) a group's short last block runs in a half-height tile (`_block`), or,
when it follows a whole block of its expert and holds few pairs, in that block's programs as
w @ a.T on the weight tiles they load anyway (`_tail`): no program and no weight reads of its
own, and its padding rounds to 16 rows. All shapes are static and nothing syncs with the host
(CUDA-graph safe).

Shapes: T tokens, A experts per token, E experts, C hidden, I expert width, M = T*A pairs,
EM = padded pair slots.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from m3lm.kernels.host import interpreted, precision


class Aligned(NamedTuple):
    """Token-expert pairs grouped by expert, each group padded to a multiple of BLOCK_M slots."""

    sorted_ids: torch.Tensor  # [EM] int32: the pair in each slot, M for padding
    block_expert: torch.Tensor  # [EM / BLOCK_M] int32: the expert of each block of slots
    used: torch.Tensor  # [1] int32: slots in use (the sum of the padded groups)
    ends: torch.Tensor  # [E] int32: the slot after each expert's group (cumulative padded sizes)


def align_ref(ids: torch.Tensor, n_experts: int, block_m: int) -> Aligned:
    """ids [T, A] -> `Aligned`: pairs grouped by expert in pair order, each expert's group padded
    to a multiple of BLOCK_M. EM = M + E * (BLOCK_M - 1) rounded up to BLOCK_M, a static bound.
    """
    flat = ids.flatten()
    m = flat.numel()
    em = _slots(m, n_experts, block_m)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.sort(flat, stable=True).indices  # pairs grouped by expert
    experts = flat[order]
    rank = torch.arange(m, device=ids.device) - (torch.cumsum(counts, 0) - counts)[experts]
    sorted_ids = torch.full((em,), m, dtype=torch.int32, device=ids.device)
    sorted_ids[(ends - padded)[experts] + rank] = order.to(torch.int32)
    starts = torch.arange(0, em, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp(max=n_experts - 1).to(torch.int32)
    return Aligned(sorted_ids, block_expert, ends[-1:].to(torch.int32), ends.to(torch.int32))


def _slots(m: int, n_experts: int, block_m: int) -> int:
    return -(-(m + n_experts * (block_m - 1)) // block_m) * block_m


@triton.jit(do_not_specialize=["M", "EM"])
def _align_kernel(
    ids_ptr, sorted_ptr, expert_ptr, used_ptr, ends_ptr, M, EM,
    E: tl.constexpr, EP: tl.constexpr, MP: tl.constexpr, EMP: tl.constexpr, NBP: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """`align_ref` in one program, for a few pairs (decode): counts, padded offsets, ranks, blocks."""
    offs = tl.arange(0, MP)
    ok = offs < M
    e = tl.load(ids_ptr + offs, mask=ok, other=EP).to(tl.int32)  # padding pairs match no expert
    experts = tl.arange(0, EP)
    onehot = e[:, None] == experts[None, :]  # [MP, EP]
    counts = tl.sum(onehot.to(tl.int32), axis=0)
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)  # [EP]
    start_of = tl.sum(tl.where(onehot, (ends - padded)[None, :], 0), axis=1)  # [MP] its expert's first slot
    earlier = (e[:, None] == e[None, :]) & (offs[None, :] < offs[:, None])
    slot = start_of + tl.sum(earlier.to(tl.int32), axis=1)  # [MP] rank within the expert
    all_slots = tl.arange(0, EMP)
    tl.store(sorted_ptr + all_slots, tl.full([EMP], M, tl.int32), mask=all_slots < EM)
    tl.debug_barrier()
    tl.store(sorted_ptr + slot, offs.to(tl.int32), mask=ok)
    blocks = tl.arange(0, NBP)
    owner = tl.sum((ends[None, :] <= (blocks * BM)[:, None]).to(tl.int32), axis=1)
    tl.store(expert_ptr + blocks, tl.minimum(owner, E - 1), mask=blocks * BM < EM)
    tl.store(used_ptr, tl.max(ends, axis=0))
    tl.store(ends_ptr + experts, ends, mask=experts < E)


ALIGN_KERNEL_MAX_PAIRS = 256  # one program holds [M, M] comparisons; beyond this the PyTorch path


def align(ids: torch.Tensor, n_experts: int, block_m: int) -> Aligned:
    """`align_ref`, in one launch when there are few pairs (a decode step)."""
    m = ids.numel()
    if m > ALIGN_KERNEL_MAX_PAIRS or (not ids.is_cuda and not interpreted()):
        return align_ref(ids, n_experts, block_m)
    em = _slots(m, n_experts, block_m)
    sorted_ids = torch.empty(em, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(em // block_m, dtype=torch.int32, device=ids.device)
    used = torch.empty(1, dtype=torch.int32, device=ids.device)
    ends = torch.empty(n_experts, dtype=torch.int32, device=ids.device)
    _align_kernel[(1,)](
        ids.flatten().contiguous(), sorted_ids, block_expert, used, ends, m, em,
        E=n_experts, EP=triton.next_power_of_2(n_experts), **align_extents(m, n_experts, block_m), BM=block_m,
    )  # fmt: skip
    return Aligned(sorted_ids, block_expert, used, ends)


def align_extents(m: int, n_experts: int, block_m: int) -> dict[str, int]:
    """`_align_kernel`'s tile extents for M pairs: pairs MP, slots EMP, blocks NBP, all from the
    power-of-two bucket MP of M (slots and blocks past EM are masked), so one compile serves every
    M of a bucket."""
    mp = max(16, triton.next_power_of_2(m))
    em = _slots(mp, n_experts, block_m)
    return dict(MP=mp, EMP=triton.next_power_of_2(em), NBP=triton.next_power_of_2(em // block_m))


@triton.jit
def grouped_pid(
    pid, n_programs, expert_ptr, ends_ptr, used_ptr,
    N: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, ALIGN_M: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """(row block, column block) of program `pid` in a grouped order: an expert's row blocks, in
    groups of at most GROUP_M, sweep every column block before the next group starts, so their
    rows (gathered tokens) and the weight tiles they share are read from HBM about once and then
    hit in L2. A group never spans two experts, so an expert's weights are read once per group
    of its own blocks, not again at a group boundary that falls inside it. Programs past the used
    slots (they exit) keep the plain order.

    Expert e's blocks are start..end-1 (`Aligned.ends`), its programs start*n_cols..end*n_cols-1,
    so the block pid // n_cols names the program's expert."""
    n_cols = tl.cdiv(N, BN)
    n_rows = n_programs // n_cols
    block = pid // n_cols
    live = block < tl.load(used_ptr) // BM
    e = tl.load(expert_ptr + tl.minimum(block, n_rows - 1) * BM // ALIGN_M)
    end = tl.load(ends_ptr + e) // BM
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0) // BM
    local = pid - start * n_cols
    per_group = GROUP_M * n_cols
    first = start + (local // per_group) * GROUP_M
    size = tl.maximum(tl.minimum(end - first, GROUP_M), 1)
    row = first + (local % per_group) % size
    col = (local % per_group) // size
    return tl.where(live, row, block), tl.where(live, col, pid % n_cols)


@triton.jit
def _block(sorted_ptr, used_ptr, pid_m, M, BM: tl.constexpr, HALVES: tl.constexpr):
    """(rows to compute, 0 / BM / BM // 2) of row block pid_m: 0 past the used slots or for only
    padding (a group aligned to a larger BLOCK_M). With HALVES (BM = the alignment), a group's
    last block holding at most BM/2 pairs takes a half-height tile: the padding per expert
    averages BM/4 rows instead of BM/2, in the same launch, so the expert's weights are still
    read next to its other blocks (and hit in L2)."""
    start = pid_m * BM  # the grid holds at most the aligned slots: every load below is in bounds
    live = (start < tl.load(used_ptr)) & (tl.load(sorted_ptr + start) < M)
    rows = tl.where(live, BM, 0)
    if HALVES:
        rows = tl.where(live & (tl.load(sorted_ptr + start + BM // 2) >= M), BM // 2, rows)
    return rows


@triton.jit
def _program(
    sorted_ptr, expert_ptr, used_ptr, ends_ptr, M, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ALIGN_M: tl.constexpr, GROUP_M: tl.constexpr, HALVES: tl.constexpr,
):  # fmt: skip
    """This program's (row block, column block, rows to compute (`_block`), expert)."""
    pid_m, pid_n = grouped_pid(
        tl.program_id(0), tl.num_programs(0), expert_ptr, ends_ptr, used_ptr, N, BN, BM, ALIGN_M, GROUP_M
    )
    rows = _block(sorted_ptr, used_ptr, pid_m, M, BM, HALVES)
    return pid_m, pid_n, rows, tl.load(expert_ptr + pid_m * BM // ALIGN_M).to(tl.int64)


@triton.jit
def _tail(sorted_ptr, ends_ptr, e, pid_m, M, BM: tl.constexpr, TAIL: tl.constexpr):
    """(skip, T) for a program of row block pid_m of expert e, with TAIL > 0: an expert's last
    block that holds at most TAIL pairs after a whole block of its own is taken by that block's
    programs (skip); those take it as T extra rows (16, 32 .. TAIL: the fewest that hold it),
    multiplied with the weight tiles they load anyway (`_gemm_merged`, `_gate_up_merged`), so the
    short block costs no program of its own and pads to 16 rows instead of BM / 2."""
    end = tl.load(ends_ptr + e) // BM
    first = tl.load(ends_ptr + e - 1, mask=e > 0, other=0) // BM
    start = pid_m * BM
    skip = (pid_m == end - 1) & (pid_m > first) & (tl.load(sorted_ptr + start + TAIL) >= M)
    t = 0
    if pid_m == end - 2:  # the next block is the last; it may hold padding only past TAIL pairs
        nxt = start + BM
        t = tl.where(tl.load(sorted_ptr + nxt + TAIL) >= M, TAIL, 0)
        if TAIL >= 64:
            t = tl.where(tl.load(sorted_ptr + nxt + 32) >= M, 32, t)
        if TAIL >= 32:
            t = tl.where(tl.load(sorted_ptr + nxt + 16) >= M, 16, t)
    return skip, t


@triton.jit
def _slot_rows(sorted_ptr, start, M, TOP_K, R: tl.constexpr, PAIR_ROWS: tl.constexpr, SKIP: tl.constexpr = 0):
    """(pairs, valid, rows) of the R slots from `start` + SKIP: each slot's pair (M for padding),
    and the row of `a` it multiplies: the pair's own (PAIR_ROWS) or its token's."""
    pairs = tl.load(sorted_ptr + start + SKIP + tl.arange(0, R))
    return pairs, pairs < M, pairs if PAIR_ROWS else pairs // TOP_K


@triton.jit
def _rows_tile(a_ptr, rows, valid, kk, s_am, KDIM: tl.constexpr, COLUMNS: tl.constexpr):
    """a[rows, kk] as [R, BK], or as [BK, R] with COLUMNS; zeros for padding slots and past KDIM."""
    if COLUMNS:
        ptrs = a_ptr + rows[None, :].to(tl.int64) * s_am + kk[:, None]
        ok = valid[None, :] & (kk[:, None] < KDIM)
    else:
        ptrs = a_ptr + rows[:, None].to(tl.int64) * s_am + kk[None, :]
        ok = valid[:, None] & (kk[None, :] < KDIM)
    return tl.load(ptrs, mask=ok, other=0.0)


@triton.jit
def _gemm_rows(
    a_ptr, w_ptr, c_ptr, sorted_ptr, scale_ptr, e, start, pid_n, M, TOP_K, s_am, s_we, s_wn, s_cm,
    N: tl.constexpr, KDIM: tl.constexpr, PAIR_ROWS: tl.constexpr, SCALE: tl.constexpr, PREC: tl.constexpr,
    R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """c[pair] (times scale[pair]) for the R slots from `start`, outputs pid_n*BN.. of expert e."""
    pairs, valid, rows = _slot_rows(sorted_ptr, start, M, TOP_K, R, PAIR_ROWS)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([R, BN], tl.float32)
    for k0 in range(0, KDIM, BK):
        kk = k0 + offs_k
        a = _rows_tile(a_ptr, rows, valid, kk, s_am, KDIM, False)
        w = tl.load(
            w_ptr + e * s_we + offs_n[None, :] * s_wn + kk[:, None],
            mask=(offs_n[None, :] < N) & (kk[:, None] < KDIM),
            other=0.0,
        )
        acc += tl.dot(a, w, out_dtype=tl.float32, input_precision=PREC)
    if SCALE:
        acc = acc * tl.load(scale_ptr + pairs, mask=valid, other=0.0)[:, None]
    out = c_ptr + pairs[:, None].to(tl.int64) * s_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit
def _gemm_merged(
    a_ptr, w_ptr, c_ptr, sorted_ptr, scale_ptr, e, start, pid_n, M, TOP_K, s_am, s_we, s_wn, s_cm,
    N: tl.constexpr, KDIM: tl.constexpr, PAIR_ROWS: tl.constexpr, SCALE: tl.constexpr, PREC: tl.constexpr,
    R: tl.constexpr, T: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """`_gemm_rows` for the R slots from `start` and the T slots after them (the expert's short
    last block), the second as w @ a.T ([BN, T]: the tensor cores' narrow side holds the rows)."""
    pairs, valid, rows = _slot_rows(sorted_ptr, start, M, TOP_K, R, PAIR_ROWS)
    tails, t_valid, t_rows = _slot_rows(sorted_ptr, start, M, TOP_K, T, PAIR_ROWS, R)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([R, BN], tl.float32)
    acc_t = tl.zeros([BN, T], tl.float32)
    for k0 in range(0, KDIM, BK):
        kk = k0 + offs_k
        k_ok = kk < KDIM
        a = _rows_tile(a_ptr, rows, valid, kk, s_am, KDIM, False)  # [R, BK]
        a_t = _rows_tile(a_ptr, t_rows, t_valid, kk, s_am, KDIM, True)  # [BK, T]
        w = tl.load(
            w_ptr + e * s_we + offs_n[None, :] * s_wn + kk[:, None],
            mask=(offs_n[None, :] < N) & k_ok[:, None],
            other=0.0,
        )  # [BK, BN]
        acc += tl.dot(a, w, out_dtype=tl.float32, input_precision=PREC)
        acc_t += tl.dot(tl.trans(w), a_t, out_dtype=tl.float32, input_precision=PREC)
    if SCALE:
        acc = acc * tl.load(scale_ptr + pairs, mask=valid, other=0.0)[:, None]
        acc_t = acc_t * tl.load(scale_ptr + tails, mask=t_valid, other=0.0)[None, :]
    n_ok = offs_n < N
    out = c_ptr + pairs[:, None].to(tl.int64) * s_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])
    out_t = c_ptr + tails[None, :].to(tl.int64) * s_cm + offs_n[:, None]
    tl.store(out_t, acc_t.to(c_ptr.dtype.element_ty), mask=t_valid[None, :] & n_ok[:, None])


@triton.jit(do_not_specialize=["M"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, sorted_ptr, expert_ptr, used_ptr, ends_ptr, scale_ptr,
    M, TOP_K,
    s_am, s_we, s_wn, s_cm,
    N: tl.constexpr, KDIM: tl.constexpr, PAIR_ROWS: tl.constexpr, SCALE: tl.constexpr, PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ALIGN_M: tl.constexpr, GROUP_M: tl.constexpr,
    HALVES: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, rows, e = _program(
        sorted_ptr, expert_ptr, used_ptr, ends_ptr, M, N, BM, BN, ALIGN_M, GROUP_M, HALVES
    )
    if rows == 0:
        return
    t = 0
    if TAIL > 0:
        skip, t = _tail(sorted_ptr, ends_ptr, e, pid_m, M, BM, TAIL)
        if skip:
            return
    args = (a_ptr, w_ptr, c_ptr, sorted_ptr, scale_ptr, e, pid_m * BM, pid_n, M, TOP_K, s_am, s_we, s_wn, s_cm)  # fmt: skip
    if TAIL >= 16 and t == 16:
        _gemm_merged(*args, N, KDIM, PAIR_ROWS, SCALE, PREC, BM, 16, BN, BK)
    elif TAIL >= 32 and t == 32:
        _gemm_merged(*args, N, KDIM, PAIR_ROWS, SCALE, PREC, BM, 32, BN, BK)
    elif TAIL >= 64 and t == 64:
        _gemm_merged(*args, N, KDIM, PAIR_ROWS, SCALE, PREC, BM, 64, BN, BK)
    elif HALVES and rows < BM:
        _gemm_rows(*args, N, KDIM, PAIR_ROWS, SCALE, PREC, BM // 2, BN, BK)
    else:
        _gemm_rows(*args, N, KDIM, PAIR_ROWS, SCALE, PREC, BM, BN, BK)


@triton.jit
def _gate_up_rows(
    a_ptr, w1_ptr, w3_ptr, h_ptr, sorted_ptr, e, start, pid_n, M, TOP_K, alpha, limit, s_am, s_we, s_wn, s_hm,
    N: tl.constexpr, KDIM: tl.constexpr, PREC: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """h[pair] = swiglu(a[token] @ w1[e].T, a[token] @ w3[e].T) for the R slots from `start`."""
    pairs, valid, rows = _slot_rows(sorted_ptr, start, M, TOP_K, R, False)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    gate = tl.zeros([R, BN], tl.float32)
    up = tl.zeros([R, BN], tl.float32)
    for k0 in range(0, KDIM, BK):
        kk = k0 + offs_k
        a = _rows_tile(a_ptr, rows, valid, kk, s_am, KDIM, False)
        w_off = e * s_we + offs_n[None, :] * s_wn + kk[:, None]
        w_ok = (offs_n[None, :] < N) & (kk[:, None] < KDIM)
        gate += tl.dot(
            a, tl.load(w1_ptr + w_off, mask=w_ok, other=0.0), out_dtype=tl.float32, input_precision=PREC
        )
        up += tl.dot(
            a, tl.load(w3_ptr + w_off, mask=w_ok, other=0.0), out_dtype=tl.float32, input_precision=PREC
        )
    h = _swiglu(gate, up, alpha, limit)
    out = h_ptr + pairs[:, None].to(tl.int64) * s_hm + offs_n[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit
def _swiglu(gate, up, alpha, limit):
    g = tl.minimum(gate, limit)  # the clamped SwiGLU of layers/mlp.py, in fp32
    u = tl.minimum(tl.maximum(up, -limit), limit)
    return g * tl.sigmoid(alpha * g) * (u + 1.0)


@triton.jit
def _gate_up_merged(
    a_ptr, w1_ptr, w3_ptr, h_ptr, sorted_ptr, e, start, pid_n, M, TOP_K, alpha, limit, s_am, s_we, s_wn, s_hm,
    N: tl.constexpr, KDIM: tl.constexpr, PREC: tl.constexpr, R: tl.constexpr, T: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):  # fmt: skip
    """`_gate_up_rows` for the R slots from `start` and the T slots after them, the second as
    w @ a.T ([BN, T]) with the same weight tiles (`_gemm_merged`)."""
    pairs, valid, rows = _slot_rows(sorted_ptr, start, M, TOP_K, R, False)
    tails, t_valid, t_rows = _slot_rows(sorted_ptr, start, M, TOP_K, T, False, R)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    gate = tl.zeros([R, BN], tl.float32)
    up = tl.zeros([R, BN], tl.float32)
    gate_t = tl.zeros([BN, T], tl.float32)
    up_t = tl.zeros([BN, T], tl.float32)
    for k0 in range(0, KDIM, BK):
        kk = k0 + offs_k
        k_ok = kk < KDIM
        a = _rows_tile(a_ptr, rows, valid, kk, s_am, KDIM, False)  # [R, BK]
        a_t = _rows_tile(a_ptr, t_rows, t_valid, kk, s_am, KDIM, True)  # [BK, T]
        w_off = e * s_we + offs_n[None, :] * s_wn + kk[:, None]
        w_ok = (offs_n[None, :] < N) & k_ok[:, None]
        w1 = tl.load(w1_ptr + w_off, mask=w_ok, other=0.0)  # [BK, BN]
        w3 = tl.load(w3_ptr + w_off, mask=w_ok, other=0.0)
        gate += tl.dot(a, w1, out_dtype=tl.float32, input_precision=PREC)
        up += tl.dot(a, w3, out_dtype=tl.float32, input_precision=PREC)
        gate_t += tl.dot(tl.trans(w1), a_t, out_dtype=tl.float32, input_precision=PREC)
        up_t += tl.dot(tl.trans(w3), a_t, out_dtype=tl.float32, input_precision=PREC)
    n_ok = offs_n < N
    h = _swiglu(gate, up, alpha, limit)
    tl.store(
        h_ptr + pairs[:, None].to(tl.int64) * s_hm + offs_n[None, :],
        h.to(h_ptr.dtype.element_ty),
        mask=valid[:, None] & n_ok[None, :],
    )
    h_t = _swiglu(gate_t, up_t, alpha, limit)
    tl.store(
        h_ptr + tails[None, :].to(tl.int64) * s_hm + offs_n[:, None],
        h_t.to(h_ptr.dtype.element_ty),
        mask=t_valid[None, :] & n_ok[:, None],
    )


@triton.jit(do_not_specialize=["M"])
def _moe_gate_up_kernel(
    a_ptr, w1_ptr, w3_ptr, h_ptr, sorted_ptr, expert_ptr, used_ptr, ends_ptr,
    M, TOP_K, alpha, limit,
    s_am, s_we, s_wn, s_hm,
    N: tl.constexpr, KDIM: tl.constexpr, PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ALIGN_M: tl.constexpr, GROUP_M: tl.constexpr,
    HALVES: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """h[pair] = swiglu(a[token] @ w1[e].T, a[token] @ w3[e].T): both products from one read of a."""
    pid_m, pid_n, rows, e = _program(
        sorted_ptr, expert_ptr, used_ptr, ends_ptr, M, N, BM, BN, ALIGN_M, GROUP_M, HALVES
    )
    if rows == 0:
        return
    t = 0
    if TAIL > 0:
        skip, t = _tail(sorted_ptr, ends_ptr, e, pid_m, M, BM, TAIL)
        if skip:
            return
    args = (a_ptr, w1_ptr, w3_ptr, h_ptr, sorted_ptr, e, pid_m * BM, pid_n, M, TOP_K, alpha, limit)
    if TAIL >= 16 and t == 16:
        _gate_up_merged(*args, s_am, s_we, s_wn, s_hm, N, KDIM, PREC, BM, 16, BN, BK)
    elif TAIL >= 32 and t == 32:
        _gate_up_merged(*args, s_am, s_we, s_wn, s_hm, N, KDIM, PREC, BM, 32, BN, BK)
    elif TAIL >= 64 and t == 64:
        _gate_up_merged(*args, s_am, s_we, s_wn, s_hm, N, KDIM, PREC, BM, 64, BN, BK)
    elif HALVES and rows < BM:
        _gate_up_rows(*args, s_am, s_we, s_wn, s_hm, N, KDIM, PREC, BM // 2, BN, BK)
    else:
        _gate_up_rows(*args, s_am, s_we, s_wn, s_hm, N, KDIM, PREC, BM, BN, BK)


def tiles(m: int, dtype: torch.dtype) -> tuple[tuple[int, tuple], tuple[int, tuple]]:
    """((BLOCK_M, tile) of the gate/up kernel, (BLOCK_M, tile) of the down GEMM) for M pairs.

    A tile is (BN, BK, warps, stages, GROUP_M: at most this many row blocks of one expert per
    group of the launch order, `grouped_pid`). From `benchmarks/tune/moe_configs.py` on the H200 at
    the release's dimensions: wide K for a few rows (decode reads weights), large tiles for many
    (prefill multiplies; GROUP_M 16 keeps an expert of up to 2048 pairs in one group, so its
    weights are read once). fp32 (tests, CPU-sized models) takes small tiles that fit in shared
    memory.
    """
    if dtype == torch.float32:
        return (16, (64, 32, 4, 2, 4)), (16, (64, 32, 4, 2, 4))
    if m <= 64:
        return (16, (128, 128, 4, 3, 8)), (16, (64, 128, 4, 3, 8))
    if m <= 1024:
        return (16, (64, 256, 4, 3, 8)), (16, (128, 128, 4, 3, 8))
    return (128, (128, 64, 8, 4, 16)), (128, (256, 64, 8, 4, 16))


def _align_m(aligned: Aligned, block_m: int) -> int:
    """The BLOCK_M `aligned` was padded to; a kernel may take it in smaller blocks of `block_m` rows."""
    align_m = aligned.sorted_ids.numel() // aligned.block_expert.numel()
    assert align_m % block_m == 0, (align_m, block_m)
    return align_m


# Most pairs in a short last block that its expert's previous block takes (`_tail`), per kernel.
# On the H200 at the prefill tiles: gate/up takes up to 64 with 255 registers a thread and no
# spills; down, whose 128 x 256 accumulator is larger, spills at 64 and takes up to 32.
MERGED_TAIL = {"gate_up": 64, "down": 32}


def _merged_tail(kernel: str, halves: bool, aligned: Aligned, block_m: int, tail: int | None) -> int:
    """TAIL of a kernel: `MERGED_TAIL`'s (at most half a block) with half-height tiles in blocks
    of whole aligned groups, unless given; 0 (off) otherwise."""
    if not halves or block_m != _align_m(aligned, block_m):
        return 0
    tail = min(MERGED_TAIL[kernel], block_m // 2) if tail is None else tail
    assert tail in (0, 16, 32, 64) and tail <= block_m // 2, (tail, block_m)
    return tail


def _halves(aligned: Aligned, block_m: int) -> bool:
    """Short last blocks in half-height tiles (`_block`): when blocks are whole aligned groups of
    at least 128 rows (prefill), so that a half is still a full tensor-core tile."""
    return block_m >= 128 and block_m == _align_m(aligned, block_m)


def row_blocks(aligned: Aligned, m: int, block_m: int) -> int:
    """Row blocks to launch: each aligned group holds at least one of the M pairs, so only the
    first M groups can be used (a decode step launches a few rows of programs, not one per expert)."""
    align_m = _align_m(aligned, block_m)
    return min(aligned.sorted_ids.numel(), m * align_m) // block_m


def gate_up(
    x, w1, w3, m, top_k, aligned, alpha, limit, block_m, config, halves=None, tail=None
) -> torch.Tensor:
    """SwiGLU activations [M, I] of every token-expert pair (x.dtype). halves: `_block`'s
    half-height tiles (default: `_halves`); tail: `_tail`'s merged short blocks (default:
    `MERGED_TAIL`'s with halves, 0 without)."""
    n, kdim = w1.shape[1], w1.shape[2]
    h = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bn, bk, warps, stages, group = config
    halves = _halves(aligned, block_m) if halves is None else halves
    _moe_gate_up_kernel[(row_blocks(aligned, m, block_m) * triton.cdiv(n, bn),)](
        x, w1, w3, h, *aligned, m, top_k, alpha, limit,
        x.stride(0), w1.stride(0), w1.stride(1), h.stride(0),
        N=n, KDIM=kdim, PREC=precision(x), BM=block_m, BN=bn, BK=bk, ALIGN_M=_align_m(aligned, block_m),
        GROUP_M=group, HALVES=halves, TAIL=_merged_tail("gate_up", halves, aligned, block_m, tail), num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return h


def grouped_gemm(
    a,
    w,
    m,
    top_k,
    aligned,
    pair_rows: bool,
    scale=None,
    out_dtype=None,
    block_m=16,
    config=(64, 128, 4, 3, 8),
    halves=None,
    tail=None,
):
    """c[pair] = a[row of pair] @ w[expert of pair].T (times scale[pair]) -> [M, N]. halves, tail:
    as `gate_up`'s."""
    n, kdim = w.shape[1], w.shape[2]
    halves = _halves(aligned, block_m) if halves is None else halves
    c = torch.empty(m, n, device=a.device, dtype=out_dtype or a.dtype)
    bn, bk, warps, stages, group = config
    grid = (row_blocks(aligned, m, block_m) * triton.cdiv(n, bn),)
    _moe_gemm_kernel[grid](
        a, w, c, *aligned, scale if scale is not None else c,
        m, top_k, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        N=n, KDIM=kdim, PAIR_ROWS=pair_rows, PREC=precision(a), SCALE=scale is not None, BM=block_m, BN=bn, BK=bk,
        ALIGN_M=_align_m(aligned, block_m), GROUP_M=group, HALVES=halves,
        TAIL=_merged_tail("down", halves, aligned, block_m, tail), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return c


def moe_pairs(x, ids, w1, w3, w2, alpha: float, limit: float) -> torch.Tensor:
    """expert_{ids[t, a]}(x[t]) for every token-expert pair -> [T, A, C] in x's dtype, unweighted.

    Each pair's down product is rounded to x's dtype, as the reference's product is
    (`moe_experts_ref`); the routing weights multiply it in fp32 where the pairs are summed
    (`fused.moe_combine`, `moe_experts`). One alignment serves both GEMMs: groups are padded to
    the larger BLOCK_M, and the kernel with the smaller one skips its blocks that hold only padding.
    """
    t, a = ids.shape
    (up_m, up_cfg), (down_m, down_cfg) = tiles(t * a, x.dtype)
    aligned = align(ids, w1.shape[0], max(up_m, down_m))
    h = gate_up(x.contiguous(), w1, w3, t * a, a, aligned, alpha, limit, up_m, up_cfg)  # [M, I]
    down = grouped_gemm(h, w2, t * a, a, aligned, pair_rows=True, block_m=down_m, config=down_cfg)  # [M, C]
    return down.view(t, a, -1)


def moe_experts(x, weights, ids, w1, w3, w2, alpha: float, limit: float) -> torch.Tensor:
    """Same contract as `moe_experts_ref`: sum_a weights[t, a] * expert_{ids[t, a]}(x[t]) -> [T, C] fp32."""
    pairs = moe_pairs(x, ids, w1, w3, w2, alpha, limit).float()
    return (pairs * weights.float()[..., None]).sum(1)
