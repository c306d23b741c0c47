"""The MoE's Triton kernels (routing, alignment, grouped GEMMs, per-pair outputs, the router's
GEMV) against their PyTorch references, on the GPU and in Triton's interpreter (`targets`)."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from m3lm.kernels import moe_triton, router_triton  # noqa: E402
from m3lm.kernels.fused import moe_combine  # noqa: E402
from m3lm.kernels.moe import moe_experts_ref, route_ref  # noqa: E402
from m3lm.layers.mlp import swiglu_oai_ref  # noqa: E402
from tests.support.targets import targets  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16


def rel(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def experts(gen, device, dtype, e, c, i, std=0.05):
    """Random stacked expert weights w1, w3 [E, I, C] and w2 [E, C, I]."""
    w1, w3 = (torch.randn(e, i, c, generator=gen).mul(std).to(device, dtype) for _ in range(2))
    return w1, w3, torch.randn(e, c, i, generator=gen).mul(std).to(device, dtype)


def routed(gen, device, t, e, a):
    return (u.to(device) for u in route_ref(torch.randn(t, e, generator=gen), torch.zeros(e), a))


def pairs_ref(x, ids, w1, w3, w2) -> torch.Tensor:
    """expert_{ids[t, a]}(x[t]) -> [T, A, C] fp32, unweighted."""
    gate, up = (torch.einsum("tc,taic->tai", x.float(), w[ids].float()) for w in (w1, w3))
    return torch.einsum("tai,taci->tac", swiglu_oai_ref(gate, up, 1.702, 7.0), w2[ids].float())


SHAPES_GPU = [(1, 8, 2, 64, 32), (37, 16, 4, 256, 96), (2000, 32, 4, 512, 256)]
SHAPES_INTERPRETER = [(1, 8, 2, 64, 32), (9, 6, 3, 48, 40), (40, 8, 2, 64, 32)]


@targets(
    "dtype, t, e, a, c, i",
    cuda=[(dtype, *s) for dtype in (F32, BF16) for s in SHAPES_GPU],
    interpreter=[(F32, *s) for s in SHAPES_INTERPRETER],
)
def test_fused_moe_matches_reference(device, dtype, t, e, a, c, i):
    gen = torch.Generator(device="cpu").manual_seed(t)
    x = torch.randn(t, c, generator=gen).to(device, dtype)
    w1, w3, w2 = experts(gen, device, dtype, e, c, i)
    weights, ids = routed(gen, device, t, e, a)
    out = moe_triton.moe_experts(x, weights, ids, w1, w3, w2, 1.702, 7.0)
    ref = moe_experts_ref(x.float(), weights, ids, w1.float(), w3.float(), w2.float(), 1.702, 7.0)
    assert rel(out, ref) < (1e-4 if dtype == F32 else 2e-2)


@targets(
    "dtype, t, e, a, c, i",
    cuda=[(BF16, t, 32, 4, 512, 256) for t in (1, 37, 2000)],
    interpreter=[(F32, *s) for s in SHAPES_INTERPRETER],
)
def test_moe_pairs_are_unweighted_products_in_the_activations_dtype(device, dtype, t, e, a, c, i):
    """`moe_pairs` leaves each pair's down product in x's dtype, unweighted, as the reference's
    product; the combine weights and sums them in fp32."""
    gen = torch.Generator(device="cpu").manual_seed(t)
    x = torch.randn(t, c, generator=gen).to(device, dtype)
    w1, w3, w2 = experts(gen, device, dtype, e, c, i)
    weights, ids = routed(gen, device, t, e, a)
    pairs = moe_triton.moe_pairs(x, ids, w1, w3, w2, 1.702, 7.0)
    assert pairs.shape == (t, a, c) and pairs.dtype == dtype
    ref = pairs_ref(x, ids, w1, w3, w2)
    tol = 1e-4 if dtype == F32 else 2e-2
    assert rel(pairs, ref) < tol
    shared = torch.randn(t, c, generator=gen).to(device, dtype)
    want = (ref * weights[..., None]).sum(1) * 2.0 + shared.float()
    assert rel(moe_combine(pairs, shared, 2.0, weights=weights), want) < tol


GROUPS = [(16, (32, 32, 4, 1, 5), False), (32, (32, 32, 4, 1, 2), True)]


@targets("block_m, config, halves", cuda=GROUPS, interpreter=GROUPS)
def test_grouped_gemms_skip_padding_and_take_half_tiles(device, block_m, config, halves):
    """Groups aligned to 32 rows: taken in blocks of 16 (blocks holding only padding skipped, 12
    row blocks in launch groups of 5, the last partial), or in 32-row blocks with half-height
    tiles for a last block of at most half a block (expert 0 gets 40 pairs: a full block then 8;
    expert 1 at least 20: a long last block)."""
    gen = torch.Generator(device="cpu").manual_seed(block_m)
    t, e, a, c, i = (12, 5, 2, 64, 32) if not halves else (40, 4, 2, 64, 32)
    if halves:
        ids = torch.stack([torch.zeros(t, dtype=torch.long), torch.randint(1, e, (t,), generator=gen)], 1)
        ids[:20, 1] = 1
        weights = torch.rand(t, a, generator=gen)
    else:
        weights, ids = route_ref(torch.randn(t, e, generator=gen), torch.zeros(e), a)
    x = torch.randn(t, c, generator=gen).to(device)
    w1, w3, w2 = experts(gen, device, F32, e, c, i, std=0.1)
    ids, weights = ids.to(device), weights.to(device)
    aligned = moe_triton.align(ids, e, 32)
    h = moe_triton.gate_up(x, w1, w3, t * a, a, aligned, 1.702, 7.0, block_m, config, halves=halves)
    y = moe_triton.grouped_gemm(
        h, w2, t * a, a, aligned, True, weights.flatten(), F32, block_m, config, halves
    )
    assert rel(y.view(t, a, c).sum(1), moe_experts_ref(x, weights, ids, w1, w3, w2, 1.702, 7.0)) < 1e-4


TAILS_GPU = [256 + 10, 384 + 25, 128 + 40, 20, 128, 128 + 70, 256 + 16, 128 + 17, 0, 33, 128 + 60, 600]
TAILS_INTERPRETER = [64 + 10, 128 + 25, 64 + 40, 20, 64, 64 + 30, 64 + 16, 64 + 17, 0, 33]


@targets(
    "dtype, counts, c, i, align, config, tail",
    cuda=[(BF16, TAILS_GPU, 512, 256, 128, None, tail) for tail in (16, 32, 64)],
    interpreter=[(F32, TAILS_INTERPRETER, 64, 32, 64, (32, 32, 4, 1, 2), tail) for tail in (16, 32)],
)
def test_merged_moe_tails_equal_their_own_tiles(device, dtype, counts, c, i, align, config, tail):
    """Short last blocks taken by their expert's previous block (`moe_triton._tail`): bitwise the
    same outputs as with each block in its own tile on the GPU (within rounding in Triton's
    interpreter), and the reference. One expert per token, so
    each expert's count picks the case: tails after whole blocks, half-height last blocks, long
    ones, lone short experts. config None: the prefill's own tiles."""
    gen = torch.Generator(device="cpu").manual_seed(tail)
    e = len(counts)
    ids = torch.cat([torch.full((n,), k) for k, n in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)][:, None].to(device)
    t, m = ids.shape[0], ids.numel()
    x = torch.randn(t, c, generator=gen).to(device, dtype)
    w1, w3, w2 = experts(gen, device, dtype, e, c, i)
    weights = torch.rand(t, 1, generator=gen).to(device)
    if config is None:
        (up_m, up_cfg), (down_m, down_cfg) = moe_triton.tiles(m, dtype)
        assert up_m == down_m == align
    else:
        up_m, up_cfg, down_m, down_cfg = align, config, align, config
    aligned = moe_triton.align(ids, e, align)
    outs = []  # every output stays alive, so no run's unwritten rows can hold another's values
    for merged in (0, tail):
        h = moe_triton.gate_up(x, w1, w3, m, 1, aligned, 1.702, 7.0, up_m, up_cfg, halves=True, tail=merged)
        w = weights.flatten()
        outs.append(
            moe_triton.grouped_gemm(h, w2, m, 1, aligned, True, w, F32, down_m, down_cfg, True, tail=merged)
        )
    if device == "cuda":  # the same products in other tiles: bit for bit
        assert torch.equal(outs[0], outs[1])
    else:  # the interpreter's products are numpy's, whose rounding follows the product's shape
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-7)
    ref = moe_experts_ref(x.float(), weights, ids, w1.float(), w3.float(), w2.float(), 1.702, 7.0)
    assert rel(outs[1], ref) < (1e-4 if dtype == F32 else 2e-2)


