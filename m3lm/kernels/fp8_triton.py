"""Weight-only FP8 matrix product on the GPU (Triton), next to `fp8.py`'s reference `mxfp8_linear`.

Hopper has no MX block-scaled tensor-core instructions, so MXFP8 weights are read as 8-bit
values plus one E8M0 exponent per 32 inputs, dequantised in registers to the activation dtype
and multiplied on the bf16 (or fp32) units with fp32 accumulation. Decode is memory-bound: the
gain is reading half the bytes of bf16, so small batches use wide K tiles and split the output
dimension over many programs. Static shapes, no host sync (CUDA-graph safe).

Shapes: T rows (tokens), In inputs, O outputs, In/32 scale blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3lm.kernels.fp8 import MX_BLOCK
from m3lm.kernels.host import precision, sm_count


@triton.jit
def dequant_tile(w, s, ROWS: tl.constexpr, BK: tl.constexpr):
    """fp8 tile [ROWS, BK] and its E8M0 exponents [ROWS, BK/32] -> fp32 [ROWS, BK]."""
    f = tl.exp2(s.to(tl.float32) - 127.0)
    w = tl.reshape(w.to(tl.float32), (ROWS, BK // 32, 32)) * f[:, :, None]
    return tl.reshape(w, (ROWS, BK))


@triton.jit
def _mxfp8_matmul_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr,
    T, s_xt, s_qo, s_so, s_yt,
    N: tl.constexpr, KDIM: tl.constexpr, PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_b = tl.arange(0, BK // 32)
    row_ok = offs_m[:, None] < T
    col_ok = offs_n[:, None] < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, KDIM, BK):
        kk = k0 + offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * s_xt + kk[None, :], mask=row_ok & (kk[None, :] < KDIM), other=0.0
        )
        w = tl.load(
            q_ptr + offs_n[:, None] * s_qo + kk[None, :], mask=col_ok & (kk[None, :] < KDIM), other=0.0
        )
        kb = k0 // 32 + offs_b
        s = tl.load(
            s_ptr + offs_n[:, None] * s_so + kb[None, :], mask=col_ok & (kb[None, :] < KDIM // 32), other=0
        )
        wd = dequant_tile(w, s, BN, BK).to(x.dtype)  # [BN, BK]
        acc += tl.dot(x, tl.trans(wd), out_dtype=tl.float32, input_precision=PREC)
    out = y_ptr + offs_m[:, None].to(tl.int64) * s_yt + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok & (offs_n[None, :] < N))


def matmul_config(t: int, o: int, kdim: int, sms: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, warps, stages): GEMV-like tiles for decode, square-ish tiles for prefill."""
    bk_cap = max(32, triton.next_power_of_2(kdim))
    if t <= 16:  # memory-bound: wide K, and enough output tiles for about 2 programs per SM
        bn = 64
        while bn > 16 and -(-o // bn) < 2 * sms:
            bn //= 2
        return 16, bn, min(256, bk_cap), 4, 4
    if t <= 128:
        return 64 if t <= 64 else 128, 64, min(128, bk_cap), 4, 4
    return 128, 128, min(64, bk_cap), 8, 3


def mxfp8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, config=None) -> torch.Tensor:
    """x [T, In] (bf16 or fp32) @ dequant(q [O, In] e4m3, scale [O, In/32] uint8).T -> [T, O] in x's dtype."""
    t, kdim = x.shape
    o = q.shape[0]
    assert kdim % MX_BLOCK == 0 and q.shape[1] == kdim and scale.shape == (o, kdim // MX_BLOCK)
    x = x.contiguous()
    y = torch.empty(t, o, device=x.device, dtype=x.dtype)
    bm, bn, bk, warps, stages = config or matmul_config(t, o, kdim, sm_count(x.device))
    grid = (triton.cdiv(t, bm), triton.cdiv(o, bn))
    _mxfp8_matmul_kernel[grid](
        x, q, scale, y, t, x.stride(0), q.stride(0), scale.stride(0), y.stride(0),
        N=o, KDIM=kdim, PREC=precision(x), BM=bm, BN=bn, BK=bk,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
