"""The MoE down GEMM as a persistent Gluon kernel for Hopper, against the engine's Triton kernel
(`moe_triton.grouped_gemm`, prefill tiles), in time and energy (GPU, release dimensions). An
experiment: the engine does not use this kernel.

    PYTHONPATH=. python3 benchmarks/moe_gluon_down.py [--rounds 3] [--seconds 2]

The kernel: the left operand (the SwiGLU activations) laid out by slot of the `Aligned` layout,
so that every row block is 128 consecutive rows and both operands come by TMA; one program per
SM takes the output tiles of `grouped_pid`'s order from a counter; async `wgmma` with one group
in flight over a ring of 4 stages; the first stages of a program's next tile issued during the
last steps of the current one, so that the epilogue (the routing weight times the fp32
accumulator, stored from the registers to each pair's row) runs under them; a block of at most
64 pairs as a 64-row product on the same stages. A short last block is not merged into its
expert's previous block, as the Triton kernel's `_tail` does.

The inputs are those of layer 1 of the 4-layer bench slice in one 8k prefill step (its
activations gathered into slot order here), plus a routing of 4 experts x 8192 rows (large
groups, no padding). Each row: ms, J and W per call, back to back (`step_energy.per_call`), the
two kernels alternating. Results in `benchmarks/results/moe_core_h200.md`.
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from benchmarks.step_energy import capture, per_call
from m3lm.bench.gpu_meter import GpuMeter
from m3lm.bench.slice import build_slice
from m3lm.kernels import moe_triton as mt
from m3lm.kernels.moe import route, router_logits

BM, BN, BK, STAGES, GROUP_M, WARPS = 128, 256, 64, 4, 16, 8


@gluon.jit
def _tile_of(t, expert_ptr, ends_ptr, BM: gl.constexpr, N_COLS: gl.constexpr, GROUP_M: gl.constexpr):
    """(row block, column block, expert) of tile t, in `moe_triton.grouped_pid`'s order (every tile
    below used // BM * N_COLS is live: the slots are aligned to BM)."""
    e = gl.load(expert_ptr + t // N_COLS)
    end = gl.load(ends_ptr + e) // BM
    start = gl.where(e > 0, gl.load(ends_ptr + gl.maximum(e - 1, 0)), 0) // BM
    local = t - start * N_COLS
    per_group = GROUP_M * N_COLS
    first = start + (local // per_group) * GROUP_M
    size = gl.maximum(gl.minimum(end - first, GROUP_M), 1)
    return first + (local % per_group) % size, (local % per_group) // size, e


@gluon.jit
def _load(a_desc, b_desc, bars, a_bufs, b_bufs, n, off_m, w_row, k, NB: gl.constexpr, pred):
    """Copy step n's operands (rows off_m.. of a, weight rows w_row.., columns k..) into stage n % NB."""
    s = n % NB
    bar = bars.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(s), pred)
    tma.async_copy_global_to_shared(b_desc, [w_row, k], bar, b_bufs.index(s), pred)


@gluon.jit
def _tile(
    a_desc, b_desc, bars, a_bufs, b_bufs, c_ptr, sorted_ptr, scale_ptr, M, s_cm, n, off_m, w_row, col,
    nxt_m, nxt_w, has_next, ROWS: gl.constexpr, LAYOUT: gl.constexpr, KT: gl.constexpr, NB: gl.constexpr,
):  # fmt: skip
    """One output tile [ROWS, BN]: the K loop from stage counter n (each step's copies already
    issued NB - 1 steps ahead; the last steps issue the next tile's first), then the epilogue."""
    BN: gl.constexpr = b_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    acc = gl.zeros([ROWS, BN], gl.float32, LAYOUT)
    for k in range(KT):
        s = n % NB
        mbarrier.wait(bars.index(s), (n // NB) & 1)
        a = a_bufs.index(s)
        if a_desc.block_type.shape[0] > ROWS:
            a = a.slice(0, ROWS)
        acc = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), acc, use_acc=k > 0, is_async=True)
        acc, _, _ = warpgroup_mma_wait(1, deps=[acc, a, b_bufs.index(s)])  # step n - 1's stage is free
        ahead = k + NB - 1
        if ahead < KT:
            _load(a_desc, b_desc, bars, a_bufs, b_bufs, n + NB - 1, off_m, w_row, ahead * BK, NB, True)
        else:  # the next tile's first steps
            nxt = (n + NB - 1, nxt_m, nxt_w, (ahead - KT) * BK)
            _load(a_desc, b_desc, bars, a_bufs, b_bufs, *nxt, NB, has_next)
        n += 1
    acc = warpgroup_mma_wait(0, deps=[acc])
    pairs = gl.load(sorted_ptr + off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT)))  # [ROWS]
    valid = pairs < M
    out = acc * gl.load(scale_ptr + pairs, mask=valid, other=0.0)[:, None]
    offs_n = col * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, LAYOUT))
    gl.store(c_ptr + pairs[:, None].to(gl.int64) * s_cm + offs_n[None, :], out, mask=valid[:, None])
    return n


