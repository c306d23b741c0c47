"""Fused MoE with MXFP8 experts on the GPU (Triton): `moe_triton`'s grouped GEMM, weight-only FP8.

Same schedule as `moe_triton` (pairs sorted by expert and padded to BLOCK_M rows by `align`;
one program multiplies BLOCK_M rows of one expert by a BLOCK_N slice of its weights), but the
expert weights are read as e4m3 values plus one E8M0 exponent per 32 inputs and dequantised in
registers, so each touched expert costs half the bytes of bf16. CUDA-graph safe.

Shapes: T tokens, A experts per token, E experts, C hidden, I expert width, M = T*A pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3lm.kernels.fp8_triton import dequant_tile
from m3lm.kernels.host import precision
from m3lm.kernels.moe_triton import align
from m3lm.layers.mlp import swiglu_oai


@triton.jit
def _moe_fp8_gemm_kernel(
    a_ptr, w_ptr, s_ptr, c_ptr, sorted_ptr, expert_ptr, used_ptr, scale_ptr,
    M, TOP_K,
    s_am, s_we, s_wn, s_se, s_sn, s_cm,
    N: tl.constexpr, KDIM: tl.constexpr, PAIR_ROWS: tl.constexpr, SCALE: tl.constexpr, PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(used_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    valid = pairs < M
    rows = pairs if PAIR_ROWS else pairs // TOP_K
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_b = tl.arange(0, BK // 32)
    n_ok = offs_n[:, None] < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, KDIM, BK):
        kk = k0 + offs_k
        a = tl.load(
            a_ptr + rows[:, None].to(tl.int64) * s_am + kk[None, :],
            mask=valid[:, None] & (kk[None, :] < KDIM),
            other=0.0,
        )
        w = tl.load(
            w_ptr + e * s_we + offs_n[:, None] * s_wn + kk[None, :],
            mask=n_ok & (kk[None, :] < KDIM),
            other=0.0,
        )
        kb = k0 // 32 + offs_b
        s = tl.load(
            s_ptr + e * s_se + offs_n[:, None] * s_sn + kb[None, :],
            mask=n_ok & (kb[None, :] < KDIM // 32),
            other=0,
        )
        wd = dequant_tile(w, s, BN, BK).to(a.dtype)  # [BN, BK]
        acc += tl.dot(a, tl.trans(wd), out_dtype=tl.float32, input_precision=PREC)
    if SCALE:
        acc = acc * tl.load(scale_ptr + pairs, mask=valid, other=0.0)[:, None]
    out = c_ptr + pairs[:, None].to(tl.int64) * s_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def _gemm(a, w, ws, m, top_k, aligned, pair_rows: bool, scale=None, out_dtype=None, block_m=16):
    """c[pair] = a[row of pair] @ dequant(w, ws)[expert of pair].T (times scale[pair]) -> [M, N]."""
    sorted_ids, block_expert, used = aligned
    n, kdim = w.shape[1], w.shape[2]
    c = torch.empty(m, n, device=a.device, dtype=out_dtype or a.dtype)
    cap = max(32, triton.next_power_of_2(kdim))
    # Few rows: wide K, narrow N (memory-bound); many rows: the bf16 kernel's tiles.
    bn, bk, warps, stages = (
        (32, min(256, cap), 4, 4)
        if m <= 64
        else (128, min(128, cap), 4, 4)
        if m <= 1024
        else (128, min(64, cap), 4, 3)
    )
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n, bn))
    _moe_fp8_gemm_kernel[grid](
        a, w, ws, c, sorted_ids, block_expert, used, scale if scale is not None else c,
        m, top_k, a.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), c.stride(0),
        N=n, KDIM=kdim, PAIR_ROWS=pair_rows, SCALE=scale is not None,
        PREC=precision(a), BM=block_m, BN=bn, BK=bk,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return c


def moe_experts_fp8(x, weights, ids, w1, s1, w3, s3, w2, s2, alpha: float, limit: float) -> torch.Tensor:
    """`moe_experts_mxfp8`'s contract: sum_a weights[t, a] * expert_{ids[t, a]}(x[t]) -> [T, C] fp32."""
    t, a = ids.shape
    block_m = 16 if t * a <= 1024 else 64
    aligned = align(ids, w1.shape[0], block_m)
    x = x.contiguous()
    gate = _gemm(x, w1, s1, t * a, a, aligned, pair_rows=False, block_m=block_m)  # [M, I]
    up = _gemm(x, w3, s3, t * a, a, aligned, pair_rows=False, block_m=block_m)
    h = swiglu_oai(gate.float(), up.float(), alpha, limit).to(x.dtype)  # [M, I]
    scale = weights.flatten().float().contiguous()
    down = _gemm(
        h, w2, s2, t * a, a, aligned, pair_rows=True, scale=scale, out_dtype=torch.float32, block_m=block_m
    )
    return down.view(t, a, -1).sum(1)  # [T, C]
