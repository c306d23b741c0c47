"""Weight-only FP8 matrix product on the GPU (Triton), next to `fp8.py`'s reference `mxfp8_linear`.

Hopper has no MX block-scaled tensor-core instructions, so MXFP8 weights are read as 8-bit
values plus one E8M0 exponent per 32 inputs, dequantised in registers (times 2^(e - 127)) and
multiplied with fp32 accumulation. Three paths:

- `_mxfp8_gemv_kernel`, for a few rows (decode, T <= 16): many programs, each owning a slice of
  the weight's output rows and all T rows of x; wide contiguous K loads (16-byte fp8 vectors).
  "gemv" multiplies on the CUDA cores (T = 1: one fp32 product per weight, reduced over K once
  at the end), "gemv_tc" on the tensor cores with the weight as the wide operand and x's rows
  padded to 16. No split-K: every output is summed by one program, in a fixed order.
- `_mxfp8_matmul_kernel` ("tile"), for any T: BM x BN output tiles on the tensor cores.
- From DEQUANT_MIN_T rows (prefill), `dequantize` writes the bf16 weight once and the vendor
  GEMM multiplies: the product is compute-bound there, and the tile kernel would dequantise
  each weight tile once per row block.

Both can apply the clamped SwiGLU of `layers/mlp.py` to a weight packed as [gate rows; up rows]
(`pack_gate_up`): a program reads the gate and up rows of its outputs and writes swiglu(gate, up).
Static shapes, no host sync (CUDA-graph safe).

Shapes: T rows (tokens), In inputs, O outputs (weight rows), In/32 scale blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from m3lm.kernels.host import interpreted, precision, sm_count
from m3lm.kernels.mx_block import MX_BLOCK


class Config(NamedTuple):
    """One launch shape of `mxfp8_matmul`. kernel: "gemv" (CUDA cores, T <= 16), "gemv_tc" (tensor
    cores, T <= 16) or "tile" (tensor cores, any T, BM rows a program). BN counts outputs: with the
    SwiGLU a program reads 2 * BN weight rows."""

    kernel: str
    bn: int
    bk: int
    warps: int
    stages: int
    bm: int = 16


# Tunables. Chosen from the compiled kernels' resources (registers, shared memory, 16-byte loads)
# and kept after a GPU check. At one row, `benchmarks/tune/fp8_graph_sweep.py` times them as the
# captured decode step runs them (in a CUDA graph, weights cold in L2): 32 weight rows x 512
# inputs, 4 stages, at least one program per SM is the best or within 1 us of it on every
# projection of the release (`benchmarks/results/fp8_graph_sweep_h200.md`). `fp8_configs.py`
# covers 2-64 rows (launch overheads included).
GEMV_MAX_T = 16  # at most this many rows: the GEMV kernel
# Per largest T of a bucket: the GEMV tile. Its BN is an upper bound: `matmul_config` halves it
# (down to GEMV_MIN_BN) until the grid has GEMV_PROGRAMS_PER_SM programs per multiprocessor, and
# widens BK so that each thread still loads 16 bytes of a row at a time.
GEMV_TILES = (
    (1, Config("gemv", 32, 512, 4, 4)),
    (16, Config("gemv_tc", 32, 256, 4, 3)),
)
GEMV_MIN_BN = {"gemv": 2, "gemv_tc": 16}
GEMV_PROGRAMS_PER_SM = 1
# Fewer outputs than 16 x the SMs, too few for 16-row tensor-core tiles to fill the GPU (the k/v
# projections): the CUDA cores, one warp a row (BN = warps, BK = 32 lanes x 16 bytes).
GEMV_NARROW = Config("gemv", 4, 512, 4, 3)
# From this many rows (prefill) a product is compute-bound: the weight is dequantised to bf16 once
# (`dequantize`, one read of the 8-bit bytes) and multiplied by the vendor GEMM at bf16 speed,
# instead of dequantising every tile once per row block in the tile kernel.
DEQUANT_MIN_T = 1024
FORMAT_CODES = {"mxfp8": 0, "mxfp4": 1, "nvfp4": 2, "affine4": 3}  # `weight_tile`'s FMT


@triton.jit
def dequant_tile(w, s, ROWS: tl.constexpr, BK: tl.constexpr):
    """fp8 tile [ROWS, BK] and its E8M0 exponents [ROWS, BK/32] -> fp32 [ROWS, BK]."""
    f = tl.exp2(s.to(tl.float32) - 127.0)
    w = tl.reshape(w.to(tl.float32), (ROWS, BK // 32, 32)) * f[:, :, None]
    return tl.reshape(w, (ROWS, BK))


@triton.jit
def swiglu(gate, up, alpha, limit):
    """The clamped SwiGLU of `layers/mlp.py`, in fp32: the gate clamped from above only."""
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    return g * tl.sigmoid(alpha * g) * (u + 1.0)


@triton.jit
def _weight_rows(pid, N, BN: tl.constexpr, G: tl.constexpr):
    """Weight rows [G*BN] of output tile pid: outputs pid*BN + j, then (G = 2) their up rows N + that."""
    r = tl.arange(0, G * BN)
    n = pid * BN + r % BN
    return n + (r // BN) * N, n < N


@triton.jit
def e2m1(c):
    """E2M1 codes (int32, 0..15) -> fp32: magnitudes 0, 0.5 (the two subnormals) and 1.5 x 2^e
    steps built as fp32 bit patterns (exponent 126 + c/2, mantissa bit c & 1), sign from bit 3."""
    m = c & 7
    bits = tl.where(m < 2, m * 0x3F000000, (m + 252) << 22) | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def weight_tile(
    q_ptr, s_ptr, b_ptr, rows, row_ok, k0, KDIM, s_qo, s_so, s_bo,
    FMT: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Weight rows `rows` [R], inputs k0..k0+BK, dequantised: fp32 [R, BK] (0 where masked).

    FMT 0: MXFP8 (e4m3 values, E8M0 per 32). Else 4 bits, two inputs a byte (`kernels.q4`):
    1 MXFP4, 2 NVFP4 (b_ptr: one fp32 factor a row), 3 MLX affine (b_ptr: a bias a group)."""
    if FMT == 0:
        kk = k0 + tl.arange(0, BK)
        kb = k0 // 32 + tl.arange(0, BK // 32)
        w_ptrs = q_ptr + rows[:, None] * s_qo + kk[None, :]
        s_ptrs = s_ptr + rows[:, None] * s_so + kb[None, :]
        if EVEN_K:  # no K mask: nothing stands between the loads and 16-byte vectors
            w = tl.load(w_ptrs, mask=row_ok[:, None], other=0.0)
            s = tl.load(s_ptrs, mask=row_ok[:, None], other=0)
        else:
            w = tl.load(w_ptrs, mask=row_ok[:, None] & (kk[None, :] < KDIM), other=0.0)
            s = tl.load(s_ptrs, mask=row_ok[:, None] & (kb[None, :] < KDIM // 32), other=0)
        tile = dequant_tile(w, s, rows.shape[0], BK)
    else:
        lo, hi = q4_halves(
            q_ptr, s_ptr, b_ptr, rows, row_ok, k0, KDIM, s_qo, s_so, s_bo, FMT, GROUP, EVEN_K, BK
        )
        tile = tl.reshape(tl.join(lo, hi), (rows.shape[0], BK))  # inputs in order: 2j, 2j + 1
    return tile


@triton.jit
def row_products(
    wide, wide4, x_ptr, q_ptr, s_ptr, b_ptr, rows, row_ok, k0, KDIM, s_qo, s_so, s_bo,
    FMT: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """One K step of a GEMV on the CUDA cores for one row of x (x_ptr): MXFP8 adds W * x to wide
    [R, BK]; 4 bits add W_even * x_even + W_odd * x_odd to wide4 [R, BK/2], the nibbles never
    interleaved. Per-lane sums, reduced over K once at the end (`row_sums`)."""
    if FMT == 0:
        kk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + kk, mask=kk < KDIM, other=0.0).to(tl.float32)
        wide += x[None, :] * weight_tile(
            q_ptr, s_ptr, b_ptr, rows, row_ok, k0, KDIM, s_qo, s_so, s_bo, FMT, GROUP, EVEN_K, BK
        )
    else:
        lo, hi = q4_halves(
            q_ptr, s_ptr, b_ptr, rows, row_ok, k0, KDIM, s_qo, s_so, s_bo, FMT, GROUP, EVEN_K, BK
        )
        ke = k0 + 2 * tl.arange(0, BK // 2)
        xe = tl.load(x_ptr + ke, mask=ke < KDIM, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + ke + 1, mask=ke < KDIM, other=0.0).to(tl.float32)
        wide4 += lo * xe[None, :] + hi * xo[None, :]
    return wide, wide4


@triton.jit
def row_sums(wide, wide4, FMT: tl.constexpr):
    """The GEMV's outputs [R] from `row_products`' per-lane sums."""
    if FMT == 0:  # noqa: SIM108 (a statement: only the constant branch is compiled)
        out = tl.sum(wide, axis=1)
    else:
        out = tl.sum(wide4, axis=1)
    return out


@triton.jit
def q4_dot(
    acc, x_rows, x_ok, q_ptr, s_ptr, b_ptr, rows, row_ok, k0, KDIM, s_qo, s_so, s_bo,
    FMT: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """acc += x[rows of x] @ W[rows].T over inputs k0..k0+BK, W 4-bit, on the tensor cores: two
    products of half the inputs each (x's even inputs by the low nibbles, its odd ones by the
    high), the nibbles never interleaved. x_rows [M]: pointers to x's rows (x_ok: which are real);
    acc [M, R], or with SWAP held transposed, [R, M]."""
    lo, hi = q4_halves(q_ptr, s_ptr, b_ptr, rows, row_ok, k0, KDIM, s_qo, s_so, s_bo, FMT, GROUP, EVEN_K, BK)
    ke = k0 + 2 * tl.arange(0, BK // 2)
    mask = x_ok[:, None] & (ke[None, :] < KDIM)
    xe = tl.load(x_rows[:, None] + ke[None, :], mask=mask, other=0.0)
    xo = tl.load(x_rows[:, None] + ke[None, :] + 1, mask=mask, other=0.0)
    lo, hi = lo.to(xe.dtype), hi.to(xe.dtype)
    if SWAP:
        acc = tl.dot(lo, tl.trans(xe), acc, input_precision=PREC)
        acc = tl.dot(hi, tl.trans(xo), acc, input_precision=PREC)
    else:
        acc = tl.dot(xe, tl.trans(lo), acc, input_precision=PREC)
        acc = tl.dot(xo, tl.trans(hi), acc, input_precision=PREC)
    return acc


@triton.jit
def q4_halves(
    q_ptr, s_ptr, b_ptr, rows, row_ok, k0, KDIM, s_qo, s_so, s_bo,
    FMT: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """A 4-bit weight's rows `rows` [R], inputs k0..k0+BK, dequantised as two fp32 [R, BK/2]
    halves: inputs k0 + 2j (byte j's low nibble) and k0 + 2j + 1 (its high nibble)."""
    R: tl.constexpr = rows.shape[0]
    kp = k0 // 2 + tl.arange(0, BK // 2)
    kb = k0 // GROUP + tl.arange(0, BK // GROUP)
    p_ptrs = q_ptr + rows[:, None] * s_qo + kp[None, :]
    s_ptrs = s_ptr + rows[:, None] * s_so + kb[None, :]
    if EVEN_K:
        p = tl.load(p_ptrs, mask=row_ok[:, None], other=0)
        s = tl.load(s_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        p = tl.load(p_ptrs, mask=row_ok[:, None] & (kp[None, :] < KDIM // 2), other=0)
        s = tl.load(s_ptrs, mask=row_ok[:, None] & (kb[None, :] < KDIM // GROUP), other=0.0)
    p = p.to(tl.int32)
    if FMT == 3:
        lo = (p & 15).to(tl.float32)
        hi = (p >> 4).to(tl.float32)
    else:
        lo = e2m1(p & 15)
        hi = e2m1(p >> 4)
    lo = tl.reshape(lo, (R, BK // GROUP, GROUP // 2))  # each scale group: GROUP / 2 bytes
    hi = tl.reshape(hi, (R, BK // GROUP, GROUP // 2))
    if FMT == 1:
        f = tl.exp2(s.to(tl.float32) - 127.0)[:, :, None]
        lo, hi = lo * f, hi * f
    elif FMT == 2:
        f = s.to(tl.float32)[:, :, None]
        g = tl.load(b_ptr + rows * s_bo, mask=row_ok, other=0.0)[:, None, None]
        lo, hi = (lo * f) * g, (hi * f) * g
    else:
        b_ptrs = b_ptr + rows[:, None] * s_bo + kb[None, :]
        if EVEN_K:
            b = tl.load(b_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            b = tl.load(b_ptrs, mask=row_ok[:, None] & (kb[None, :] < KDIM // GROUP), other=0.0)
        f, b = s.to(tl.float32)[:, :, None], b.to(tl.float32)[:, :, None]
        lo, hi = lo * f + b, hi * f + b
    return tl.reshape(lo, (R, BK // 2)), tl.reshape(hi, (R, BK // 2))


@triton.jit
def _dequant_kernel(
    q_ptr, s_ptr, b_ptr, w_ptr, N, KDIM, s_qo, s_so, s_bo,
    FMT: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """w[BN rows, BK inputs] = dequant(q, s) for this program's tile, in w's dtype."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    w = weight_tile(q_ptr, s_ptr, b_ptr, rows, rows < N, k0, KDIM, s_qo, s_so, s_bo, FMT, GROUP, False, BK)
    kk = k0 + tl.arange(0, BK)
    out = w_ptr + rows[:, None].to(tl.int64) * KDIM + kk[None, :]
    tl.store(out, w.to(w_ptr.dtype.element_ty), mask=(rows[:, None] < N) & (kk[None, :] < KDIM))


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, q4=None) -> torch.Tensor:
    """`fp8.dequant_mxfp8` (or with `q4`, `q4.dequant_q4`) in one launch: q [O, In] e4m3 + scale
    [O, In/32] (or the 4-bit weight) -> [O, In] in dtype."""
    fmt, group, extra = _format(q4)
    o, kdim = q.shape[0], q.shape[1] * (2 if q4 is not None else 1)
    assert kdim % group == 0 and scale.shape == (o, kdim // group) and q.numel() < 2**31
    q, scale, extra = q.contiguous(), scale.contiguous(), (extra if extra is not None else scale).contiguous()
    w = torch.empty(o, kdim, device=q.device, dtype=dtype)
    bn, bk = 32, max(128, group)
    _dequant_kernel[(triton.cdiv(o, bn), triton.cdiv(kdim, bk))](
        q, scale, extra, w, o, kdim, q.stride(0), scale.stride(0), extra.stride(0),
        FMT=fmt, GROUP=group, BN=bn, BK=bk,
    )  # fmt: skip
    return w


def _format(q4) -> tuple[int, int, torch.Tensor | None]:
    """(FMT, inputs per scale, the bias or row factor) of MXFP8 (None) or a 4-bit weight
    (`kernels.q4.Q4Weight`)."""
    if q4 is None:
        return 0, MX_BLOCK, None
    return FORMAT_CODES[q4.fmt], q4.group, q4.extra


@triton.jit(do_not_specialize=["T"])
def _mxfp8_gemv_kernel(
    x_ptr, q_ptr, s_ptr, b_ptr, y_ptr,
    T, N, KDIM, s_xt, s_qo, s_so, s_bo, s_yt, alpha, limit,
    FMT: tl.constexpr, GROUP: tl.constexpr, KLOOP: tl.constexpr, EVEN_K: tl.constexpr, G: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """y[:T, n] for this program's BN outputs n, every weight row read once; x [T, In] stays in cache.

    Accumulates transposed, [G*BN, BT]. KLOOP: the K bound as a constant (the interpreter), else 0.
    """
    pid = tl.program_id(0)
    rows, row_ok = _weight_rows(pid, N, BN, G)
    offs_t = tl.arange(0, BT)
    acc = tl.zeros([G * BN, BT], tl.float32)
    wide = tl.zeros([G * BN, BK], tl.float32)  # T = 1 on CUDA cores: per-lane sums, reduced at the end
    wide4 = tl.zeros([G * BN, BK // 2], tl.float32)  # the same for 4-bit weights (`row_products`)
    # An explicit pipelining depth: by default only the loads that feed a dot are prefetched.
    for k0 in tl.range(0, KLOOP if KLOOP else KDIM, BK, num_stages=STAGES):
        kk = k0 + tl.arange(0, BK)
        if BT == 1 and not DOT:
            wide, wide4 = row_products(
                wide, wide4, x_ptr, q_ptr, s_ptr, b_ptr, rows, row_ok, k0, KDIM, s_qo, s_so, s_bo,
                FMT, GROUP, EVEN_K, BK,
            )  # fmt: skip
        elif DOT and FMT != 0:
            acc = q4_dot(
                acc, x_ptr + offs_t * s_xt, offs_t < T, q_ptr, s_ptr, b_ptr, rows, row_ok, k0, KDIM,
                s_qo, s_so, s_bo, FMT, GROUP, EVEN_K, BK, True, PREC,
            )  # fmt: skip
        else:
            w = weight_tile(
                q_ptr, s_ptr, b_ptr, rows, row_ok, k0, KDIM, s_qo, s_so, s_bo, FMT, GROUP, EVEN_K, BK
            )  # [G*BN, BK]
            if DOT:  # [G*BN, BK] @ [BK, 16]: the weight on the tensor cores' wide side
                x = tl.load(
                    x_ptr + offs_t[:, None] * s_xt + kk[None, :],
                    mask=(offs_t[:, None] < T) & (kk[None, :] < KDIM),
                    other=0.0,
                )
                acc = tl.dot(w.to(x.dtype), tl.trans(x), acc, input_precision=PREC)
            else:
                for r in tl.static_range(BT):
                    x = tl.load(x_ptr + r * s_xt + kk, mask=(kk < KDIM) & (r < T), other=0.0)
                    dots = tl.sum(w * x[None, :].to(tl.float32), axis=1)  # [G*BN]
                    acc += tl.where(offs_t[None, :] == r, dots[:, None], 0.0)
    if BT == 1 and not DOT:
        acc = row_sums(wide, wide4, FMT)[:, None]
    if G == 2:  # [2*BN, BT]: gate rows, then up rows
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BN, BT)), (1, 2, 0)))
        acc = swiglu(gate, up, alpha, limit)
    offs_n = pid * BN + tl.arange(0, BN)
    out = y_ptr + offs_t[None, :] * s_yt + offs_n[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(offs_n[:, None] < N) & (offs_t[None, :] < T))


@triton.jit(do_not_specialize=["T"])
def _mxfp8_matmul_kernel(
    x_ptr, q_ptr, s_ptr, b_ptr, y_ptr,
    T, N, KDIM, s_xt, s_qo, s_so, s_bo, s_yt, alpha, limit,
    FMT: tl.constexpr, GROUP: tl.constexpr, KLOOP: tl.constexpr, EVEN_K: tl.constexpr, G: tl.constexpr, PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """y tile [BM, BN] = x[BM rows] @ W[BN outputs].T on the tensor cores (see `_mxfp8_gemv_kernel`)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    rows, row_ok = _weight_rows(pid_n, N, BN, G)
    acc = tl.zeros([BM, G * BN], tl.float32)
    # An explicit pipelining depth, so that the weight loads (which feed the dot only through
    # the dequantisation) are prefetched too.
    for k0 in tl.range(0, KLOOP if KLOOP else KDIM, BK, num_stages=STAGES):
        if FMT == 0:
            kk = k0 + tl.arange(0, BK)
            x = tl.load(
                x_ptr + offs_m[:, None] * s_xt + kk[None, :],
                mask=(offs_m[:, None] < T) & (kk[None, :] < KDIM),
                other=0.0,
            )
            w = weight_tile(
                q_ptr, s_ptr, b_ptr, rows, row_ok, k0, KDIM, s_qo, s_so, s_bo, FMT, GROUP, EVEN_K, BK
            )
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PREC)
        else:
            acc = q4_dot(
                acc, x_ptr + offs_m.to(tl.int64) * s_xt, offs_m < T, q_ptr, s_ptr, b_ptr, rows, row_ok, k0,
                KDIM, s_qo, s_so, s_bo, FMT, GROUP, EVEN_K, BK, False, PREC,
            )  # fmt: skip
    if G == 2:  # [BM, 2*BN]: gate columns, then up columns
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
        acc = swiglu(gate, up, alpha, limit)
    offs_n = pid_n * BN + tl.arange(0, BN)
    out = y_ptr + offs_m[:, None].to(tl.int64) * s_yt + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < T) & (offs_n[None, :] < N))


def matmul_config(t: int, o: int, kdim: int, sms: int, act: bool = False) -> Config:
    """The launch shape for T rows, O outputs and In = kdim inputs (act: O gate/up pairs)."""
    bk_cap = max(32, triton.next_power_of_2(kdim))
    if t > GEMV_MAX_T:
        if t <= 128:
            return Config("tile", 64, min(128, bk_cap), 4, 4, bm=64 if t <= 64 else 128)
        return Config("tile", 128, min(64, bk_cap), 8, 3, bm=128)
    # Memory-bound: wide K, and enough programs to keep every SM's loads in flight.
    programs = GEMV_PROGRAMS_PER_SM * sms
    tile = next(tile for bound, tile in GEMV_TILES if t <= bound)
    if tile.kernel == "gemv_tc" and -(-o // GEMV_MIN_BN["gemv_tc"]) < sms:
        tile = GEMV_NARROW
    else:
        least = GEMV_MIN_BN[tile.kernel]
        bn = max(least, tile.bn // (2 if act else 1))
        while bn > least and -(-o // bn) < programs:
            bn //= 2
        tile = tile._replace(bn=bn)
    bk = min(tile.bk, bk_cap)
    while tile.bn * bk < 16 * 32 * tile.warps and bk < bk_cap:  # 16 bytes per thread and row
        bk *= 2
    return tile._replace(bk=bk)


def pack_gate_up(
    q1: torch.Tensor, s1: torch.Tensor, q3: torch.Tensor, s3: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate (q1, s1) and up (q3, s3) weights [I, In] -> one [2I, In] weight for `act="swiglu"`."""
    return torch.cat([q1, q3]), torch.cat([s1, s3])


def mxfp8_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    config: Config | None = None,
    act: str | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    q4=None,
) -> torch.Tensor:
    """x [T, In] (bf16 or fp32) @ dequant(q [O, In] e4m3, scale [O, In/32] uint8).T -> [T, O] in x's dtype.

    act="swiglu": q holds [gate rows; up rows] (`pack_gate_up`), and the result is the clamped
    swiglu(gate, up, alpha, limit) [T, O/2]. `q4`: a 4-bit weight instead (q and scale are its
    values [O, In/2] and scales), read by the same kernels (`weight_tile`).
    """
    t, kdim = x.shape
    rows = q.shape[0]
    fmt, group, extra = _format(q4)
    assert q.shape[1] * (2 if q4 is not None else 1) == kdim and scale.shape == (rows, kdim // group)
    assert act in (None, "swiglu") and q.numel() < 2**31
    g = 2 if act else 1
    n = rows // g
    assert n * g == rows
    x = x.contiguous()
    if config is None and act is None and (t >= DEQUANT_MIN_T or (q4 is not None and t > GEMV_MAX_T)):
        # 4 bits past the GEMVs too: the tiles' dequantisation costs more than writing the weight once
        return torch.nn.functional.linear(x, dequantize(q, scale, x.dtype, q4))
    y = torch.empty(t, n, device=x.device, dtype=x.dtype)
    cfg = config or matmul_config(t, n, kdim, sm_count(x.device), act is not None)
    cfg = cfg._replace(bk=max(cfg.bk, group))
    extra = extra if extra is not None else scale
    common = dict(
        FMT=fmt, GROUP=group, KLOOP=kdim if interpreted() else 0, EVEN_K=kdim % cfg.bk == 0, G=g,
        PREC=precision(x), BN=cfg.bn, BK=cfg.bk, STAGES=cfg.stages, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    args = (
        x, q, scale, extra, y, t, n, kdim, x.stride(0), q.stride(0), scale.stride(0), extra.stride(0),
        y.stride(0), alpha, limit,
    )  # fmt: skip
    if cfg.kernel == "tile":
        _mxfp8_matmul_kernel[(triton.cdiv(t, cfg.bm), triton.cdiv(n, cfg.bn))](*args, BM=cfg.bm, **common)
    else:
        assert t <= GEMV_MAX_T, "the GEMV kernel holds at most 16 rows"
        dot = cfg.kernel == "gemv_tc"
        bt = 16 if dot else triton.next_power_of_2(t)
        _mxfp8_gemv_kernel[(triton.cdiv(n, cfg.bn),)](*args, DOT=dot, BT=bt, **common)
    return y
