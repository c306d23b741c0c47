"""The Triton kernels against their references on the CPU, through Triton's interpreter.

Run as a script (TRITON_INTERPRET must be set before Triton is imported); `test_kernels_interpreted`
runs each check in a subprocess. Exits non-zero on the first mismatch.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import sys

import torch
import triton
import triton.language as tl

from m3lm.kernels import fused, moe_triton, msa_triton, router_triton
from m3lm.kernels.fp8 import dequant_mxfp8, dequant_rows_fp8, quantize_mxfp8, quantize_rows_fp8
from m3lm.kernels.fp8_triton import DEQUANT_MIN_T, Config, dequantize, mxfp8_matmul, pack_gate_up
from m3lm.kernels.moe import moe_experts_ref, route
from m3lm.kernels.moe_fp8_triton import moe_experts_fp8, moe_pairs_fp8
from m3lm.kernels.moe_triton import moe_experts
from m3lm.kernels.msa import index_block_scores_ref, msa_attention_ref, msa_select_ref, select_blocks_ref
from m3lm.kernels.msa_prefill_triton import (
    index_block_scores,
    msa_prefill_attention,
    msa_select,
    select_blocks,
)
from m3lm.kernels.msa_tiles import group_queries, group_queries_ref, tile_blocks, tile_blocks_ref
from m3lm.layers.mlp import swiglu_oai_ref
from m3lm.layers.norm import rms_norm_ref
from m3lm.layers.rotary import apply_rope_ref, rope_cos_sin


def close(a, b, tol=1e-4):
    err = float((a - b).abs().max())
    assert err < tol, err


def decode_kernels():
    b, h, k, d, di, s, pool = 3, 8, 2, 16, 16, 4, 60
    lens = torch.tensor([5, 30, 41], dtype=torch.int32)
    maxp = 11
    perm = torch.randperm(pool)
    tables = torch.zeros(b, maxp, dtype=torch.int32)
    c = 0
    for i, n in enumerate(lens.tolist()):
        m = -(-n // s)
        tables[i, :m] = perm[c : c + m].int()
        c += m
    kp, vp, ikp = torch.randn(pool, s, k, d), torch.randn(pool, s, k, d), torch.randn(pool, s, di)
    q, iq = torch.randn(b, h, d), torch.randn(b, k, di)
    scores = msa_triton.index_block_scores(iq, ikp, tables, lens)
    sel = msa_triton.select_blocks(scores, lens, s, 3, 1, 0)
    dense = msa_triton.paged_attention(q, kp, vp, tables, lens, 0.25)
    sparse = msa_triton.paged_attention(q, kp, vp, tables, lens, 0.25, sel, splits=2)
    for i, n in enumerate(lens.tolist()):
        pages = tables[i, : -(-n // s)].long()
        kk, vv, ik = kp[pages].flatten(0, 1)[:n], vp[pages].flatten(0, 1)[:n], ikp[pages].flatten(0, 1)[:n]
        pos = torch.tensor([n - 1])
        ref_scores = index_block_scores_ref(iq[i : i + 1], ik, pos, s)[:, 0]
        close(scores[i, :, : ref_scores.shape[-1]], ref_scores)
        ref_sel = select_blocks_ref(ref_scores[:, None], pos, s, 3, 1, 0)[:, 0]
        for g in range(k):
            assert sorted(x for x in sel[i, g].tolist() if x >= 0) == [
                x for x in ref_sel[g].tolist() if x >= 0
            ]
        close(dense[i], msa_attention_ref(q[i : i + 1], kk, vv, pos, 0.25)[0])
        close(sparse[i], msa_attention_ref(q[i : i + 1], kk, vv, pos, 0.25, ref_sel[:, None], s)[0])


def prefill_kernel():
    # The fourth and fifth cases take 16 keys a step: two steps per block, the second one partly
    # past the block (24 keys) or past the tile's last query.
    for t_len, tk, h, k, d, s, topk, keys in [
        (33, 61, 8, 2, 16, 4, 3, 64),
        (64, 64, 16, 2, 16, 8, 4, 64),
        (30, 70, 8, 2, 16, 16, 2, 64),
        (45, 150, 8, 2, 16, 32, 2, 16),
        (50, 100, 8, 2, 16, 24, 2, 16),
        (40, 800, 8, 2, 16, 8, 8, 64),  # 16 queries x 8 of 100 blocks: two words of bits a query
    ]:
        q, kk, vv = torch.randn(t_len, h, d), torch.randn(tk, k, d), torch.randn(tk, k, d)
        if keys == 16:  # wide scores: the running max moves by large steps
            q = q * 12.0
        pos = torch.arange(tk - t_len, tk)
        sel = msa_select_ref(torch.randn(t_len, k, d), torch.randn(tk, d), pos, s, topk, 1, 0)
        cfg = (64, 4, 2, keys)
        for block_ids in (sel, None):
            out = msa_prefill_attention(q, kk, vv, pos, 0.3, block_ids, s, config=cfg, tma=False)
            close(out, msa_attention_ref(q, kk, vv, pos, 0.3, block_ids, s))
            # K and V by tensor-memory copies (rows past Tk, or past a block, read as zeros or as
            # the next block's keys, then masked): the same products bit for bit.
            tma = msa_prefill_attention(q, kk, vv, pos, 0.3, block_ids, s, config=cfg, tma=True)
            assert torch.equal(tma, out)
            # Tiles of consecutive queries instead of grouped ones: each row's arithmetic is the
            # same (bit for bit on the GPU, `test_cuda.py`); the interpreter's products go through
            # NumPy's matmul, which may round a row by an ulp or so according to its place in the
            # tile, so here within a tolerance far below what a misplaced query would cost.
            plain = msa_prefill_attention(
                q, kk, vv, pos, 0.3, block_ids, s, config=cfg, tma=False, grouped=False
            )
            close(plain, out, 1e-4)
            # A compare and select per score on every step instead of masks by row (whole steps
            # before the tile's first query): the same arithmetic on every kept score.
            scored = msa_prefill_attention(
                q, kk, vv, pos, 0.3, block_ids, s, config=cfg, tma=False, row_masks=False
            )
            assert torch.equal(scored, out)


def prefill_selection():
    for t_len, tk, k, di, s, topk in [(40, 90, 2, 16, 8, 3), (70, 70, 3, 32, 4, 5), (5, 8, 2, 16, 4, 2)]:
        iq, ik = torch.randn(t_len, k, di), torch.randn(tk, di)
        pos = torch.arange(tk - t_len, tk)
        got, want = index_block_scores(iq, ik, tk - t_len, s), index_block_scores_ref(iq, ik, pos, s)
        assert torch.equal(got.isinf(), want.isinf())
        close(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0))
        for config in [(128, 4, 2, 1), (128, 4, 2, 5)]:  # key blocks a program: each block's max is its own
            assert torch.equal(index_block_scores(iq, ik, tk - t_len, s, config), got)
        got, want = msa_select(iq, ik, pos, s, topk, 1, 0), msa_select_ref(iq, ik, pos, s, topk, 1, 0)
        assert (got is None and want is None) or torch.equal(got.long(), want)
    # Selection from given scores: ties (to the lower id), forced local and initial blocks, queries
    # that see fewer blocks than k, and more blocks than one program row holds at once.
    for t_len, first, n, s, topk, local, init in [(37, 0, 10, 4, 3, 1, 0), (9, 900, 300, 3, 5, 2, 1)]:
        scores = torch.randn(3, t_len, n).round(decimals=1)  # many exact ties
        pos = torch.arange(first, first + t_len)
        scores = scores.masked_fill(torch.arange(n)[None, None, :] > (pos // s)[None, :, None], float("-inf"))
        got = select_blocks(scores, first, s, topk, local, init)
        assert torch.equal(got.long(), select_blocks_ref(scores, pos, s, topk, local, init))
    # The union of each tile's selections, in one or several chunks of block ids, and each
    # query's bits over it (two words a query in the last case).
    for t_len, n, k, bq in [(10, 12, 3, 4), (13, 600, 5, 4), (40, 600, 5, 16)]:
        ids = torch.stack([torch.randperm(n)[:k] for _ in range(2 * t_len)]).view(2, t_len, k)
        ids[0, 3, 1:] = -1
        for got, want in zip(tile_blocks(ids, bq, n), tile_blocks_ref(ids, bq), strict=True):
            assert torch.equal(got, want)
    # Queries grouped by overlapping selections: one window and several (the last one partial),
    # exact masks (60 blocks) and folded ones (600), and the tiles' unions over that order.
    for t_len, n, k, bq in [(10, 12, 3, 4), (300, 60, 5, 4), (200, 600, 5, 8)]:
        ids = torch.stack([torch.randperm(n)[:k] for _ in range(2 * t_len)]).view(2, t_len, k)
        ids[1, 5, 2:] = -1
        order = group_queries(ids, bq)
        assert torch.equal(order[:, :t_len], group_queries_ref(ids, bq)[:, :t_len])
        assert all(sorted(order[g, :t_len].tolist()) == list(range(t_len)) for g in range(2))
        for got, want in zip(tile_blocks(ids, bq, n, order), tile_blocks_ref(ids, bq, order), strict=True):
            assert torch.equal(got, want)


def moe_kernel():
    for t, e, a, c, i in [(1, 8, 2, 64, 32), (9, 6, 3, 48, 40), (40, 8, 2, 64, 32)]:
        x = torch.randn(t, c)
        w1, w3, w2 = torch.randn(e, i, c) * 0.1, torch.randn(e, i, c) * 0.1, torch.randn(e, c, i) * 0.1
        weights, ids = route(torch.randn(t, e), torch.zeros(e), a)
        close(
            moe_experts(x, weights, ids, w1, w3, w2, 1.702, 7.0),
            moe_experts_ref(x, weights, ids, w1, w3, w2, 1.702, 7.0),
        )
        close(  # each pair's output unweighted: the combine weights them
            moe_triton.moe_pairs(x, ids, w1, w3, w2, 1.702, 7.0),
            moe_pairs_ref(x, torch.ones_like(weights), ids, w1, w3, w2, 1.702, 7.0),
        )
    # Groups aligned to 32 rows, taken by the kernels in blocks of 16: blocks holding only
    # padding are skipped, the others find their expert.
    t, e, a, c, i = 12, 5, 2, 64, 32
    x = torch.randn(t, c)
    w1, w3, w2 = torch.randn(e, i, c) * 0.1, torch.randn(e, i, c) * 0.1, torch.randn(e, c, i) * 0.1
    weights, ids = route(torch.randn(t, e), torch.zeros(e), a)
    aligned = moe_triton.align(ids, e, 32)
    cfg = (32, 32, 4, 1, 5)  # 12 row blocks in launch groups of 5: the last group is partial
    h = moe_triton.gate_up(x, w1, w3, t * a, a, aligned, 1.702, 7.0, 16, cfg)
    y = moe_triton.grouped_gemm(h, w2, t * a, a, aligned, True, weights.flatten(), torch.float32, 16, cfg)
    close(y.view(t, a, c).sum(1), moe_experts_ref(x, weights, ids, w1, w3, w2, 1.702, 7.0))
    # Half-height tiles for a group's last block of at most half a block (prefill's): groups
    # aligned to 32 rows in 32-row blocks. Expert 0 gets 40 pairs (a full block, then 8 in a half
    # tile), expert 1 at least 20 (a long last block), the others a few.
    t, e, a = 40, 4, 2
    ids = torch.stack([torch.zeros(t, dtype=torch.long), torch.randint(1, e, (t,))], 1)
    ids[:20, 1] = 1
    weights = torch.rand(t, a)
    x = torch.randn(t, c)
    w1, w3, w2 = torch.randn(e, i, c) * 0.1, torch.randn(e, i, c) * 0.1, torch.randn(e, c, i) * 0.1
    aligned = moe_triton.align(ids, e, 32)
    cfg = (32, 32, 4, 1, 2)
    h = moe_triton.gate_up(x, w1, w3, t * a, a, aligned, 1.702, 7.0, 32, cfg, halves=True)
    y = moe_triton.grouped_gemm(
        h, w2, t * a, a, aligned, True, weights.flatten(), torch.float32, 32, cfg, True
    )
    close(y.view(t, a, c).sum(1), moe_experts_ref(x, weights, ids, w1, w3, w2, 1.702, 7.0))
    merged_tails()


def merged_tails():
    """Short last blocks taken by their expert's previous block (`moe_triton._tail`): groups
    aligned to 64 rows, tails of up to 32 pairs merged as 16 or 32 extra rows, the others in
    their own (half or whole) tiles. One expert per token, so each expert's count is chosen."""
    counts = [64 + 10, 128 + 25, 64 + 40, 20, 64, 64 + 30, 64 + 16, 64 + 17, 0, 33]
    e, c, i = len(counts), 64, 32
    ids = torch.cat([torch.full((n,), k) for k, n in enumerate(counts)])[torch.randperm(sum(counts))][:, None]
    t, a = ids.shape
    x = torch.randn(t, c)
    w1, w3, w2 = torch.randn(e, i, c) * 0.1, torch.randn(e, i, c) * 0.1, torch.randn(e, c, i) * 0.1
    weights = torch.rand(t, a)
    aligned = moe_triton.align(ids, e, 64)
    cfg = (32, 32, 4, 1, 2)
    want = moe_experts_ref(x, weights, ids, w1, w3, w2, 1.702, 7.0)
    kept = []  # every output stays alive, so no run's unwritten rows can hold another's values
    for tail in (32, 16, 0):
        h = moe_triton.gate_up(x, w1, w3, t * a, a, aligned, 1.702, 7.0, 64, cfg, halves=True, tail=tail)
        y = moe_triton.grouped_gemm(
            h, w2, t * a, a, aligned, True, weights.flatten(), torch.float32, 64, cfg, halves=True, tail=tail
        )
        kept += [h, y]
        close(y.view(t, a, c).sum(1), want)