@gluon.jit
def _down_kernel(
    a_desc, b_desc, c_ptr, sorted_ptr, expert_ptr, used_ptr, ends_ptr, scale_ptr, counter_ptr, M, s_cm,
    N: gl.constexpr, KDIM: gl.constexpr, NB: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """c[pair] = scale[pair] * a[slot] @ w[expert].T for every slot of the `Aligned` layout."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    N_COLS: gl.constexpr = N // BN
    KT: gl.constexpr = KDIM // BK
    # a whole block: every warp on 16 rows; a half block: two warpgroups on two column halves
    whole: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
    )
    half: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, num_warps // 4], instr_shape=[16, BN * 4 // num_warps, 16]
    )

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NB, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NB, BN, BK], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NB):
        mbarrier.init(bars.index(i), count=1)

    # Tiles are taken in order from a counter, so that the tiles in flight stay a window of the
    # launch order (its grouping reads each expert's weights about once) however long each takes.
    n_tiles = gl.load(used_ptr) // BM * N_COLS
    t = gl.atomic_add(counter_ptr, 1)
    row, col, e = _tile_of(gl.minimum(t, n_tiles - 1), expert_ptr, ends_ptr, BM, N_COLS, GROUP_M)
    off_m = row * BM
    w_row = e * N + col * BN
    for j in gl.static_range(NB - 1):
        _load(a_desc, b_desc, bars, a_bufs, b_bufs, j, off_m, w_row, j * BK, NB, t < n_tiles)
    n = 0
    while t < n_tiles:
        nt = gl.atomic_add(counter_ptr, 1)
        nrow, ncol, ne = _tile_of(gl.minimum(nt, n_tiles - 1), expert_ptr, ends_ptr, BM, N_COLS, GROUP_M)
        nxt_m = nrow * BM
        nxt_w = ne * N + ncol * BN
        args = (
            a_desc,
            b_desc,
            bars,
            a_bufs,
            b_bufs,
            c_ptr,
            sorted_ptr,
            scale_ptr,
            M,
            s_cm,
            n,
            off_m,
            w_row,
            col,
        )
        if gl.load(sorted_ptr + off_m + BM // 2) >= M:  # at most BM / 2 pairs
            n = _tile(*args, nxt_m, nxt_w, nt < n_tiles, BM // 2, half, KT, NB)
        else:
            n = _tile(*args, nxt_m, nxt_w, nt < n_tiles, BM, whole, KT, NB)
        t = nt
        col = ncol
        off_m = nxt_m
        w_row = nxt_w
    for i in gl.static_range(NB):
        mbarrier.invalidate(bars.index(i))


def gluon_down(h_slots, w2, m, aligned, scale):
    """scale[pair] * h_slots[slot of pair] @ w2[expert].T -> [M, C] fp32; h_slots [EM, I] bf16."""
    e, c, i = w2.shape
    a_desc = TensorDescriptor.from_tensor(
        h_slots, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    )
    b_layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    b_desc = TensorDescriptor.from_tensor(w2.reshape(e * c, i), [BN, BK], b_layout)
    out = torch.empty(m, c, device=w2.device, dtype=torch.float32)
    counter = torch.zeros(1, device=w2.device, dtype=torch.int32)
    sms = torch.cuda.get_device_properties(w2.device).multi_processor_count
    _down_kernel[(sms,)](
        a_desc, b_desc, out, *aligned, scale, counter, m, out.stride(0),
        N=c, KDIM=i, NB=STAGES, GROUP_M=GROUP_M, num_warps=WARPS,
    )  # fmt: skip
    return out


def layer1_inputs():
    """(x [T, C], weights [T, A], ids [T, A], w1, w3, w2, alpha, limit) of layer 1's MoE in one 8k step."""
    model = build_slice(4)
    moe = model.model.layers[1].block_sparse_moe
    x = capture(model, 8192)[1]["moe"]
    with torch.inference_mode():
        weights, ids = route(
            router_logits(x, moe.gate.weight, moe._router_split(x)), moe.e_score_correction_bias, 4
        )
    ex = moe.experts
    return x, weights, ids, ex.w1, ex.w3, ex.w2, moe.alpha, moe.limit


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()
    meter = GpuMeter.open()
    x, weights, ids, w1, w3, w2, alpha, limit = layer1_inputs()
    t, a = ids.shape
    large = torch.arange(a, device=ids.device).expand(t, a).contiguous()
    for name, route_ids in (("bench slice layer 1", ids), ("4 experts x 8192", large)):
        (up_m, up_cfg), (down_m, down_cfg) = mt.tiles(t * a, x.dtype)
        aligned = mt.align(route_ids, w1.shape[0], down_m)
        scale = weights.flatten().float().contiguous()
        h = mt.gate_up(x, w1, w3, t * a, a, aligned, alpha, limit, up_m, up_cfg)  # [M, I] by pair
        padded = torch.cat([h, torch.zeros_like(h[:1])])
        h_slots = padded[aligned.sorted_ids.long()]  # [EM, I] by slot; padding slots zero

        def triton_down(h=h, aligned=aligned, scale=scale, bm=down_m, cfg=down_cfg):
            return mt.grouped_gemm(h, w2, t * a, a, aligned, True, scale, torch.float32, bm, cfg)

        def glu(h_slots=h_slots, aligned=aligned, scale=scale):
            return gluon_down(h_slots, w2, t * a, aligned, scale)

        with torch.inference_mode():
            equal = torch.equal(triton_down(), glu())
        counts = torch.bincount(route_ids.flatten(), minlength=w1.shape[0])
        print(f"{name}: tokens per expert {counts.min().item()}..{counts.max().item()}, "
              f"slots {aligned.used.item()}, outputs bitwise equal: {equal}", flush=True)  # fmt: skip
        flops = 2 * t * a * w2.shape[1] * w2.shape[2]
        for r in range(args.rounds):
            order = (("triton", triton_down), ("gluon", glu))
            parts = []
            for kernel, fn in order if r % 2 == 0 else order[::-1]:
                with torch.inference_mode():
                    ms, joules, watts = per_call(meter, fn, args.seconds)
                parts.append(
                    f"{kernel} {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s {joules:.3f} J {watts:.0f} W"
                )
            print(f"  round {r}: " + " | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
