"""MSA's Triton kernels (decode, prefill, the lightning indexer's scores and selection, the query
tiles) against their PyTorch references, on the GPU and in Triton's interpreter (`targets`)."""

import pytest
import torch

pytest.importorskip("triton")

from m3lm.kernels import msa_triton
from m3lm.kernels.fp8 import dequant_rows_fp8, quantize_rows_fp8
from m3lm.kernels.msa import (
    index_block_scores_ref,
    msa_attention_ref,
    msa_attention_sdpa,
    select_blocks_ref,
)
from m3lm.kernels.msa_prefill_triton import (
    index_block_scores,
    msa_prefill_attention,
    msa_select,
    select_blocks,
)
from m3lm.kernels.msa_tiles import group_queries, group_queries_ref, tile_blocks, tile_blocks_ref
from tests.support.targets import targets

F32, BF16 = torch.float32, torch.bfloat16


def rel(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def paged_case(device, b, h, k, d, di, s, lens, dtype, seed=0):
    """Random paged K, V and index-key pools, queries, page tables (pages scattered) and lengths."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    maxp = max(-(-n // s) for n in lens)
    pool = sum(-(-n // s) for n in lens) + 1
    perm = torch.randperm(pool, generator=gen)
    tables = torch.zeros(b, maxp, dtype=torch.int32)
    c = 0
    for i, n in enumerate(lens):
        m = -(-n // s)
        tables[i, :m] = perm[c : c + m].int()
        c += m
    mk = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return (
        mk(pool, s, k, d),
        mk(pool, s, k, d),
        mk(pool, s, di),
        mk(b, h, d),
        mk(b, k, di),
        tables.to(device),
        lens,
    )


@targets(
    "dtype, h, k, d, di, s, lens, topk, splits",
    cuda=[
        (dtype, *shape, None)
        for dtype in (F32, BF16)
        for shape in [
            (8, 2, 16, 16, 4, [5, 33, 70], 3),
            (64, 4, 128, 128, 128, [100, 2048, 2049, 9000], 16),
            (16, 2, 64, 64, 16, [1, 300], 8),
        ]
    ],
    interpreter=[(F32, 8, 2, 16, 16, 4, [5, 30, 41], 3, 2)],
)
def test_decode_kernels_match_reference(device, dtype, h, k, d, di, s, lens, topk, splits):
    """Index scores, block selection, and dense and sparse paged attention of a decode step."""
    kp, vp, ikp, q, iq, tables, lt = paged_case(device, len(lens), h, k, d, di, s, lens, dtype)
    scores = msa_triton.index_block_scores(iq, ikp, tables, lt)
    sel = msa_triton.select_blocks(scores, lt, s, topk, 1, 0)
    dense = msa_triton.paged_attention(q, kp, vp, tables, lt, d**-0.5)
    sparse = msa_triton.paged_attention(q, kp, vp, tables, lt, d**-0.5, sel, splits=splits)
    tol = 1e-4 if dtype == F32 else 2e-2
    for i, n in enumerate(lens):
        pages = tables[i, : -(-n // s)].long()
        kk, vv, ik = kp[pages].flatten(0, 1)[:n], vp[pages].flatten(0, 1)[:n], ikp[pages].flatten(0, 1)[:n]
        pos = torch.tensor([n - 1], device=device)
        ref_scores = index_block_scores_ref(iq[i : i + 1], ik, pos, s)[:, 0]
        assert rel(scores[i, :, : ref_scores.shape[-1]], ref_scores) < tol
        ref_sel = select_blocks_ref(ref_scores[:, None], pos, s, topk, 1, 0)[:, 0]
        if dtype == F32:  # in bf16, near-tied blocks may be picked either way
            for g in range(k):
                assert sorted(x for x in sel[i, g].tolist() if x >= 0) == [
                    x for x in ref_sel[g].tolist() if x >= 0
                ]
        assert rel(dense[i], msa_attention_ref(q[i : i + 1], kk, vv, pos, d**-0.5)[0]) < tol
        ref_sparse = msa_attention_ref(q[i : i + 1], kk, vv, pos, d**-0.5, sel[i][:, None].long(), s)[0]
        assert rel(sparse[i], ref_sparse) < tol


@targets(
    "h, k, d, di, s, lens, tol",
    cuda=[(64, 4, 128, 128, 128, [100, 2048, 2049, 9000], 1e-2)],
    interpreter=[(8, 4, 16, 16, 4, [5, 30], 1e-4)],
)
def test_fp8_index_keys_score_as_their_dequantised_values(device, h, k, d, di, s, lens, tol):
    _, _, ikp, _, iq, tables, lt = paged_case(
        device, len(lens), h, k, d, di, s, lens, BF16 if device == "cuda" else F32
    )
    ikq, iks = quantize_rows_fp8(ikp * 3)
    got = msa_triton.index_block_scores(iq, ikq, tables, lt, iks)
    ref = msa_triton.index_block_scores(iq.float(), dequant_rows_fp8(ikq, iks), tables, lt)
    assert torch.equal(got.isinf(), ref.isinf()) and int(ref.isfinite().sum()) == k * sum(
        -(-n // s) for n in lens
    )
    assert rel(got.nan_to_num(0, 0, 0), ref.nan_to_num(0, 0, 0)) < tol


PREFILL_GPU = [
    (8, 2, 16, 16, 3, 200, 200),
    (64, 4, 128, 128, 16, 5000, 5000),
    (64, 4, 128, 128, 16, 4600, 700),
]
# The fourth and fifth interpreter cases take 16 keys a step: two steps per block, the second one
# partly past the block (24 keys) or past the tile's last query; the last has 16 queries x 8 of
# 100 blocks, two words of bits a query.
PREFILL_INTERPRETER = [
    (8, 2, 16, 4, 3, 61, 33, 64),
    (16, 2, 16, 8, 4, 64, 64, 64),
    (8, 2, 16, 16, 2, 70, 30, 64),
    (8, 2, 16, 32, 2, 150, 45, 16),
    (8, 2, 16, 24, 2, 100, 50, 16),
    (8, 2, 16, 8, 8, 800, 40, 64),
]


@targets(
    "dtype, h, k, d, s, topk, tk, t, config",
    cuda=[(dtype, *shape, None) for dtype in (F32, BF16) for shape in PREFILL_GPU],
    interpreter=[(F32, *shape[:-1], (64, 4, 2, shape[-1])) for shape in PREFILL_INTERPRETER],
)
def test_prefill_kernel_matches_reference(device, dtype, h, k, d, s, topk, tk, t, config):
    """A chunk at the end of a sequence, sparse (selected blocks) and dense, and the kernel's
    variants: K and V by tensor-memory copies, tiles of consecutive queries, per-score masks."""
    gen = torch.Generator(device="cpu").manual_seed(tk + t)
    q = torch.randn(t, h, d, generator=gen) * (12.0 if config and config[-1] == 16 else 1.0)  # wide scores
    q = q.to(device, dtype)
    kk, vv = (torch.randn(tk, k, d, generator=gen).to(device, dtype) for _ in range(2))
    pos = torch.arange(tk - t, tk, device=device)
    sel = select_blocks_ref(torch.randn(k, t, -(-tk // s), generator=gen).to(device), pos, s, topk, 1, 0)
    tol = 1e-4 if dtype == F32 else 2e-2
    for block_ids in (sel, None):
        out = msa_prefill_attention(q, kk, vv, pos, d**-0.5, block_ids, s, config=config, tma=False)
        assert (
            rel(out, msa_attention_ref(q.float(), kk.float(), vv.float(), pos, d**-0.5, block_ids, s)) < tol
        )
        if device == "cpu" or dtype != F32:  # the GPU's tensor-memory copies take 16-bit tiles
            tma = msa_prefill_attention(q, kk, vv, pos, d**-0.5, block_ids, s, config=config, tma=True)
            assert torch.equal(tma, out)
        plain = msa_prefill_attention(
            q, kk, vv, pos, d**-0.5, block_ids, s, config=config, tma=False, grouped=False
        )
        if device == "cuda":  # each row's arithmetic is the same, bit for bit
            assert torch.equal(plain, out)
        else:  # the interpreter's products go through NumPy, which may round a row by an ulp by its place
            assert float((plain - out).abs().max()) < 1e-4
        scored = msa_prefill_attention(
            q, kk, vv, pos, d**-0.5, block_ids, s, config=config, tma=False, row_masks=False
        )
        assert torch.equal(scored, out)


@targets(
    "dtype, t, tk, k, di, s, topk, configs",
    cuda=[
        (dtype, t, tk, k, 128, 128, 16, [(64, 4, 2, 16), (16, 4, 2, 3), (128, 4, 2, 1), (128, 4, 2, 1 << 20)])
        for dtype in (F32, BF16)
        for t, tk, k in [(3000, 3000, 4), (700, 5000, 4), (300, 300, 3)]
    ],
    interpreter=[
        (F32, t, tk, k, di, s, topk, [(128, 4, 2, 1), (128, 4, 2, 5)])
        for t, tk, k, di, s, topk in [(40, 90, 2, 16, 8, 3), (70, 70, 3, 32, 4, 5), (5, 8, 2, 16, 4, 2)]
    ],
)
def test_prefill_index_scores_and_selection_match_reference(device, dtype, t, tk, k, di, s, topk, configs):
    """The indexer's block scores of a chunk at the end of the sequence, under other program
    shapes (rows, warps, stages, key blocks a program) bit for bit, and the selection from them."""
    gen = torch.Generator(device="cpu").manual_seed(t + tk)
    iq = torch.randn(t, k, di, generator=gen).to(device, dtype)
    ik = torch.randn(tk, di, generator=gen).to(device, dtype)
    first = tk - t
    pos = torch.arange(first, tk, device=device)
    got = index_block_scores(iq, ik, first, s)
    want = index_block_scores_ref(iq.float(), ik.float(), pos, s)
    assert torch.equal(got.isinf(), want.isinf())
    assert rel(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0)) < (1e-4 if dtype == F32 else 1e-2)
    for config in configs + (
        [(256, 8, 3, 16)] if device == "cuda" and dtype != F32 else []
    ):  # 16-bit tiles only
        assert torch.equal(index_block_scores(iq, ik, first, s, config), got)
    sel = msa_select(iq, ik, pos, s, topk, 1, 0, first)
    if sel is None:  # every query sees at most topk blocks: attention is exactly dense
        assert tk <= topk * s
    else:
        assert torch.equal(sel.long(), select_blocks_ref(got, pos, s, topk, 1, 0))


SELECTION = [(37, 0, 10, 4, 3, 1, 0), (9, 900, 300, 3, 5, 2, 1)]


@targets("t, first, n, s, topk, local, init", cuda=SELECTION, interpreter=SELECTION)
def test_selection_from_scores_matches_reference(device, t, first, n, s, topk, local, init):
    """Exact ties (to the lower id), forced local and initial blocks, queries that see fewer
    blocks than k, and more blocks than one program row holds at once."""
    gen = torch.Generator(device="cpu").manual_seed(t)
    scores = torch.randn(3, t, n, generator=gen).round(decimals=1)  # many exact ties
    pos = torch.arange(first, first + t)
    scores = scores.masked_fill(torch.arange(n)[None, None, :] > (pos // s)[None, :, None], float("-inf"))
    got = select_blocks(scores.to(device), first, s, topk, local, init)
    assert torch.equal(got.long().cpu(), select_blocks_ref(scores, pos, s, topk, local, init))


@targets(
    "t, n, k, bq, grouped",
    cuda=[(300, 60, 16, 4, True), (1000, 40, 16, 4, True), (260, 700, 16, 4, True)],
    interpreter=[
        *[(10, 12, 3, 4, False), (13, 600, 5, 4, False), (40, 600, 5, 16, False)],
        *[(10, 12, 3, 4, True), (300, 60, 5, 4, True), (200, 600, 5, 8, True)],
    ],
)
def test_query_groups_and_tile_unions_match_reference(device, t, n, k, bq, grouped):
    """Queries grouped by overlapping selections (one window or several, exact masks or folded
    ones), and the union of each tile's selections, in one or several chunks of block ids."""
    gen = torch.Generator(device="cpu").manual_seed(t + n)
    groups = 4 if device == "cuda" else 2
    ids = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(groups * t)]).view(groups, t, k)
    ids[1, 5 % t, 2:] = -1  # a query that selected fewer blocks
    order = group_queries(ids.to(device), bq) if grouped else None
    if grouped:
        assert torch.equal(order.cpu()[:, :t], group_queries_ref(ids, bq)[:, :t])
        assert all(sorted(order[g, :t].tolist()) == list(range(t)) for g in range(groups))
    got = tile_blocks(ids.to(device), bq, n, order)
    for a, b in zip(got, tile_blocks_ref(ids, bq, None if order is None else order.cpu()), strict=True):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.cuda
def test_whole_sequence_attention_builds_no_plan_per_length():
    """A whole prompt's attention takes a kernel with the length as a runtime argument: cuDNN's
    builds a host-side plan for every new length, inside the serving step."""
    from torch.profiler import ProfilerActivity, profile

    ops = set()
    for t in (535, 426):
        gen = torch.Generator(device="cpu").manual_seed(t)
        q = torch.randn(t, 64, 128, generator=gen).to("cuda", BF16)
        kk, vv = (torch.randn(t, 4, 128, generator=gen).to("cuda", BF16) for _ in range(2))
        pos = torch.arange(t, device="cuda")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = msa_attention_sdpa(q, kk, vv, pos, 128**-0.5)
        ops |= {e.key for e in prof.key_averages()}
        assert rel(out, msa_attention_ref(q.float(), kk.float(), vv.float(), pos, 128**-0.5)) < 2e-2
    assert any("flash" in op for op in ops), sorted(ops)
    assert not any("cudnn" in op for op in ops), sorted(ops)
