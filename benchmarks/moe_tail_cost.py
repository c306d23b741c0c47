"""Where a merged short block's time goes in the gate/up kernel: variants that leave one part of
the tail's work out, timed against the engine's kernel (GPU, release dimensions). An
experiment: the variants compute wrong outputs on purpose and the engine does not use them.

    PYTHONPATH=. python3 benchmarks/moe_tail_cost.py [--tails 1,64] [--rounds 2]
    ncu --clock-control none -k regex:_moe_gate_up --section SpeedOfLight \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \\
        --section WarpStateStats python3 benchmarks/moe_tail_cost.py --once

Every expert takes exactly 256 + t pairs (`moe_routings.py --tails`), so half the working
programs take a short block of t pairs as T extra rows (`moe_triton._gate_up_merged`). Variants
of that merged path (`MODE`):

- 0: as the engine (checked bit for bit against `moe_triton.gate_up`);
- 1: no tail work (its rows stored as zeros): the price of the merged programs' other work;
- 2: the tail's two products on a constant zero tile instead of its gathered token rows: the
  products without their loads;
- 3: the gathered rows and the gate product only (up's tail left at zero): one product of two;
- 5: the whole block's products transposed as well (w @ a.T) with the weight tiles in
  registers, the left operand of both blocks' products, so that the short block reads only its
  token rows from shared memory (the model's cost) -- Triton keeps a loaded operand in shared
  memory unless arithmetic touches it, hence a multiplication by a runtime one;
- 6: 5 without the short block's products;
- 4: as the engine, and every other whole block of the expert multiplies the same short block
  too, storing nothing (outputs equal to the engine's): whether the merged programs cost most by
  falling behind the programs that share their weight tiles, which then no longer find those
  tiles in L2 (Nsight Compute: 10.4 GB read from DRAM at 256 pairs an expert, 17.2 GB at 257).

Differences between the rows place the short block's cost in its loads or its products (the
record's model says the products, which read the weight tile again from shared memory:
`benchmarks/results/moe_core_h200.md`). `--once` runs each call once more after the first
(which compiles and checks), for a profiler; `--bench` adds layer 1's routing of the bench slice (engine, modes
0, 5 and 6). Results in `moe_core_h200.md`.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import triton
import triton.language as tl

from benchmarks.moe_gluon_down import layer1_inputs
from benchmarks.moe_routings import A, E, T, random_experts, spread
from benchmarks.step_energy import per_call
from m3lm.bench.gpu_meter import GpuMeter
from m3lm.kernels import moe_triton as mt
from m3lm.kernels.host import precision
from m3lm.kernels.moe_triton import _gate_up_rows, _program, _rows_tile, _slot_rows, _swiglu, _tail

ALPHA, LIMIT = 1.702, 7.0


@triton.jit
def _store_columns(h_ptr, pairs, ok, offs_n, n_ok, gate, up, alpha, limit, s_hm):
    """h[pairs] = swiglu(gate, up) from [BN, P] tiles (one pair a column), where ok."""
    h = _swiglu(gate, up, alpha, limit)
    out = h_ptr + pairs[None, :].to(tl.int64) * s_hm + offs_n[:, None]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=ok[None, :] & n_ok[:, None])


@triton.jit
def _merged_variant(
    a_ptr, w1_ptr, w3_ptr, h_ptr, sorted_ptr, e, start, pid_n, M, TOP_K, alpha, limit, s_am, s_we, s_wn, s_hm,
    N: tl.constexpr, KDIM: tl.constexpr, PREC: tl.constexpr, R: tl.constexpr, T: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, MODE: tl.constexpr, tail_start, store_tail,
):  # fmt: skip
    """`moe_triton._gate_up_merged` with parts of the tail's work left out (MODE, above); the
    short block's slots from `tail_start`, stored only with `store_tail`."""
    pairs, valid, rows = _slot_rows(sorted_ptr, start, M, TOP_K, R, False)
    tails, t_valid, t_rows = _slot_rows(sorted_ptr, tail_start, M, TOP_K, T, False)
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
        w_off = e * s_we + offs_n[None, :] * s_wn + kk[:, None]
        w_ok = (offs_n[None, :] < N) & k_ok[:, None]
        w1 = tl.load(w1_ptr + w_off, mask=w_ok, other=0.0)  # [BK, BN]
        w3 = tl.load(w3_ptr + w_off, mask=w_ok, other=0.0)
        gate += tl.dot(a, w1, out_dtype=tl.float32, input_precision=PREC)
        up += tl.dot(a, w3, out_dtype=tl.float32, input_precision=PREC)
        if MODE == 0 or MODE == 3 or MODE == 4:
            a_t = _rows_tile(a_ptr, t_rows, t_valid, kk, s_am, KDIM, True)  # [BK, T]
            gate_t += tl.dot(tl.trans(w1), a_t, out_dtype=tl.float32, input_precision=PREC)
            if MODE != 3:
                up_t += tl.dot(tl.trans(w3), a_t, out_dtype=tl.float32, input_precision=PREC)
        if MODE == 2:
            zero = tl.zeros([BK, T], a.dtype)
            gate_t += tl.dot(tl.trans(w1), zero, out_dtype=tl.float32, input_precision=PREC)
            up_t += tl.dot(tl.trans(w3), zero, out_dtype=tl.float32, input_precision=PREC)
    n_ok = offs_n < N
    h = _swiglu(gate, up, alpha, limit)
    tl.store(
        h_ptr + pairs[:, None].to(tl.int64) * s_hm + offs_n[None, :],
        h.to(h_ptr.dtype.element_ty),
        mask=valid[:, None] & n_ok[None, :],
    )
    _store_columns(h_ptr, tails, t_valid & store_tail, offs_n, n_ok, gate_t, up_t, alpha, limit, s_hm)


