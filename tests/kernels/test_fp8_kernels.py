"""The MXFP8 (weight-only FP8) Triton kernels against products on the dequantised weights, on the
GPU and in Triton's interpreter (`targets`; the interpreter's bf16 dot is not usable, so its cases
take fp32 activations)."""

import pytest
import torch

pytest.importorskip("triton")

from m3lm.kernels.fp8 import dequant_mxfp8, quantize_mxfp8
from m3lm.kernels.fp8_triton import DEQUANT_MIN_T, Config, dequantize, mxfp8_matmul, pack_gate_up
from m3lm.kernels.moe import moe_experts_ref, route_ref
from m3lm.kernels.moe_fp8_triton import moe_experts_fp8, moe_pairs_fp8, pair_path
from m3lm.layers.mlp import swiglu_oai_ref
from tests.support.targets import targets

F32, BF16 = torch.float32, torch.bfloat16


def rel(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def mxfp8_weight(gen, device, *shape, std=0.02):
    """A quantised weight whose rows hold neighbouring 32-blocks at different exponents."""
    q, s = quantize_mxfp8(torch.randn(*shape, generator=gen) * std)
    s[..., 1::3] += 2
    return q.to(device), s.to(device)


GEMV_CONFIGS = [None, ("gemv", 16, 512, 4, 3), ("gemv", 4, 1024, 8, 2), ("gemv_tc", 32, 256, 4, 3)]
# (kernel, O, In, BN, BK): O not a multiple of BN; In a multiple of 32, not of BK
GEMV_SMALL = [("gemv", 40, 96, 16, 64), ("gemv", 24, 256, 8, 128), ("gemv", 7, 64, 2, 64)]
GEMV_SMALL += [("gemv_tc", 40, 160, 16, 64), ("gemv_tc", 48, 128, 32, 128)]


@targets(
    "dtype, t, o, k, config",
    cuda=[
        (dtype, t, o, k, None)
        for dtype in (F32, BF16)
        for t, o, k in [(1, 512, 6144), (1, 6144, 3072), (64, 3072, 6144), (300, 200, 512), (1500, 200, 544)]
    ]
    + [
        (dtype, t, o, k, config)
        for dtype in (F32, BF16)
        for t in (1, 2, 4, 16)
        for config in GEMV_CONFIGS
        for o, k in [(512, 6144), (3072, 6144), (6144, 3072), (200, 544)]
    ],
    interpreter=[
        *[(F32, t, o, k, None) for t, o, k in [(1, 48, 64), (5, 40, 96), (40, 70, 128)]],
        (F32, 3, 24, 256, ("tile", 16, 64, 4, 1)),
        *[(F32, t, 40, 96, None) for t in (1, 2, 16, DEQUANT_MIN_T)],  # GEMV tiles; dequantised once
        *[(F32, t, o, k, (kind, bn, bk, 4, 1)) for t in (1, 2, 16) for kind, o, k, bn, bk in GEMV_SMALL],
    ],
)
def test_fp8_matmul_matches_dequantised_reference(device, dtype, t, o, k, config):
    """Every launch shape: the few-rows GEMVs (CUDA or tensor cores), tiles, and the one-launch
    dequantisation then a plain matmul for many rows; deterministic."""
    gen = torch.Generator(device="cpu").manual_seed(t + o + k)
    q, s = mxfp8_weight(gen, device, o, k)
    x = torch.randn(t, k, generator=gen).to(device, dtype)
    config = Config(*config) if config else None
    out = mxfp8_matmul(x, q, s, config)
    assert rel(out, x.float() @ dequant_mxfp8(q, s).T) < (1e-4 if dtype == F32 else 1e-2)
    assert torch.equal(out, mxfp8_matmul(x, q, s, config))


@targets(
    "dtype, o, k",
    cuda=[(F32, 200, 544), (BF16, 200, 544)],
    interpreter=[(F32, 40, 160)],
)
def test_fp8_dequantize_is_exact(device, dtype, o, k):
    """The prefill path's one-launch dequantisation equals the reference, value for value."""
    gen = torch.Generator(device="cpu").manual_seed(o)
    q, s = mxfp8_weight(gen, device, o, k)
    assert torch.equal(dequantize(q, s, dtype), dequant_mxfp8(q, s, dtype))


@targets(
    "dtype, t, o, k, config",
    cuda=[(BF16, t, o, 6144, None) for t in (1, 4, 16, 64) for o in (3072, 200)],
    interpreter=[
        (F32, 1, 40, 96, None),
        (F32, 2, 40, 96, ("gemv", 8, 64, 4, 1)),
        (F32, 16, 40, 96, ("gemv_tc", 16, 64, 4, 1)),
        (F32, 20, 40, 96, ("tile", 16, 64, 4, 1)),
    ],
)
def test_fp8_packed_gate_up_swiglu_matches_reference(device, dtype, t, o, k, config):
    """Gate and up packed in one weight, swiglu(gate, up) out: gates past the clamp's limit."""
    gen = torch.Generator(device="cpu").manual_seed(t + o)
    (q1, s1), (q3, s3) = (mxfp8_weight(gen, device, o, k, std=0.05) for _ in range(2))
    x = (torch.randn(t, k, generator=gen) * (1.0 if k > 1000 else 4.0)).to(device, dtype)
    gate, up = (x.float() @ dequant_mxfp8(q, s).T for q, s in ((q1, s1), (q3, s3)))
    assert float((gate > 7).float().mean()) > 0  # the clamp is exercised
    out = mxfp8_matmul(x, *pack_gate_up(q1, s1, q3, s3), Config(*config) if config else None, act="swiglu")
    assert out.shape == (t, o)
    assert rel(out, swiglu_oai_ref(gate, up, 1.702, 7.0)) < (1e-4 if dtype == F32 else 2e-2)


def fp8_experts(gen, device, e, c, i):
    return [mxfp8_weight(gen, device, *shape, std=0.05) for shape in ((e, i, c), (e, i, c), (e, c, i))]


def weighted_pairs_ref(x, weights, ids, w1, w3, w2) -> torch.Tensor:
    """weights[t, a] * expert_{ids[t, a]}(x[t]) -> [T, A, C], not summed over A."""
    gate, up = (torch.einsum("tc,taic->tai", x.float(), w[ids]) for w in (w1, w3))
    return weights[..., None] * torch.einsum("tai,taci->tac", swiglu_oai_ref(gate, up, 1.702, 7.0), w2[ids])


@targets(
    "dtype, t, e, a, c, i",
    cuda=[
        (dtype, *shape)
        for dtype in (F32, BF16)
        for shape in [(1, 8, 2, 64, 32), (64, 32, 4, 512, 256), (2000, 16, 4, 256, 96)]
    ],
    interpreter=[
        (F32, *shape)
        for shape in [(1, 8, 2, 64, 32), (2, 6, 4, 96, 64), (9, 6, 3, 96, 64), (40, 8, 2, 64, 32)]
    ],
)
def test_fp8_fused_moe_matches_reference(device, dtype, t, e, a, c, i):
    """One program per pair (`pair_gemv`) for a few pairs, K not a whole tile; aligned tiles beyond."""
    gen = torch.Generator(device="cpu").manual_seed(t)
    x = torch.randn(t, c, generator=gen).to(device, dtype)
    ws = fp8_experts(gen, device, e, c, i)
    weights, ids = (u.to(device) for u in route_ref(torch.randn(t, e, generator=gen), torch.zeros(e), a))
    out = moe_experts_fp8(x, weights, ids, *ws[0], *ws[1], *ws[2], 1.702, 7.0)
    ref = moe_experts_ref(x.float(), weights, ids, *(dequant_mxfp8(*w) for w in ws), 1.702, 7.0)
    assert rel(out, ref) < (1e-4 if dtype == F32 else 2e-2)


def _tiles(dtype, swap):
    tile = (64, 64 if dtype == F32 else 256, 4, 2, swap)
    return ((16, tile), (16, tile))


@targets(
    "dtype, t, e, a, c, i, configs",
    cuda=[
        (dtype, t, 32, 4, 512, 256, _tiles(dtype, swap))
        for dtype in (F32, BF16)
        for t in (1, 64)
        for swap in (False, True)
    ],
    interpreter=[  # the weight on the tensor cores' wide side; BLOCK_M 32 for the down GEMM
        (F32, t, e, a, c, i, configs)
        for t, e, a, c, i in [(2, 6, 4, 96, 64), (9, 6, 3, 96, 64)]
        for configs in [
            ((16, (32, 32, 4, 1, True)), (32, (16, 64, 4, 1, True))),
            ((16, (16, 64, 4, 1, False)), (16, (32, 32, 4, 1, True))),
        ]
    ],
)
def test_fp8_moe_pairs_match_reference(device, dtype, t, e, a, c, i, configs):
    """Per-pair outputs of the fused FP8 gate/up and down, under both operand orders."""
    gen = torch.Generator(device="cpu").manual_seed(t)
    x = torch.randn(t, c, generator=gen).to(device, dtype)
    ws = fp8_experts(gen, device, e, c, i)
    weights, ids = (u.to(device) for u in route_ref(torch.randn(t, e, generator=gen), torch.zeros(e), a))
    out = moe_pairs_fp8(x, weights, ids, *ws[0], *ws[1], *ws[2], 1.702, 7.0, configs)
    assert out.shape == (t, a, c)
    ref = weighted_pairs_ref(x, weights, ids, *(dequant_mxfp8(*w) for w in ws))
    assert rel(out, ref) < (1e-4 if dtype == F32 else 2e-2)


@targets(
    "dtype, t, e, a, c, i",
    cuda=[(BF16, t, 32, 4, 512, 256) for t in (1, 2)],
    interpreter=[(F32, 2, 6, 3, 96, 64)],
)
def test_fp8_moe_pairs_with_shared_expert_match_reference(device, dtype, t, e, a, c, i):
    """A decode step's pairs one program each, the shared expert in the same launches (one more
    row per token, unscaled)."""
    assert pair_path(t * a)
    gen = torch.Generator(device="cpu").manual_seed(t)
    x = torch.randn(t, c, generator=gen).to(device, dtype)
    ws = fp8_experts(gen, device, e, c, i)
    sh = [mxfp8_weight(gen, device, *shape, std=0.05) for shape in ((i, c), (i, c), (c, i))]
    weights, ids = (u.to(device) for u in route_ref(torch.randn(t, e, generator=gen), torch.zeros(e), a))
    pairs, shared = moe_pairs_fp8(
        x, weights, ids, *ws[0], *ws[1], *ws[2], 1.702, 7.0, shared=(*sh[0], *sh[1], *sh[2])
    )
    assert pairs.shape == (t, a, c) and shared.shape == (t, c)
    tol = 1e-4 if dtype == F32 else 2e-2
    assert rel(pairs, weighted_pairs_ref(x, weights, ids, *(dequant_mxfp8(*w) for w in ws))) < tol
    g, u, d = (dequant_mxfp8(*w) for w in sh)
    assert rel(shared, swiglu_oai_ref(x.float() @ g.T, x.float() @ u.T, 1.702, 7.0) @ d.T) < tol
