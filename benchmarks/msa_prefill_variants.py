"""Variants of the block-sparse MSA prefill attention against the engine's Triton kernel
(`msa_prefill_triton`), in time and energy (GPU, release dimensions):

- the engine's kernel with a compare and select per score on every step (`row_masks=False`, its
  form before steps that every row sees whole were masked by row);
- a Gluon kernel for Hopper whose softmax runs under its own matrix products (an experiment: the
  engine does not use it).

    PYTHONPATH=. python3 benchmarks/msa_prefill_variants.py [--rounds 3] [--seconds 1.5]

Triton 3.6 waits for every `wgmma` as soon as it is issued, so one program's softmax never runs
under its own tensor-core work; only the other program on the SM fills that time. The Gluon
kernel places the waits by hand, as flash attention 3 does within a warpgroup: step j's q k^T is
issued, then step j - 1's p v, and step j's softmax runs on the CUDA cores while that p v runs
on the tensor cores. Everything else is the Triton kernel's: the same tiles (4 queries x 16
heads, `group_queries`), the same union of blocks and bits per query (`tile_blocks`), 64 keys a
step by TMA copies, the masks per score and online softmax in fp32; its outputs equal the
Triton kernel's bit for bit.

Inputs: the step's own call of layer 1 (the 4-layer bench slice at 8192 tokens, captured by
`step_energy.capture`), and random queries, keys and values of `--long` tokens with the bench's
two kinds of selection (`bench_attention.selection`). Each row: ms, J and W per call back to
back (`step_energy.per_call`), the kernels alternating, and the largest difference from the
engine's kernel. Then the whole 8k step with and without the masks by row, alternating. Results
in `benchmarks/results/prefill_configs_h200.md`.
"""

from __future__ import annotations

import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from m3lm.kernels.msa_prefill_triton import ROWS
from m3lm.kernels.msa_tiles import group_queries, tile_blocks

BN = gl.constexpr(64)  # keys a step (two programs share an SM, as in the Triton kernel)
STAGES = 3  # K/V stages
_FAR = gl.constexpr(1 << 30)  # a key position past every query (masked keys)


@gluon.jit
def _issue(k_desc, v_desc, bars, k_bufs, v_bufs, blocks_ptr, n, n_iter, kh, D: gl.constexpr, S: gl.constexpr,
           NB: gl.constexpr):  # fmt: skip
    """The TMA copies of step n's K and V rows (if n < n_iter) into stage n % NB."""
    NSUB: gl.constexpr = S // BN
    live = n < n_iter
    blk = gl.load(blocks_ptr + n // NSUB, mask=live, other=0)
    row = blk * S + (n % NSUB) * BN
    bar = bars.index(n % NB)
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=live)
    tma.async_copy_global_to_shared(k_desc, [row, kh * D], bar, k_bufs.index(n % NB), live)
    tma.async_copy_global_to_shared(v_desc, [row, kh * D], bar, v_bufs.index(n % NB), live)


