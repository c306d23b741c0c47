"""Fused MoE with MXFP8 experts on the GPU (Triton): `moe_triton`'s schedule, weight-only FP8.

Pairs are sorted by expert and padded to BLOCK_M rows by `align`; one program multiplies
BLOCK_M rows of one expert by a BLOCK_N slice of its weights, read as e4m3 values plus one E8M0
exponent per 32 inputs and dequantised in registers, so each touched expert costs half the bytes
of bf16. Two launches after the alignment: gate/up + clamped SwiGLU in one pass over the token
rows (`_moe_fp8_gate_up_kernel`), then the down GEMM scaled by the routing weights. With `swap`
a tile multiplies W @ a.T (the weight on the tensor cores' wide side, which suits a few rows per
expert). Up to PAIR_GEMV_MAX_PAIRS pairs (a decode step of a token or two) skip the alignment:
one program per pair and slice of outputs multiplies the pair's one row on the CUDA cores
(`_pair_gemv_kernel`), as the dense GEMV does, instead of a 16-row tensor-core tile holding one
useful row. CUDA-graph safe.

Shapes: T tokens, A experts per token, E experts, C hidden, I expert width, M = T*A pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3lm.kernels.fp8_triton import FORMAT_CODES, q4_dot, row_products, row_sums, swiglu, weight_tile
from m3lm.kernels.host import precision
from m3lm.kernels.moe_triton import align, row_blocks
from m3lm.kernels.q4 import Q4Weight


@triton.jit
def _block_pairs(sorted_ptr, expert_ptr, pid_m, M, BM: tl.constexpr):
    """Expert (int64) and pair ids [BM] of aligned block pid_m; padding slots hold M."""
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    return e, pairs, pairs < M


@triton.jit
def _rows_tile(a_ptr, rows, valid, s_am, k0, KDIM: tl.constexpr, BK: tl.constexpr):
    """Activation rows `rows` [BM], inputs k0..k0+BK: [BM, BK] (0 for padding)."""
    kk = k0 + tl.arange(0, BK)
    return tl.load(
        a_ptr + rows[:, None].to(tl.int64) * s_am + kk[None, :],
        mask=valid[:, None] & (kk[None, :] < KDIM),
        other=0.0,
    )


@triton.jit
def _expert_dot(
    acc, a, a_ptr, rows, valid, s_am, w_ptr, s_ptr, b_ptr, e, offs_n, k0, s_we, s_wn, s_se, s_sn, s_be, s_bn,
    N: tl.constexpr, KDIM: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr,
    SWAP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """acc += the rows' activations @ expert e's weight rows offs_n [BN].T over inputs k0..k0+BK:
    MXFP8 from `a`, the rows' tile (`_rows_tile`); 4 bits through `q4_dot`, from a_ptr."""
    w_ptr, s_ptr, b_ptr = w_ptr + e * s_we, s_ptr + e * s_se, b_ptr + e * s_be
    if FMT == 0:
        w = weight_tile(
            w_ptr, s_ptr, b_ptr, offs_n, offs_n < N, k0, KDIM, s_wn, s_sn, s_bn, FMT, GROUP, False, BK
        )
        acc = _acc_dot(acc, a, w, SWAP, PREC)
    else:
        acc = q4_dot(
            acc, a_ptr + rows.to(tl.int64) * s_am, valid, w_ptr, s_ptr, b_ptr, offs_n, offs_n < N, k0, KDIM,
            s_wn, s_sn, s_bn, FMT, GROUP, False, BK, SWAP, PREC,
        )  # fmt: skip
    return acc


@triton.jit
def _acc_dot(acc, a, w, SWAP: tl.constexpr, PREC: tl.constexpr):
    """acc += a [BM, BK] @ w [BN, BK].T; with SWAP acc is held transposed, [BN, BM]."""
    w = w.to(a.dtype)
    if SWAP:
        acc = tl.dot(w, tl.trans(a), acc, input_precision=PREC)
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
    return acc