@triton.jit
def _launch_order_kernel(expert_ptr, ends_ptr, used_ptr, out_ptr, N: tl.constexpr, BN: tl.constexpr,
                         BM: tl.constexpr, ALIGN_M: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    row, col = moe_triton.grouped_pid(
        pid, tl.num_programs(0), expert_ptr, ends_ptr, used_ptr, N, BN, BM, ALIGN_M, GROUP_M
    )
    tl.store(out_ptr + 2 * pid, row)
    tl.store(out_ptr + 2 * pid + 1, col)


def launch_order():
    """The MoE kernels' program order: each expert's row blocks in groups of at most GROUP_M sweep
    the column blocks, a group never spanning two experts; unused blocks after, in plain order."""
    for t, e, a, align_m, block_m, group in [
        (40, 6, 2, 16, 16, 3),
        (64, 8, 4, 32, 16, 2),
        (3, 8, 2, 16, 16, 8),
    ]:
        ids = torch.randint(0, e, (t, a))
        ids[: t // 2, 0] = 1  # one large expert, several groups of blocks
        aligned = moe_triton.align(ids, e, align_m)
        n_rows = moe_triton.row_blocks(aligned, t * a, block_m)
        n, bn = 40, 16  # three column blocks
        n_cols = 3
        got = torch.empty(n_rows * n_cols, 2, dtype=torch.int32)
        _launch_order_kernel[(n_rows * n_cols,)](
            aligned.block_expert, aligned.ends, aligned.used, got, N=n, BN=bn, BM=block_m, ALIGN_M=align_m, GROUP_M=group
        )  # fmt: skip
        want, start = [], 0
        for end in (aligned.ends // block_m).tolist():
            for first in range(start, end, group):
                rows = range(first, min(first + group, end))
                want += [(r, c) for c in range(n_cols) for r in rows]
            start = end
        want += [(r, c) for r in range(start, n_rows) for c in range(n_cols)]
        assert got.tolist() == [list(p) for p in want], (got.tolist(), want)


def routing_kernels():
    for t, e, a, block_m in [(1, 8, 2, 16), (64, 128, 4, 16), (5, 6, 3, 4), (3, 8, 2, 16)]:
        logits = torch.randn(t, e)
        if t == 3:
            logits[:, :4] = 0.5  # exact ties go to the lower expert id
        bias = torch.randn(e) * 0.1
        w, ids = router_triton.route(logits, bias, a)
        w_ref, ids_ref = route(logits, bias, a)
        assert torch.equal(ids, ids_ref)
        close(w, w_ref, 1e-6)
        for got, want in zip(
            moe_triton.align(ids, e, block_m), moe_triton.align_ref(ids, e, block_m), strict=True
        ):
            assert torch.equal(got, want), (got, want)
    x, w = torch.randn(3, 2500).bfloat16(), torch.randn(6, 2500)  # C not a whole number of tiles
    close(router_triton.router_gemv(x, w), (x.double() @ w.double().T).float(), 1e-3)


def mxfp8_weight(*shape, std=0.1):
    """A quantised weight whose rows hold 32-blocks of different exponents."""
    q, s = quantize_mxfp8(torch.randn(*shape) * std)
    s[..., 0, -1] += 3
    s[..., -1, 0] -= 2
    return q, s


def moe_pairs_ref(x, weights, ids, w1, w3, w2, alpha, limit):
    """weights[t, a] * expert_{ids[t, a]}(x[t]) -> [T, A, C], not summed over A."""
    gate, up = (torch.einsum("tc,taic->tai", x, w[ids]) for w in (w1, w3))
    return weights[..., None] * torch.einsum("tai,taci->tac", swiglu_oai_ref(gate, up, alpha, limit), w2[ids])


def fp8_kernels():
    """Weight-only FP8 kernels against matmuls on the dequantised weights (fp32 activations: the
    interpreter's bf16 dot is not usable; the GPU tests cover bf16)."""
    gemv = [  # (kernel, O, In, BN, BK): O not a multiple of BN; In a multiple of 32, not of BK
        ("gemv", 40, 96, 16, 64),
        ("gemv", 24, 256, 8, 128),
        ("gemv", 7, 64, 2, 64),
        ("gemv_tc", 40, 160, 16, 64),
        ("gemv_tc", 48, 128, 32, 128),
    ]
    cases = [
        (1, 48, 64, None),
        (5, 40, 96, None),
        (40, 70, 128, None),
        (3, 24, 256, Config("tile", 16, 64, 4, 1)),
    ]
    cases += [(t, 40, 96, None) for t in (1, 2, 16)]  # the default GEMV tiles
    cases += [(DEQUANT_MIN_T, 40, 96, None)]  # dequantised once, then a plain matmul
    cases += [(t, o, k, Config(kind, bn, bk, 4, 1)) for t in (1, 2, 16) for kind, o, k, bn, bk in gemv]
    for t, o, k, config in cases:
        q, s = mxfp8_weight(o, k)
        x = torch.randn(t, k)
        close(mxfp8_matmul(x, q, s, config), x @ dequant_mxfp8(q, s).T)
    q, s = mxfp8_weight(40, 160)
    s[:, 1::2] += 3  # neighbouring blocks at other exponents
    assert torch.equal(dequantize(q, s, torch.float32), dequant_mxfp8(q, s))
    for t, config in [
        (1, None),
        (2, Config("gemv", 8, 64, 4, 1)),
        (16, Config("gemv_tc", 16, 64, 4, 1)),
        (20, Config("tile", 16, 64, 4, 1)),
    ]:  # gate and up packed, swiglu(gate, up) out: gates past the limit and both signs of up
        (q1, s1), (q3, s3) = mxfp8_weight(40, 96, std=0.15), mxfp8_weight(40, 96, std=0.15)
        x = torch.randn(t, 96) * 2
        ref = swiglu_oai_ref(x @ dequant_mxfp8(q1, s1).T, x @ dequant_mxfp8(q3, s3).T, 1.702, 7.0)
        close(mxfp8_matmul(x, *pack_gate_up(q1, s1, q3, s3), config, act="swiglu"), ref)
    # 2 and 8 pairs: one program per pair (`pair_gemv`), K of 96 not a whole tile; then aligned tiles
    for t, e, a, c, i in [(1, 8, 2, 64, 32), (2, 6, 4, 96, 64), (9, 6, 3, 96, 64), (40, 8, 2, 64, 32)]:
        x = torch.randn(t, c)
        w1, w3, w2 = (mxfp8_weight(*shape) for shape in ((e, i, c), (e, i, c), (e, c, i)))
        weights, ids = route(torch.randn(t, e), torch.zeros(e), a)
        deq = [dequant_mxfp8(*w) for w in (w1, w3, w2)]
        close(
            moe_experts_fp8(x, weights, ids, *w1, *w3, *w2, 1.702, 7.0),
            moe_experts_ref(x, weights, ids, *deq, 1.702, 7.0),
        )
        for configs in [  # the weight on the tensor cores' wide side; BLOCK_M 32 for the down GEMM
            ((16, (32, 32, 4, 1, True)), (32, (16, 64, 4, 1, True))),
            ((16, (16, 64, 4, 1, False)), (16, (32, 32, 4, 1, True))),
        ]:
            close(
                moe_pairs_fp8(x, weights, ids, *w1, *w3, *w2, 1.702, 7.0, configs),
                moe_pairs_ref(x, weights, ids, *deq, 1.702, 7.0),
            )
    # The shared expert in the per-pair launches: one more row per token, unscaled.
    t, e, a, c, i = 2, 6, 3, 96, 64
    x = torch.randn(t, c)
    w1, w3, w2 = (mxfp8_weight(*shape) for shape in ((e, i, c), (e, i, c), (e, c, i)))
    sh = [mxfp8_weight(*shape) for shape in ((i, c), (i, c), (c, i))]
    weights, ids = route(torch.randn(t, e), torch.zeros(e), a)
    pairs, out = moe_pairs_fp8(x, weights, ids, *w1, *w3, *w2, 1.702, 7.0, shared=(*sh[0], *sh[1], *sh[2]))
    deq = [dequant_mxfp8(*w) for w in (w1, w3, w2)]
    close(pairs, moe_pairs_ref(x, weights, ids, *deq, 1.702, 7.0))
    g, u, d = (dequant_mxfp8(*w) for w in sh)
    close(out, swiglu_oai_ref(x @ g.T, x @ u.T, 1.702, 7.0) @ d.T)
    lens = torch.tensor([5, 30], dtype=torch.int32)
    ikq, iks = quantize_rows_fp8(torch.randn(20, 4, 16) * 3)
    tables = torch.tensor([[7, 0, 0, 0, 0, 0, 0, 0], [3, 9, 1, 12, 4, 5, 6, 8]], dtype=torch.int32)
    iq = torch.randn(2, 2, 16)
    scores = msa_triton.index_block_scores(iq, ikq, tables, lens, iks)
    ref = msa_triton.index_block_scores(iq, dequant_rows_fp8(ikq, iks), tables, lens)
    assert torch.equal(scores.isinf(), ref.isinf()) and int(ref.isfinite().sum()) == 2 * (2 + 8)
    close(scores.nan_to_num(0, 0, 0), ref.nan_to_num(0, 0, 0), 1e-3)


def decode_heads_check(index: bool):
    """`fused.decode_heads` against per-head norm + RoPE and plain cache writes (index head dim 8,
    head dim 16, rotary dim 8)."""
    b, h, k, d, di, pages, page = 3, 4, 2, 16, 8, 5, 4
    widths = [h * d, k * d, k * d] + ([k * di, di] if index else [])
    y = torch.randn(b, sum(widths)) * 3
    q_, k_, v_, *idx = y.split(widths, dim=-1)
    norms = [torch.randn(d), torch.randn(d)] + ([torch.randn(di), torch.randn(di)] if index else [])
    cos, sin = rope_cos_sin(torch.tensor([5, 0, 13]), 8, 10000.0)
    where = torch.tensor([2, 0, 4]), torch.tensor([1, 0, 3])  # (page, slot) of each token
    kc, vc, ikc = torch.zeros(pages, page, k, d), torch.zeros(pages, page, k, d), torch.zeros(pages, page, di)
    q, iq = fused.decode_heads(
        y, (h, k, d, di if index else 0), tuple(norms), 1e-6, cos, sin, kc, vc, ikc if index else None, *where
    )

    def ref(x, heads, w):
        return apply_rope_ref(rms_norm_ref(x.reshape(b, heads, -1), w, 1e-6), cos, sin)

    close(q, ref(q_, h, norms[0]))
    close(kc[where], ref(k_, k, norms[1]))
    close(vc[where], v_.view(b, k, d))
    untouched = torch.ones(pages, page, dtype=torch.bool)
    untouched[where] = False
    assert not kc[untouched].any() and not vc[untouched].any() and not ikc[untouched].any()
    if index:
        close(iq, ref(idx[0], k, norms[2]))
        close(ikc[where], ref(idx[1], 1, norms[3])[:, 0])
    else:
        assert iq is None


def elementwise_kernels():
    x, w = torch.randn(5, 3, 24), torch.randn(24)
    close(fused.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    cos, sin = rope_cos_sin(torch.tensor([0, 3, 100, 7, 9]), 8, 10000.0)
    close(fused.apply_rope(x, cos, sin), apply_rope_ref(x, cos, sin))
    g, u = torch.randn(7, 33) * 5, torch.randn(7, 33) * 5
    close(fused.swiglu_oai(g, u, 1.702, 7.0), swiglu_oai_ref(g, u, 1.702, 7.0))
    h = torch.randn(5, 2, 2 * 24) * 6  # packed [gate | up] columns
    close(fused.swiglu_packed(h, 1.702, 7.0), swiglu_oai_ref(h[..., :24], h[..., 24:], 1.702, 7.0))
    h, d = torch.randn(5, 40), torch.randn(5, 40)
    w = torch.randn(40)
    s, y = fused.add_rms_norm(h, d, w, 1e-6)
    close(s, h + d)
    close(y, rms_norm_ref(h + d, w, 1e-6))
    table, ids = torch.randn(11, 40), torch.tensor([3, 0, 10, 3, 7])  # the embedding and the first norm
    e, y = fused.embed_rms_norm(ids, table, w, 1e-6)
    assert torch.equal(e, table[ids])
    assert torch.equal(y, fused.rms_norm(table[ids], w, 1e-6))
    # Per-head norm + RoPE on a strided slice of a wider projection (as the model passes q, k).
    wide = torch.randn(5, 3 * 24 + 8)
    view = wide[:, 8:].view(5, 3, 24)
    w = torch.randn(24)
    close(fused.norm_rope(view, w, 1e-6, cos, sin), apply_rope_ref(rms_norm_ref(view, w, 1e-6), cos, sin))
    one_head = wide[:, :24].view(5, 1, 24)
    close(
        fused.norm_rope(one_head, w, 1e-6, cos, sin),
        apply_rope_ref(rms_norm_ref(one_head, w, 1e-6), cos, sin),
    )
    decode_heads_check(index=True)
    decode_heads_check(index=False)
    pairs, shared = torch.randn(6, 4, 1500), torch.randn(6, 1500)
    close(fused.moe_combine(pairs, shared, 2.0), pairs.sum(1) * 2.0 + shared)
    rows, weights = torch.randperm(24).view(6, 4), torch.rand(6, 4)  # pairs in expert order, unweighted
    flat = pairs.view(24, 1500)
    close(
        fused.moe_combine(flat, shared, 2.0, rows, weights),
        (flat[rows] * weights[..., None]).sum(1) * 2.0 + shared,
    )
    # The combine inside the next residual add and norm: the two passes' results, bit for bit.
    h, w = torch.randn(6, 1500), torch.randn(1500)
    for args in [(pairs, None, None), (flat, rows, weights)]:
        p, r, wt = args
        s, y = fused.moe_add_rms_norm(h, p, shared, 2.0, w, 1e-6, rows=r, weights=wt)
        want = fused.add_rms_norm(h, fused.moe_combine(p, shared, 2.0, r, wt), w, 1e-6)
        assert torch.equal(s, want[0]) and torch.equal(y, want[1])
        close(
            y,
            rms_norm_ref(h + (p[r] * wt[..., None] if wt is not None else p).sum(1) * 2.0 + shared, w, 1e-6),
        )


def mixed_step():
    """A step of two decodes and a prefill chunk: the decodes batched through the decode kernels
    (`decode_rows`; CPU tensors take `msa_paged`, the Triton kernels' CPU twin) give the
    per-sequence path's logits and cache contents."""
    import copy

    from checkpoints import Spec, release_config

    from m3lm.cache.kv_cache import KVCache
    from m3lm.config import ModelArgs
    from m3lm.distributed.steps import Step
    from m3lm.engine.runner import forward_step
    from m3lm.models.minimax_m3 import MiniMaxM3, random_init_

    args = ModelArgs.from_dict(release_config(Spec(block=4, topk_blocks=2)))
    model = random_init_(MiniMaxM3(args), seed=2)
    for index_fp8 in (False, True):
        cache = KVCache(args, 16, "cpu", torch.float32, index_fp8)
        tables = [[0, 1, 2, 3], [7, 5], [8, 9, 10]]  # the second not consecutive: gathered
        prompts = [[(3 * i + 1) % 90 for i in range(13)], [(5 * i + 2) % 90 for i in range(6)]]
        with torch.inference_mode():
            forward_step(
                model, cache, Step(prompts[0] + prompts[1], [13, 6], [0, 0], [12, 18], tables[:2]), None
            )
            # sequence 0 decodes at 13 (4 blocks > top-k 2: a selection), 1 at 6, 2 prefills 9 tokens
            step = Step([4, 9, *range(20, 29)], [1, 1, 9], [13, 6, 0], [0, 1, 10], tables)
            plain = copy.deepcopy(cache)
            want = forward_step(model, plain, step, None, batch_decodes=False)
            got = forward_step(model, cache, step, None, table_width=6, batch_decodes=True)
        close(got, want)
        pools = [(cache.k, plain.k), (cache.v, plain.v), (list(cache.ik.values()), list(plain.ik.values()))]
        for a, b in (pair for ours, theirs in pools for pair in zip(ours, theirs, strict=True)):
            close(a.float(), b.float(), 1e-5)  # later layers' keys carry the attention's rounding


def decode_step():
    """A decode step over a `DecodeBatch` (what CUDA graphs capture) gives the per-sequence path's
    logits and cache contents, on full-attention and MSA layers, with and without FP8 index keys."""
    import copy

    from checkpoints import Spec, release_config

    from m3lm.cache.kv_cache import KVCache
    from m3lm.config import ModelArgs
    from m3lm.core import DecodeBatch
    from m3lm.distributed.steps import Step
    from m3lm.engine.runner import forward_step
    from m3lm.models.minimax_m3 import MiniMaxM3, random_init_

    args = ModelArgs.from_dict(release_config(Spec(block=4, topk_blocks=2)))
    model = random_init_(MiniMaxM3(args), seed=3)
    for index_fp8 in (False, True):
        cache = KVCache(args, 16, "cpu", torch.float32, index_fp8)
        tables = [[0, 1, 2, 3], [7, 5], [8, 9, 10, 11]]
        prompts = [[(3 * i + 1) % 90 for i in range(13)], [(5 * i + 2) % 90 for i in range(6)], [4] * 9]
        with torch.inference_mode():
            q_lens = [len(p) for p in prompts]
            forward_step(
                model, cache, Step([t for p in prompts for t in p], q_lens, [0] * 3, [27], tables), None
            )
            plain = copy.deepcopy(cache)
            # 13 positions of blocks of 4 exceed the top-k 2 blocks: sequence 0 selects
            step = Step([4, 9, 11], [1] * 3, q_lens, [0, 1, 2], tables)
            want = forward_step(model, plain, step, None, batch_decodes=False)
            table = torch.tensor([t + [15] * (4 - len(t)) for t in tables], dtype=torch.int32)
            dec = DecodeBatch.build(torch.tensor(q_lens), table, cache, cache.page_size)
            got = model.forward_batch(torch.tensor([4, 9, 11]), dec)
        close(got, want)
        pools = [(cache.k, plain.k), (cache.v, plain.v), (list(cache.ik.values()), list(plain.ik.values()))]
        for a, b in (pair for ours, theirs in pools for pair in zip(ours, theirs, strict=True)):
            close(a.float(), b.float(), 1e-5)  # later layers' keys carry the attention's rounding


CHECKS = {
    f.__name__: f
    for f in (
        decode_kernels,
        prefill_kernel,
        prefill_selection,
        moe_kernel,
        launch_order,
        routing_kernels,
        fp8_kernels,
        elementwise_kernels,
        mixed_step,
        decode_step,
    )
}

if __name__ == "__main__":  # python tests/kernel_checks.py [NAME ...]: the named checks, or all
    for name in sys.argv[1:] or CHECKS:
        torch.manual_seed(0)
        CHECKS[name]()
        print(name, "ok", flush=True)