@gluon.jit
def _softmax(s, j, blocks_ptr, word, pos, tk, qk_scale, m_i, l_i, offs_b, S: gl.constexpr):
    """Step j's masks and online softmax (`msa_prefill_triton._attend_block`'s): (p, the factor
    on the earlier sums, running max, running sum)."""
    NSUB: gl.constexpr = S // BN
    slot = j // NSUB  # the block's place in the tile's union
    blk = gl.load(blocks_ptr + slot)
    take = ((word >> slot.to(gl.int64)) & 1) != 0  # rows whose query chose blk
    key_pos = blk * S + (j % NSUB) * BN + offs_b
    lim = gl.where(take, pos, -1)  # the last key each row keeps
    s = gl.where(gl.where(key_pos < tk, key_pos, _FAR)[None, :] <= lim[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)  # running max, in log2 units
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _gluon_prefill_kernel(
    q_ptr, k_desc, v_desc, order_ptr, bits_ptr, blocks_ptr, count_ptr, out_ptr,
    first_pos, t_len, tk, qk_scale,
    s_qt, s_qh, s_rk, s_wk, s_wt, s_bk, s_bt, s_ck, s_ot, s_oh,
    G: gl.constexpr, BQ: gl.constexpr, RP: gl.constexpr, D: gl.constexpr, S: gl.constexpr,
    NB: gl.constexpr, Q_REGS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """`msa_prefill_triton._prefill_kernel` with SPARSE, ORDERED, TMA and one word of bits per query."""
    NSUB: gl.constexpr = S // BN
    tile = gl.program_id(0)
    kh = gl.program_id(1)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BN, 16])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, D, 16])  # fmt: skip
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    blocks_ptr = blocks_ptr + kh * s_bk + tile * s_bt

    # q rows [RP, D] (each a query and a head of the group) into shared memory, once
    rq = gl.arange(0, RP, layout=gl.SliceLayout(1, q_layout))
    at_q = tile * BQ + rq // G
    ok_q = (rq < BQ * G) & (at_q < t_len)
    t_q = gl.load(order_ptr + kh * s_rk + at_q, mask=ok_q, other=0)
    offs_dq = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(
        q_ptr + t_q[:, None].to(gl.int64) * s_qt + (kh * G + rq % G)[:, None] * s_qh + offs_dq[None, :],
        mask=ok_q[:, None],
        other=0.0,
    )
    if Q_REGS:  # the left operand of q k^T from registers
        q_a = gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    else:
        q_a = gl.allocate_shared_memory(
            gl.bfloat16, [RP, D], gl.NVMMASharedLayout.get_default_for([RP, D], gl.bfloat16), q
        )

    # each row's query position and its word of bits, in the scores' layout
    rows = gl.arange(0, RP, layout=rows_s)
    at = tile * BQ + rows // G
    row_ok = (rows < BQ * G) & (at < t_len)
    pos = first_pos + gl.load(order_ptr + kh * s_rk + at, mask=row_ok, other=0)
    word = gl.load(bits_ptr + kh * s_wk + tile * s_wt + rows // G, mask=row_ok, other=0)
    last = gl.max(gl.where(row_ok, pos, 0), axis=0)  # the tile's last query
    count = gl.load(count_ptr + kh * s_ck + tile)
    top = gl.load(blocks_ptr + count - 1, mask=count > 0, other=0)
    n_iter = gl.where(count > 0, (count - 1) * NSUB + gl.minimum((last - top * S) // BN + 1, NSUB), 0)

    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [NB, BN, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.bfloat16, [NB, BN, D], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NB):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    for i in gl.static_range(NB):
        _issue(k_desc, v_desc, bars, k_bufs, v_bufs, blocks_ptr, i, n_iter, kh, D, S, NB)

    zero_s = gl.zeros([RP, BN], gl.float32, s_layout)
    offs_b = gl.arange(0, BN, layout=cols_s)
    # step 0's scores, then each step j: q k_j^T issued, step j - 1's p v issued after it, step j's
    # softmax on the CUDA cores while that p v runs on the tensor cores
    mbarrier.wait(bars.index(0), 0, pred=n_iter > 0)
    s_tok = warpgroup_mma(q_a, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_tok, q_a, k_bufs.index(0)])[0]
    m_i = gl.full([RP], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([RP], gl.float32, rows_s)
    p, alpha, m_i, l_i = _softmax(s, 0, blocks_ptr, word, pos, tk, qk_scale, m_i, l_i, offs_b, S)
    acc = gl.zeros([RP, D], gl.float32, o_layout)
    for j in range(1, n_iter):
        mbarrier.wait(bars.index(j % NB), (j // NB) & 1)
        s_tok = warpgroup_mma(q_a, k_bufs.index(j % NB).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        prev = (j - 1) % NB
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        o_tok = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_tok, q_a, k_bufs.index(j % NB)])[0]  # step j's scores
        p, alpha, m_i, l_i = _softmax(s, j, blocks_ptr, word, pos, tk, qk_scale, m_i, l_i, offs_b, S)
        acc = warpgroup_mma_wait(0, deps=[o_tok, v_bufs.index(prev)])[0]
        # step j - 1's stage is free: it takes step j - 1 + NB
        _issue(k_desc, v_desc, bars, k_bufs, v_bufs, blocks_ptr, j - 1 + NB, n_iter, kh, D, S, NB)
    last_v = (n_iter - 1 + NB) % NB
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    o_tok = warpgroup_mma(
        gl.convert_layout(p.to(gl.bfloat16), p_layout), v_bufs.index(last_v), acc, is_async=True
    )
    acc = warpgroup_mma_wait(0, deps=[o_tok, v_bufs.index(last_v)])[0]
    acc = gl.where(n_iter > 0, acc, 0.0)  # no step: nothing was loaded
    for i in gl.static_range(NB):
        mbarrier.invalidate(bars.index(i))

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]  # padding rows saw no key
    ro = gl.arange(0, RP, layout=gl.SliceLayout(1, o_layout))
    at_o = tile * BQ + ro // G
    ok_o = (ro < BQ * G) & (at_o < t_len)
    t_o = gl.load(order_ptr + kh * s_rk + at_o, mask=ok_o, other=0)
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(
        out_ptr + t_o[:, None].to(gl.int64) * s_ot + (kh * G + ro % G)[:, None] * s_oh + offs_d[None, :],
        out.to(gl.bfloat16),
        mask=ok_o[:, None],
    )


def gluon_prefill(
    q,
    k,
    v,
    scale: float,
    block_ids: torch.Tensor,
    block_size: int,
    first_pos: int,
    stages=STAGES,
    q_regs=False,
):
    """`msa_prefill_attention(q, k, v, pos, scale, block_ids, block_size, first_pos)` for bf16
    q [T, H, D], k and v [Tk, K, D] on a Hopper GPU -> ([T, H, D], the compiled kernel)."""
    t_len, n_heads, d = q.shape
    tk, n_kv = k.shape[0], k.shape[1]
    g = n_heads // n_kv
    bq = max(1, ROWS // g)
    nt = triton.cdiv(t_len, bq)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    order = group_queries(block_ids, bq)
    blocks, count, bits = tile_blocks(block_ids, bq, triton.cdiv(tk, block_size), order)
    assert bits.shape[-1] == 1, bits.shape  # one word of bits per query: at most 64 union slots
    bn = BN.value
    layout = gl.NVMMASharedLayout.get_default_for([bn, d], gl.bfloat16)
    k_desc, v_desc = (TensorDescriptor.from_tensor(x.view(tk, n_kv * d), [bn, d], layout) for x in (k, v))
    out = torch.empty_like(q)
    kernel = _gluon_prefill_kernel[(nt, n_kv)](
        q, k_desc, v_desc, order, bits, blocks, count, out, first_pos, t_len, tk, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), order.stride(0), bits.stride(0), bits.stride(1), blocks.stride(0),
        blocks.stride(1), count.stride(0), out.stride(0), out.stride(1),
        G=g, BQ=bq, RP=max(16, triton.next_power_of_2(bq * g)), D=d, S=block_size, NB=stages, Q_REGS=q_regs, num_warps=4,
    )  # fmt: skip
    return out, kernel


def _inputs_8k(model):
    """(q, k, v, scale, block_ids, block_size, first_pos) of layer 1's MSA attention in one 8k step."""
    from benchmarks.step_energy import capture

    _, a, _ = capture(model, 8192)[1]["sparse"]  # `_attention`'s call: (q, k, v, pos, scale, ids, S, first)
    q, k, v, _, scale, block_ids, block_size, first = a
    return q, k, v, scale, block_ids, block_size, first


def _inputs_long(kind: str, length: int):
    from m3lm.bench.attention import selection
    from m3lm.bench.slice import release_slice_config
    from m3lm.config import parse_config

    a = parse_config(release_slice_config(4))
    gen = torch.Generator(device="cuda").manual_seed(2)
    h, kv, d, s = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.index_block_size
    q = torch.randn(length, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(length, kv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return q, k, v, d**-0.5, selection(kind, kv, length, s, a, gen), s, 0


def _compare(name: str, inputs, rounds: int, seconds: float, variants, meter) -> None:
    """Rows of the table for one case: the engine's kernel, its per-score masks and each (stages,
    q in registers) variant of the Gluon kernel, alternating, `rounds` times."""
    from benchmarks.step_energy import per_call
    from m3lm.kernels.msa_prefill_triton import msa_prefill_attention

    q, k, v, scale, sel, s, first = inputs
    pos = torch.arange(first, first + q.shape[0], device="cuda")
    ref = msa_prefill_attention(q, k, v, pos, scale, sel, s, first)
    fns = {
        "engine": lambda: msa_prefill_attention(q, k, v, pos, scale, sel, s, first),
        "engine, masks per score": lambda: msa_prefill_attention(
            q, k, v, pos, scale, sel, s, first, row_masks=False
        ),
    }
    diffs = {"engine": ""}
    sm = torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor
    kernels = {}
    for stages, q_regs in variants:
        kname = f"gluon, {stages} stages, q in {'registers' if q_regs else 'shared memory'}"
        kernels[kname] = gluon_prefill(q, k, v, scale, sel, s, first, stages, q_regs)[1]
        fns[kname] = lambda stages=stages, q_regs=q_regs: gluon_prefill(
            q, k, v, scale, sel, s, first, stages, q_regs
        )[0]
    for kname, kernel in kernels.items():
        print(
            f"<!-- {name}, {kname}: {kernel.n_regs} registers, {kernel.metadata.shared} B shared, "
            f"{sm // (kernel.metadata.shared + 1024)} programs an SM by shared memory -->",
            flush=True,
        )
    for kname, fn in fns.items():
        if kname != "engine":
            got = fn()
            diff = (got.float() - ref.float()).abs().max().item()
            diffs[kname] = f"{diff:.3g}" + (" (equal)" if torch.equal(got, ref) else "")
    for r in range(rounds):
        for kname, fn in fns.items():
            ms, j, w = per_call(meter, fn, seconds)
            print(f"| {name} | {r} | {kname} | {ms:.3f} | {j:.4f} | {w:.0f} | {diffs[kname]} |", flush=True)


def _steps(model, rounds: int, seconds: float, meter) -> None:
    """The 8k step back to back with the engine's kernel and with its masks per score, alternating."""
    import functools

    from benchmarks.step_energy import per_call
    from m3lm.bench.slice import prefill_step
    from m3lm.kernels import msa_prefill_triton as mp

    engine = mp.msa_prefill_attention
    step = prefill_step(model, 8192)
    for r in range(rounds):
        for kname, fn in (
            ("engine", engine),
            ("masks per score", functools.partial(engine, row_masks=False)),
        ):
            mp.msa_prefill_attention = fn
            try:
                ms, j, w = per_call(meter, step, seconds)
            finally:
                mp.msa_prefill_attention = engine
            print(f"| 8k step | {r} | {kname} | {ms:.3f} | {j:.3f} | {w:.0f} | |", flush=True)


def main() -> None:
    from m3lm.bench.gpu_meter import GpuMeter
    from m3lm.bench.slice import build_slice

    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument(
        "--variants", default="3:1", help="stages:q-in-registers of the Gluon kernels ('' for none)"
    )
    p.add_argument("--long", type=int, default=65536, help="queries of the random inputs (0: none)")
    p.add_argument("--step-rounds", type=int, default=3, help="rounds of the whole 8k step (0: none)")
    args = p.parse_args()
    variants = [(int(a), bool(int(b))) for a, b in (v.split(":") for v in args.variants.split(",") if v)]
    meter = GpuMeter.open()
    print("| case | round | kernel | ms a call | J a call | W | max abs diff from the engine |")
    print("|---|---|---|---|---|---|---|")
    model = build_slice(4)
    _compare("8k step, layer 1", _inputs_8k(model), args.rounds, args.seconds, variants, meter)
    _steps(model, args.step_rounds, 2 * args.seconds, meter)
    del model
    torch.cuda.empty_cache()
    for kind in ("drift", "random") if args.long else ():
        inputs = _inputs_long(kind, args.long)
        _compare(f"T={args.long}, {kind}", inputs, args.rounds, args.seconds, variants, meter)
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