@triton.jit
def _merged_regs(
    a_ptr, w1_ptr, w3_ptr, h_ptr, sorted_ptr, e, start, pid_n, M, TOP_K, alpha, limit, s_am, s_we, s_wn, s_hm,
    N: tl.constexpr, KDIM: tl.constexpr, PREC: tl.constexpr, R: tl.constexpr, T: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, MODE: tl.constexpr, tail_start, store_tail,
):  # fmt: skip
    """MODE 5 / 6: the whole block transposed too (w @ a.T, [BN, R]), the weight tiles taken into
    registers once a K step as the left operand of the block's products and (5) of the short
    block's, so that the short block reads only its token rows from shared memory."""
    pairs, valid, rows = _slot_rows(sorted_ptr, start, M, TOP_K, R, False)
    tails, t_valid, t_rows = _slot_rows(sorted_ptr, tail_start, M, TOP_K, T, False)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    gate = tl.zeros([BN, R], tl.float32)
    up = tl.zeros([BN, R], tl.float32)
    one = (tl.zeros([1, 1], tl.float32) * limit + 1.0).to(h_ptr.dtype.element_ty)  # not a constant
    gate_t = tl.zeros([BN, T], tl.float32)
    up_t = tl.zeros([BN, T], tl.float32)
    for k0 in range(0, KDIM, BK):
        kk = k0 + offs_k
        k_ok = kk < KDIM
        a = _rows_tile(a_ptr, rows, valid, kk, s_am, KDIM, True)  # [BK, R]
        w_off = e * s_we + offs_n[:, None] * s_wn + kk[None, :]
        w_ok = (offs_n[:, None] < N) & k_ok[None, :]
        # times a runtime one (exact): arithmetic keeps the tiles in registers for the products
        w1 = tl.load(w1_ptr + w_off, mask=w_ok, other=0.0) * one  # [BN, BK]
        w3 = tl.load(w3_ptr + w_off, mask=w_ok, other=0.0) * one
        gate += tl.dot(w1, a, out_dtype=tl.float32, input_precision=PREC)
        up += tl.dot(w3, a, out_dtype=tl.float32, input_precision=PREC)
        if MODE == 5:
            a_t = _rows_tile(a_ptr, t_rows, t_valid, kk, s_am, KDIM, True)  # [BK, T]
            gate_t += tl.dot(w1, a_t, out_dtype=tl.float32, input_precision=PREC)
            up_t += tl.dot(w3, a_t, out_dtype=tl.float32, input_precision=PREC)
    n_ok = offs_n < N
    _store_columns(h_ptr, pairs, valid, offs_n, n_ok, gate, up, alpha, limit, s_hm)
    _store_columns(h_ptr, tails, t_valid & store_tail, offs_n, n_ok, gate_t, up_t, alpha, limit, s_hm)