@triton.jit
def _launch_order_kernel(expert_ptr, ends_ptr, used_ptr, out_ptr, N: tl.constexpr, BN: tl.constexpr,
                         BM: tl.constexpr, ALIGN_M: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    row, col = moe_triton.grouped_pid(
        pid, tl.num_programs(0), expert_ptr, ends_ptr, used_ptr, N, BN, BM, ALIGN_M, GROUP_M
    )
    tl.store(out_ptr + 2 * pid, row)
    tl.store(out_ptr + 2 * pid + 1, col)


ORDERS = [(40, 6, 2, 16, 16, 3), (64, 8, 4, 32, 16, 2), (3, 8, 2, 16, 16, 8)]


@targets("t, e, a, align_m, block_m, group", cuda=ORDERS, interpreter=ORDERS)
def test_launch_order_sweeps_each_experts_row_groups(device, t, e, a, align_m, block_m, group):
    """The MoE kernels' program order: each expert's row blocks in groups of at most GROUP_M sweep
    the column blocks, a group never spanning two experts; unused blocks after, in plain order."""
    gen = torch.Generator(device="cpu").manual_seed(t)
    ids = torch.randint(0, e, (t, a), generator=gen)
    ids[: t // 2, 0] = 1  # one large expert, several groups of blocks
    aligned = moe_triton.align(ids.to(device), e, align_m)
    n_rows = moe_triton.row_blocks(aligned, t * a, block_m)
    n_cols = 3  # N 40 in column blocks of 16
    got = torch.empty(n_rows * n_cols, 2, dtype=torch.int32, device=device)
    _launch_order_kernel[(n_rows * n_cols,)](
        aligned.block_expert, aligned.ends, aligned.used, got, N=40, BN=16, BM=block_m, ALIGN_M=align_m, GROUP_M=group
    )  # fmt: skip
    want, start = [], 0
    for end in (aligned.ends // block_m).tolist():
        for first in range(start, end, group):
            rows = range(first, min(first + group, end))
            want += [(r, c) for c in range(n_cols) for r in rows]
        start = end
    want += [(r, c) for r in range(start, n_rows) for c in range(n_cols)]
    assert got.tolist() == [list(p) for p in want]


ROUTES = [(1, 8, 2, 16), (64, 128, 4, 16), (5, 6, 3, 4), (3, 8, 2, 16), (300, 128, 4, 16)]


@targets("t, e, a, block_m", cuda=ROUTES, interpreter=ROUTES[:4])
def test_routing_and_alignment_match_reference(device, t, e, a, block_m):
    """Top-k with the selection-only bias (exact ties to the lower expert id), and the pairs
    sorted into expert groups aligned to block_m (one launch for a decode step's few pairs)."""
    gen = torch.Generator(device="cpu").manual_seed(t + e)
    logits = torch.randn(t, e, generator=gen)
    if t == 3:
        logits[:, :4] = 0.5
    bias = torch.randn(e, generator=gen) * 0.1
    w, ids = router_triton.route(logits.to(device), bias.to(device), a)
    w_ref, ids_ref = route_ref(logits, bias, a)
    assert torch.equal(ids.cpu(), ids_ref)
    assert float((w.cpu() - w_ref).abs().max()) < 1e-6
    for got, want in zip(
        moe_triton.align(ids, e, block_m), moe_triton.align_ref(ids_ref, e, block_m), strict=True
    ):
        assert torch.equal(got.cpu(), want)


@targets("t, c, e", cuda=[(1, 512, 128), (8, 512, 128), (3, 2500, 6)], interpreter=[(3, 2500, 6), (1, 96, 8)])
def test_router_gemv_is_an_fp32_product(device, t, c, e):
    """A decode step's router logits in one launch: as close to the exact product as fp32's own
    GEMM (C not a whole number of tiles in the 2500 case)."""
    gen = torch.Generator(device="cpu").manual_seed(c)
    x = torch.randn(t, c, generator=gen).bfloat16()
    w = torch.randn(e, c, generator=gen) * 0.02
    want = x.double() @ w.double().T
    fp32 = torch.nn.functional.linear(x.float(), w)
    got = router_triton.router_gemv(x.to(device), w.to(device)).cpu()
    assert float((got.double() - want).abs().max()) <= 4 * float((fp32.double() - want).abs().max()) + 1e-6


@pytest.mark.cuda
def test_router_logits_from_bf16_slices_match_fp32():
    """A prefill's router logits as one bf16 GEMM against three slices of the fp32 weight."""
    from m3lm.kernels.moe import router_logits, split_bf16

    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(300, 512, generator=gen).bfloat16().cuda()
    w = (torch.randn(128, 512, generator=gen) * 0.02).cuda()
    want = x.double() @ w.double().T
    fp32 = torch.nn.functional.linear(x.float(), w)
    split = router_logits(x, w, split_bf16(w))
    assert split.dtype == torch.float32 and split.shape == (300, 128)
    # fp32 accumulation either way: the split is as close to the exact product as the fp32 GEMM
    err = float((split.double() - want).abs().max())
    assert err <= 4 * float((fp32.double() - want).abs().max()) + 1e-6, err