@triton.jit(do_not_specialize=["M"])
def _moe_fp8_gate_up_kernel(
    a_ptr, w1_ptr, s1_ptr, b1_ptr, w3_ptr, s3_ptr, b3_ptr, h_ptr, sorted_ptr, expert_ptr, used_ptr,
    M, TOP_K, alpha, limit,
    s_am, s_we, s_wn, s_se, s_sn, s_be, s_bn, s_hm,
    N: tl.constexpr, KDIM: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """h[pair] = swiglu(a[token] @ W1[e].T, a[token] @ W3[e].T): both products from one read of a."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(used_ptr):
        return
    e, pairs, valid = _block_pairs(sorted_ptr, expert_ptr, pid_m, M, BM)
    rows = pairs // TOP_K
    offs_n = pid_n * BN + tl.arange(0, BN)
    gate = tl.zeros([BN if SWAP else BM, BM if SWAP else BN], tl.float32)  # [BM, BN], or [BN, BM]
    up = tl.zeros_like(gate)
    for k0 in tl.range(0, KDIM, BK, num_stages=STAGES):  # dequantised loads prefetched too
        if FMT == 0:  # noqa: SIM108 (a statement: only the constant branch is compiled)
            a = _rows_tile(a_ptr, rows, valid, s_am, k0, KDIM, BK)
        else:  # 4 bits: `q4_dot` loads the rows' even and odd inputs itself
            a = 0.0
        gate = _expert_dot(
            gate, a, a_ptr, rows, valid, s_am, w1_ptr, s1_ptr, b1_ptr, e, offs_n, k0, s_we, s_wn, s_se, s_sn,
            s_be, s_bn, N, KDIM, FMT, GROUP, BK, SWAP, PREC,
        )  # fmt: skip
        up = _expert_dot(
            up, a, a_ptr, rows, valid, s_am, w3_ptr, s3_ptr, b3_ptr, e, offs_n, k0, s_we, s_wn, s_se, s_sn,
            s_be, s_bn, N, KDIM, FMT, GROUP, BK, SWAP, PREC,
        )  # fmt: skip
    h = swiglu(gate, up, alpha, limit)
    if SWAP:
        h = tl.trans(h)
    out = h_ptr + pairs[:, None].to(tl.int64) * s_hm + offs_n[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _moe_fp8_gemm_kernel(
    a_ptr, w_ptr, s_ptr, b_ptr, c_ptr, sorted_ptr, expert_ptr, used_ptr, scale_ptr,
    M, TOP_K,
    s_am, s_we, s_wn, s_se, s_sn, s_be, s_bn, s_cm,
    N: tl.constexpr, KDIM: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, PAIR_ROWS: tl.constexpr, SCALE: tl.constexpr, PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """c[pair] = a[row] @ W[e].T (times scale[pair]); row = the pair (PAIR_ROWS) or its token."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(used_ptr):
        return
    e, pairs, valid = _block_pairs(sorted_ptr, expert_ptr, pid_m, M, BM)
    rows = pairs if PAIR_ROWS else pairs // TOP_K
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BN if SWAP else BM, BM if SWAP else BN], tl.float32)
    for k0 in tl.range(0, KDIM, BK, num_stages=STAGES):  # dequantised loads prefetched too
        if FMT == 0:  # noqa: SIM108 (a statement: only the constant branch is compiled)
            a = _rows_tile(a_ptr, rows, valid, s_am, k0, KDIM, BK)
        else:  # 4 bits: `q4_dot` loads the rows' even and odd inputs itself
            a = 0.0
        acc = _expert_dot(
            acc, a, a_ptr, rows, valid, s_am, w_ptr, s_ptr, b_ptr, e, offs_n, k0, s_we, s_wn, s_se, s_sn,
            s_be, s_bn, N, KDIM, FMT, GROUP, BK, SWAP, PREC,
        )  # fmt: skip
    if SWAP:
        acc = tl.trans(acc)
    if SCALE:
        acc = acc * tl.load(scale_ptr + pairs, mask=valid, other=0.0)[:, None]
    out = c_ptr + pairs[:, None].to(tl.int64) * s_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _pair_gemv_kernel(
    a_ptr, ids_ptr, w1_ptr, s1_ptr, b1_ptr, w3_ptr, s3_ptr, b3_ptr, y_ptr, scale_ptr, v1_ptr, r1_ptr, v3_ptr, r3_ptr,
    M, TOP_K, alpha, limit, s_am, s_we, s_wn, s_se, s_sn, s_be, s_bn, s_ym,
    N: tl.constexpr, KDIM: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr, PAIR_ROWS: tl.constexpr, SCALE: tl.constexpr,
    EVEN_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """y[pair, n] for this program's pair and BN outputs n of its expert: a[row] @ W1[e].T, or with
    G = 2 swiglu(a[row] @ W1[e].T, a[row] @ W3[e].T); times scale[pair] (SCALE). row = the pair
    (PAIR_ROWS) or its token. Programs past the M routed pairs take the shared expert (v1/r1,
    v3/r3: one [N, KDIM] weight), one per token, unscaled, rounded to a's dtype as the shared MLP
    rounds it. One fp32 product per weight, per-lane sums reduced over K at the end."""
    pair = tl.program_id(0)
    shared = pair >= M
    e = tl.load(ids_ptr + tl.minimum(pair, M - 1)).to(tl.int64)
    row = pair if PAIR_ROWS else tl.where(shared, pair - M, pair // TOP_K)
    q1 = tl.where(shared, v1_ptr, w1_ptr + e * s_we)
    q1s = tl.where(shared, r1_ptr, s1_ptr + e * s_se)
    q3 = tl.where(shared, v3_ptr, w3_ptr + e * s_we)
    q3s = tl.where(shared, r3_ptr, s3_ptr + e * s_se)
    q1b, q3b = b1_ptr + e * s_be, b3_ptr + e * s_be  # 4-bit biases or row factors: never shared
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    wide1 = tl.zeros([BN, BK], tl.float32)  # per-lane sums (`row_products`): MXFP8
    wide3 = tl.zeros([BN, BK], tl.float32)
    half1 = tl.zeros([BN, BK // 2], tl.float32)  # and 4 bits
    half3 = tl.zeros([BN, BK // 2], tl.float32)
    x_row = a_ptr + row * s_am
    for k0 in tl.range(0, KDIM, BK, num_stages=STAGES):
        wide1, half1 = row_products(
            wide1, half1, x_row, q1, q1s, q1b, offs_n, n_ok, k0, KDIM, s_wn, s_sn, s_bn, FMT, GROUP, EVEN_K, BK
        )  # fmt: skip
        if G == 2:
            wide3, half3 = row_products(
                wide3, half3, x_row, q3, q3s, q3b, offs_n, n_ok, k0, KDIM, s_wn, s_sn, s_bn, FMT, GROUP, EVEN_K, BK
            )  # fmt: skip
    acc = row_sums(wide1, half1, FMT)  # [BN]
    if G == 2:
        acc = swiglu(acc, row_sums(wide3, half3, FMT), alpha, limit)
    if SCALE:
        weight = tl.load(scale_ptr + tl.minimum(pair, M - 1))
        acc = tl.where(shared, acc.to(a_ptr.dtype.element_ty).to(tl.float32), acc * weight)
    tl.store(y_ptr + pair * s_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


PAIR_GEMV_MAX_PAIRS = 8


def pair_path(m: int) -> bool:
    """Whether M token-expert pairs go one program each (`pair_gemv`) rather than aligned tiles."""
    return m <= PAIR_GEMV_MAX_PAIRS


# (BN, BK, warps, stages) of the gate/up (BN outputs: 2 * BN weight rows) and down products.
PAIR_GEMV_TILES = ((8, 256, 4, 3), (32, 512, 4, 4))


def pair_gemv(
    a, ids, w1, s1, w3=None, s3=None, top_k=1, pair_rows=False, scale=None, out_dtype=None,
    alpha=0.0, limit=0.0, config=None, shared=None, n_shared=0, fmt=(0, 32), b1=None, b3=None,
) -> torch.Tensor:  # fmt: skip
    """y[pair] = a[row of pair] @ dequant(w1, s1)[ids[pair]].T -> [M, N] (row: the pair or its token);
    with w3/s3, swiglu(that, the same with w3); times scale[pair] when given. ids [M] (flat).

    shared: the shared expert's (values, scales) of w1 (and w3), [N, In]: n_shared more rows
    after the M pairs (one per token), each its row of `a` times the shared weight, unscaled.
    fmt: (FMT, inputs per scale) of `weight_tile`; b1/b3: a 4-bit weight's biases or row factors."""
    m = ids.numel()
    n, kdim = w1.shape[1], w1.shape[2] * (2 if fmt[0] else 1)
    assert not (fmt[0] and n_shared), "the shared expert joins the pairs' launches in MXFP8 only"
    b1 = b1 if b1 is not None else s1
    b3 = b3 if b3 is not None else b1
    if shared is None:
        assert n_shared == 0
        shared = (None,) * 4
    # The shared weight stands where an expert's would: one expert's shape and layout.
    for t, like in zip(shared, (w1, s1, w1, s1), strict=True):
        assert t is None or (t.shape == like.shape[1:] and t.stride() == like.stride()[1:])
    v1, r1, v3, r3 = (t if t is not None else like for t, like in zip(shared, (w1, s1, w1, s1), strict=True))
    bn, bk, warps, stages = config or PAIR_GEMV_TILES[0 if w3 is not None else 1]
    bk = max(min(bk, max(32, triton.next_power_of_2(kdim))), fmt[1])
    y = torch.empty(m + n_shared, n, device=a.device, dtype=out_dtype or a.dtype)
    _pair_gemv_kernel[(m + n_shared, triton.cdiv(n, bn))](
        a, ids, w1, s1, b1, w3 if w3 is not None else w1, s3 if s3 is not None else s1, b3, y,
        scale if scale is not None else y, v1, r1, v3, r3, m, top_k, alpha, limit,
        a.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), *_extra_strides(b1), y.stride(0),
        N=n, KDIM=kdim, FMT=fmt[0], GROUP=fmt[1], G=2 if w3 is not None else 1, PAIR_ROWS=pair_rows, SCALE=scale is not None,
        EVEN_K=kdim % bk == 0, BN=bn, BK=bk, STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return y


def tiles(m: int, dtype: torch.dtype) -> tuple[tuple[int, tuple], tuple[int, tuple]]:
    """((BLOCK_M, tile) of the gate/up kernel, (BLOCK_M, tile) of the down GEMM) for M pairs.

    A tile is (BN, BK, warps, stages, swap). Decode (up to 1024 pairs) reads weights: narrow
    output tiles and wide K, the winners of `benchmarks/tune/fp8_configs.py`'s MoE sweep timed inside a
    CUDA graph at 1, 16 and 64 tokens; prefill multiplies: larger tiles. fp32 (tests, CPU-sized
    models) takes small tiles that fit in shared memory.
    """
    if dtype == torch.float32:
        return (16, (64, 64, 4, 2, False)), (16, (64, 64, 4, 2, False))
    if m <= 16:
        return (16, (32, 256, 4, 3, False)), (16, (64, 256, 4, 3, False))
    if m <= 1024:
        return (16, (64, 256, 4, 3, False)), (16, (64, 256, 4, 4, False))
    return (64, (128, 64, 4, 3, False)), (64, (128, 64, 4, 3, False))


def _extra_strides(b: torch.Tensor) -> tuple[int, int]:
    """(per expert, per row) strides of stacked biases [E, O, In/G] or row factors [E, O]."""
    return b.stride(0), b.stride(1)


def _launch_shape(aligned, w, m: int, block_m: int, config: tuple, fmt: tuple[int, int]):
    n, kdim = w.shape[1], w.shape[2] * (2 if fmt[0] else 1)
    bn, bk, warps, stages, swap = config
    grid = (row_blocks(aligned, m, block_m), triton.cdiv(n, bn))
    bk = max(min(bk, max(32, triton.next_power_of_2(kdim))), fmt[1])
    meta = dict(
        N=n, KDIM=kdim, FMT=fmt[0], GROUP=fmt[1], BM=block_m, BN=bn, BK=bk, SWAP=swap, STAGES=stages,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return grid, meta


def gate_up_fp8(
    x, w1, s1, w3, s3, m, top_k, aligned, alpha, limit, block_m, config, fmt=(0, 32), b1=None, b3=None
) -> torch.Tensor:
    """SwiGLU activations [M, I] of every token-expert pair (x.dtype); w1/w3 [E, I, C] + scales."""
    assert w1.shape == w3.shape and w1.stride() == w3.stride() and s1.stride() == s3.stride()
    b1 = b1 if b1 is not None else s1
    b3 = b3 if b3 is not None else b1
    assert b1.stride() == b3.stride()
    sorted_ids, block_expert, used, _ = aligned
    h = torch.empty(m, w1.shape[1], device=x.device, dtype=x.dtype)
    grid, meta = _launch_shape(aligned, w1, m, block_m, config, fmt)
    _moe_fp8_gate_up_kernel[grid](
        x, w1, s1, b1, w3, s3, b3, h, sorted_ids, block_expert, used, m, top_k, alpha, limit,
        x.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), *_extra_strides(b1), h.stride(0),
        PREC=precision(x), **meta,
    )  # fmt: skip
    return h


def grouped_gemm_fp8(
    a, w, ws, m, top_k, aligned, pair_rows: bool, scale=None, out_dtype=None, block_m=16, config=None,
    fmt=(0, 32), b=None,
) -> torch.Tensor:  # fmt: skip
    """c[pair] = a[row of pair] @ dequant(w, ws)[expert of pair].T (times scale[pair]) -> [M, N]."""
    sorted_ids, block_expert, used, _ = aligned
    b = b if b is not None else ws
    c = torch.empty(m, w.shape[1], device=a.device, dtype=out_dtype or a.dtype)
    grid, meta = _launch_shape(aligned, w, m, block_m, config or tiles(m, a.dtype)[1][1], fmt)
    _moe_fp8_gemm_kernel[grid](
        a, w, ws, b, c, sorted_ids, block_expert, used, scale if scale is not None else c,
        m, top_k, a.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), *_extra_strides(b),
        c.stride(0),
        PAIR_ROWS=pair_rows, SCALE=scale is not None, PREC=precision(a), **meta,
    )  # fmt: skip
    return c


def moe_pairs_fp8(
    x, weights, ids, w1, s1, w3, s3, w2, s2, alpha: float, limit: float, configs=None, shared=None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weights[t, a] * expert_{ids[t, a]}(x[t]) for every pair -> [T, A, C] fp32, not yet summed over A.

    w1/w3 [E, I, C] + scales [E, I, C/32], w2 [E, C, I] + [E, C, I/32]; configs: `tiles`' form.
    shared: the shared expert's (w1, s1, w3, s3, w2, s2) [I, C] / [C, I] + scales, taken in the
    same launches when the pairs go one program each (`pair_path`): then (pairs, its output [T, C]
    fp32 rounded to x's dtype) is returned.
    """
    return _moe_pairs(x, weights, ids, (w1, s1, None), (w3, s3, None), (w2, s2, None), (0, 32),
                      alpha, limit, configs, shared)  # fmt: skip


def moe_pairs_q4(
    x, weights, ids, w1: Q4Weight, w3: Q4Weight, w2: Q4Weight, alpha: float, limit: float, configs=None
):
    """`moe_pairs_fp8` with 4-bit experts (`kernels.q4`): w1/w3 [E, I, C/2] codes, w2 [E, C, I/2]."""
    fmt = (FORMAT_CODES[w1.fmt], w1.group)
    assert all((w.fmt, w.group) == (w1.fmt, w1.group) for w in (w3, w2))
    return _moe_pairs(x, weights, ids, w1[:3], w3[:3], w2[:3], fmt, alpha, limit, configs, None)


def _moe_pairs(x, weights, ids, up1, up3, down, fmt, alpha: float, limit: float, configs, shared):
    """The two products of every pair: (values, scales, extra) of w1, w3 and w2 in format `fmt`."""
    (w1, s1, b1), (w3, s3, b3), (w2, s2, b2) = up1, up3, down
    t, a = ids.shape
    if configs is None and pair_path(t * a):
        assert w1.stride() == w3.stride() and s1.stride() == s3.stride()
        flat = ids.flatten().contiguous()
        x = x.contiguous()
        n_sh = t if shared is not None else 0
        sh1, sh2 = (shared[:4], shared[4:]) if shared is not None else (None, None)
        h = pair_gemv(
            x,
            flat,
            w1,
            s1,
            w3,
            s3,
            a,
            alpha=alpha,
            limit=limit,
            shared=sh1,
            n_shared=n_sh,
            fmt=fmt,
            b1=b1,
            b3=b3,
        )  # [M+t, I]
        scale = weights.flatten().float().contiguous()
        down = pair_gemv(
            h, flat, w2, s2, pair_rows=True, scale=scale, out_dtype=torch.float32,
            shared=sh2 and (*sh2, None, None), n_shared=n_sh, fmt=fmt, b1=b2,
        )  # fmt: skip
        pairs = down[: t * a].view(t, a, -1)
        return (pairs, down[t * a :]) if shared is not None else pairs
    assert shared is None, "the shared expert joins only the per-pair path"
    (up_m, up_cfg), (down_m, down_cfg) = configs or tiles(t * a, x.dtype)
    aligned = align(ids, w1.shape[0], up_m)
    h = gate_up_fp8(
        x.contiguous(), w1, s1, w3, s3, t * a, a, aligned, alpha, limit, up_m, up_cfg, fmt, b1, b3
    )  # [M, I]
    if down_m != up_m:
        aligned = align(ids, w1.shape[0], down_m)
    scale = weights.flatten().float().contiguous()
    down = grouped_gemm_fp8(
        h,
        w2,
        s2,
        t * a,
        a,
        aligned,
        True,
        scale,
        torch.float32,
        block_m=down_m,
        config=down_cfg,
        fmt=fmt,
        b=b2,
    )
    return down.view(t, a, -1)  # [T, A, C]


def moe_experts_fp8(x, weights, ids, w1, s1, w3, s3, w2, s2, alpha: float, limit: float) -> torch.Tensor:
    """`moe_experts_mxfp8`'s contract: sum_a weights[t, a] * expert_{ids[t, a]}(x[t]) -> [T, C] fp32."""
    return moe_pairs_fp8(x, weights, ids, w1, s1, w3, s3, w2, s2, alpha, limit).sum(1)