@triton.jit
def _tail_everywhere(sorted_ptr, ends_ptr, e, pid_m, M, BM: tl.constexpr, TAIL: tl.constexpr):
    """`moe_triton._tail` for MODE 4: (skip, T, the short block's first slot, store) where every
    whole block of an expert whose last block is merged takes T (only the last one stores)."""
    end = tl.load(ends_ptr + e) // BM
    first = tl.load(ends_ptr + e - 1, mask=e > 0, other=0) // BM
    last = (end - 1) * BM
    skip = (pid_m == end - 1) & (pid_m > first) & (tl.load(sorted_ptr + last + TAIL) >= M)
    t = 0
    if (pid_m < end - 1) & (end - 1 > first):
        t = tl.where(tl.load(sorted_ptr + last + TAIL) >= M, TAIL, 0)
        t = tl.where(tl.load(sorted_ptr + last + 32) >= M, 32, t)
        t = tl.where(tl.load(sorted_ptr + last + 16) >= M, 16, t)
    return skip, t, last, pid_m == end - 2


@triton.jit
def _moe_gate_up_variant(
    a_ptr, w1_ptr, w3_ptr, h_ptr, sorted_ptr, expert_ptr, used_ptr, ends_ptr,
    M, TOP_K, alpha, limit,
    s_am, s_we, s_wn, s_hm,
    N: tl.constexpr, KDIM: tl.constexpr, PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ALIGN_M: tl.constexpr, GROUP_M: tl.constexpr,
    TAIL: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    """`moe_triton._moe_gate_up_kernel` with `_merged_variant` for its merged short blocks."""
    pid_m, pid_n, rows, e = _program(
        sorted_ptr, expert_ptr, used_ptr, ends_ptr, M, N, BM, BN, ALIGN_M, GROUP_M, True
    )
    if rows == 0:
        return
    if MODE == 4:
        skip, t, tail_start, store = _tail_everywhere(sorted_ptr, ends_ptr, e, pid_m, M, BM, TAIL)
    else:
        skip, t = _tail(sorted_ptr, ends_ptr, e, pid_m, M, BM, TAIL)
        tail_start, store = pid_m * BM + BM, True
    if skip:
        return
    args = (a_ptr, w1_ptr, w3_ptr, h_ptr, sorted_ptr, e, pid_m * BM, pid_n, M, TOP_K, alpha, limit)
    tail = (tail_start, store)
    if t == 16 and MODE >= 5:
        _merged_regs(*args, s_am, s_we, s_wn, s_hm, N, KDIM, PREC, BM, 16, BN, BK, MODE, *tail)
    elif t == 16:
        _merged_variant(*args, s_am, s_we, s_wn, s_hm, N, KDIM, PREC, BM, 16, BN, BK, MODE, *tail)
    elif t == 32 and MODE >= 5:
        _merged_regs(*args, s_am, s_we, s_wn, s_hm, N, KDIM, PREC, BM, 32, BN, BK, MODE, *tail)
    elif t == 32:
        _merged_variant(*args, s_am, s_we, s_wn, s_hm, N, KDIM, PREC, BM, 32, BN, BK, MODE, *tail)
    elif t == 64 and MODE >= 5:
        _merged_regs(*args, s_am, s_we, s_wn, s_hm, N, KDIM, PREC, BM, 64, BN, BK, MODE, *tail)
    elif t == 64:
        _merged_variant(*args, s_am, s_we, s_wn, s_hm, N, KDIM, PREC, BM, 64, BN, BK, MODE, *tail)
    elif rows < BM:
        _gate_up_rows(*args, s_am, s_we, s_wn, s_hm, N, KDIM, PREC, BM // 2, BN, BK)
    else:
        _gate_up_rows(*args, s_am, s_we, s_wn, s_hm, N, KDIM, PREC, BM, BN, BK)


def variant(x, w1, w3, m, aligned, block_m, config, mode: int) -> torch.Tensor:
    """h [M, I] from `_moe_gate_up_variant` (prefill tiles, merged short blocks of up to 64)."""
    n, kdim = w1.shape[1], w1.shape[2]
    h = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bn, bk, warps, stages, group = config
    _moe_gate_up_variant[(mt.row_blocks(aligned, m, block_m) * triton.cdiv(n, bn),)](
        x, w1, w3, h, *aligned, m, A, ALPHA, LIMIT,
        x.stride(0), w1.stride(0), w1.stride(1), h.stride(0),
        N=n, KDIM=kdim, PREC=precision(x), BM=block_m, BN=bn, BK=bk, ALIGN_M=block_m, GROUP_M=group,
        TAIL=mt.MERGED_TAIL["gate_up"], MODE=mode, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return h


def calls(x, ids, w1, w3, modes=range(7)) -> dict[str, object]:
    """The engine's gate/up on (x, ids) and the variants, those meant to be exact checked: 0 and
    4 bit for bit, 5 (the same products transposed) within bf16's rounding of the outputs."""
    m = ids.numel()
    (block_m, config), _ = mt.tiles(m, x.dtype)
    aligned = mt.align(ids, E, block_m)
    engine = partial(mt.gate_up, x, w1, w3, m, A, aligned, ALPHA, LIMIT, block_m, config)
    out = {"engine": engine}
    want = engine()
    for mode in modes:
        fn = partial(variant, x, w1, w3, m, aligned, block_m, config, mode)
        if mode in (0, 4):
            assert torch.equal(fn(), want), f"variant {mode} differs from the engine's kernel"
        if mode == 5:
            got = fn()
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            print(f"mode 5 against the engine: bitwise equal {torch.equal(got, want)}, max error {err:.2e}")
            assert err < 1e-2, err
        out[f"mode {mode}"] = fn
    return out


def even(t: int, w1, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, ids) with every expert at 256 + t pairs of independently drawn random tokens."""
    tokens = E // A * (T * A // E + t)
    x = torch.randn(tokens, w1.shape[2], device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, spread(tokens, gen)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tails", type=lambda v: [int(x) for x in v.split(",")], default=[1, 64])
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--once", action="store_true", help="each call once more, for a profiler")
    p.add_argument("--bench", action="store_true", help="also layer 1's routing of the bench slice")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1, w3, _ = random_experts(gen)
    routings = {f"256 + {t} pairs an expert": calls(*even(t, w1, gen), w1, w3) for t in [0, *args.tails]}
    if args.bench:
        x, _, ids, b1, b3, *_ = layer1_inputs()
        routings["bench slice layer 1"] = calls(x, ids, b1, b3, modes=(0, 5, 6))
    if args.once:  # each call has run once (compiled, checked); once more, in this order
        for t, fns in routings.items():
            for name, fn in fns.items():
                fn()
                torch.cuda.synchronize()
                print(f"{t}: {name} run once more", flush=True)
        return
    meter = GpuMeter.open()
    for r in range(args.rounds):
        for t, fns in routings.items():
            for name, fn in fns.items():
                if t.startswith("256 + 0 ") and name != "engine":
                    continue  # no short blocks: the variants are the engine's kernel
                ms, j, w = per_call(meter, fn, args.seconds)
                print(
                    f"round {r} {t}, {name}: {ms:.3f} ms {j:.3f} J {w:.0f} W",
                    flush=True,
                )


if __name__ == "__main__":
    main()
