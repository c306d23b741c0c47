"""The weight-only kernels on 4-bit weights (MXFP4, NVFP4, MLX affine: `kernels.q4`) against
products on the dequantised weights, on the GPU and in Triton's interpreter (`targets`; the
interpreter's cases take fp32 activations). The same kernels read MXFP8 (`test_fp8_kernels`)."""

import pytest
import torch

pytest.importorskip("triton")

from m3lm.kernels.fp8_triton import DEQUANT_MIN_T, Config, dequantize, mxfp8_matmul
from m3lm.kernels.moe import route_ref
from m3lm.kernels.moe_fp8_triton import moe_pairs_q4
from m3lm.kernels.q4 import Q4Weight, dequant_q4, quantize_q4
from m3lm.layers.mlp import swiglu_oai_ref
from tests.kernels.test_fp8_kernels import weighted_pairs_ref
from tests.support.targets import targets

F32, BF16 = torch.float32, torch.bfloat16
FORMATS = [("mxfp4", None), ("nvfp4", None), ("affine4", 64), ("affine4", 32)]


def rel(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def q4_weight(gen, device, fmt, group, *shape, std=0.05) -> Q4Weight:
    """A 4-bit weight (stacked along its leading dims) whose rows' factors differ group to group."""
    w = quantize_q4(torch.randn(*shape, generator=gen) * std, fmt, group)
    if fmt == "nvfp4":  # each row its own tensor factor, as stacked and packed tensors have
        extra = w.extra * (1 + torch.rand(w.extra.shape, generator=gen))
        w = w._replace(extra=extra)
    moved = [t.to(device) if t is not None else None for t in w[:3]]
    return Q4Weight(*moved, w.fmt, w.group)


@targets(
    "fmt, group, dtype, t, o, k, config",
    cuda=[
        (fmt, group, dtype, t, o, k, None)
        for fmt, group in FORMATS
        for dtype in (F32, BF16)
        for t, o, k in [(1, 512, 6144), (1, 6144, 3072), (4, 3072, 6144), (64, 3072, 6144), (300, 200, 512),
                        (1500, 200, 512)]
    ] + [(fmt, group, BF16, 64, 3072, 6144, ("tile", 64, 128, 4, 4, 64)) for fmt, group in FORMATS],
    interpreter=[
        *[(fmt, group, F32, t, 40, 128, None) for fmt, group in FORMATS for t in (1, 3, 20, DEQUANT_MIN_T)],
        *[(fmt, group, F32, 2, 24, 256, ("gemv", 8, 128, 4, 1)) for fmt, group in FORMATS],
        *[(fmt, group, F32, 20, 40, 128, ("tile", 64, 64, 4, 1, 16)) for fmt, group in FORMATS],
        *[(fmt, group, F32, 16, 40, 192, ("gemv_tc", 16, 64, 4, 1)) for fmt, group in FORMATS[:3]],
    ],
)  # fmt: skip
def test_q4_matmul_matches_dequantised_reference(device, fmt, group, dtype, t, o, k, config):
    """Every launch shape (GEMVs, tiles, one dequantisation then a matmul: by default past the
    GEMVs' 16 rows); deterministic."""
    gen = torch.Generator(device="cpu").manual_seed(t + o + k)
    w = q4_weight(gen, device, fmt, group, o, k)
    x = torch.randn(t, k, generator=gen).to(device, dtype)
    config = Config(*config) if config else None
    out = mxfp8_matmul(x, w.values, w.scale, config, q4=w)
    assert rel(out, x.float() @ dequant_q4(w).T) < (1e-4 if dtype == F32 else 1e-2)
    assert torch.equal(out, mxfp8_matmul(x, w.values, w.scale, config, q4=w))


@targets(
    "fmt, group, dtype",
    cuda=[(fmt, group, dtype) for fmt, group in FORMATS for dtype in (F32, BF16)],
    interpreter=[(fmt, group, F32) for fmt, group in FORMATS],
)
def test_q4_dequantize_is_exact(device, fmt, group, dtype):
    """The kernels' dequantisation (one launch) equals the reference's, value for value."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    w = q4_weight(gen, device, fmt, group, 40, 256)
    assert torch.equal(dequantize(w.values, w.scale, dtype, w), dequant_q4(w, dtype))


@targets(
    "fmt, group, dtype, t, o, k",
    cuda=[(fmt, group, BF16, t, 3072, 6144) for fmt, group in FORMATS for t in (1, 16, 64)],
    interpreter=[(fmt, group, F32, t, 40, 128) for fmt, group in FORMATS[:3] for t in (1, 20)],
)
def test_q4_packed_gate_up_swiglu_matches_reference(device, fmt, group, dtype, t, o, k):
    gen = torch.Generator(device="cpu").manual_seed(t + o)
    w = q4_weight(gen, device, fmt, group, 2 * o, k)  # [gate rows; up rows]
    x = (torch.randn(t, k, generator=gen) * 4.0).to(device, dtype)
    gate, up = (x.float() @ dequant_q4(w).T).split(o, dim=-1)
    out = mxfp8_matmul(x, w.values, w.scale, act="swiglu", q4=w)
    assert out.shape == (t, o)
    assert rel(out, swiglu_oai_ref(gate, up, 1.702, 7.0)) < (1e-4 if dtype == F32 else 2e-2)


@targets(
    "fmt, group, dtype, t, e, a, c, i",
    cuda=[
        (fmt, group, BF16, *shape)
        for fmt, group in FORMATS
        for shape in [(1, 8, 2, 256, 128), (64, 32, 4, 512, 256), (2000, 16, 4, 256, 128)]
    ],
    interpreter=[
        (fmt, group, F32, *shape)
        for fmt, group in FORMATS[:3]
        for shape in [(1, 8, 2, 128, 64), (9, 6, 3, 128, 64)]
    ],
)
def test_q4_fused_moe_matches_reference(device, fmt, group, dtype, t, e, a, c, i):
    """Per-pair programs for a few pairs, aligned tiles beyond: every pair's weighted product."""
    gen = torch.Generator(device="cpu").manual_seed(t)
    x = torch.randn(t, c, generator=gen).to(device, dtype)
    w1, w3, w2 = (q4_weight(gen, device, fmt, group, *shape) for shape in ((e, i, c), (e, i, c), (e, c, i)))
    logits = torch.randn(t, e, generator=gen).to(device)
    weights, ids = route_ref(logits, torch.zeros(e, device=device), a)
    out = moe_pairs_q4(x, weights, ids, w1, w3, w2, 1.702, 7.0)
    ref = weighted_pairs_ref(x, weights, ids, *(dequant_q4(w) for w in (w1, w3, w2)))
    assert rel(out, ref) < (1e-4 if dtype == F32 else 2e-2)


@targets(
    "fmt, group",
    cuda=[(fmt, group) for fmt, group in FORMATS],
    interpreter=[],
)
def test_q4_moe_prefill_dequantises_the_experts_once(device, fmt, group):
    """From DEQUANT_MIN_T tokens `moe` multiplies the experts dequantised to bf16 (one launch
    each) with bf16's kernels: the layer's output matches the reference on the dequantised weights."""
    from m3lm.kernels.moe import moe

    gen = torch.Generator(device="cpu").manual_seed(3)
    t, e, a, c, i = DEQUANT_MIN_T + 100, 16, 4, 256, 128
    x = torch.randn(t, c, generator=gen).to(device, BF16)
    w1, w3, w2 = (q4_weight(gen, device, fmt, group, *shape) for shape in ((e, i, c), (e, i, c), (e, c, i)))
    weights, ids = route_ref(torch.randn(t, e, generator=gen).to(device), torch.zeros(e, device=device), a)
    out = moe(x, weights, ids, (w1, w3, w2), lambda h: torch.zeros_like(h), 1.702, 7.0, 2.0)
    ref = 2.0 * weighted_pairs_ref(x, weights, ids, *(dequant_q4(w) for w in (w1, w3, w2))).sum(1)
    assert rel(out.sum(), ref) < 2e-2
