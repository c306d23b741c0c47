"""The fused elementwise Triton kernels (norms, RoPE, SwiGLU, the decode step's heads, the MoE
combine) against their references, on the GPU and in Triton's interpreter (`targets`)."""

import pytest
import torch

pytest.importorskip("triton")

from m3lm.kernels import fused
from m3lm.layers.mlp import swiglu_oai_ref
from m3lm.layers.norm import rms_norm_ref
from m3lm.layers.rotary import apply_rope_ref, rope_cos_sin
from tests.support.targets import targets

F32, BF16 = torch.float32, torch.bfloat16
BOTH = [F32, BF16]


def rel(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def tol(dtype) -> float:
    return 1e-5 if dtype == F32 else 1e-2


def rand(gen, device, dtype, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)


@targets(
    "dtype, shape",
    cuda=[(d, s) for d in BOTH for s in [(3, 64), (5, 4, 128), (2, 6144)]],
    interpreter=[(F32, (5, 3, 24))],
)
def test_rms_norm(device, dtype, shape):
    gen = torch.Generator(device="cpu").manual_seed(len(shape))
    x, w = rand(gen, device, dtype, *shape), rand(gen, device, dtype, shape[-1])
    assert rel(fused.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)) < tol(dtype)


ROPE_GPU = [(7, 8, 128, 64), (1, 64, 128, 64), (9, 2, 16, 8), (4, 3, 96, 32)]


@targets(
    "dtype, t, n, d, r", cuda=[(dt, *s) for dt in BOTH for s in ROPE_GPU], interpreter=[(F32, 5, 3, 24, 8)]
)
def test_rope(device, dtype, t, n, d, r):
    gen = torch.Generator(device="cpu").manual_seed(t * n)
    x = rand(gen, device, dtype, t, n, d)
    cos, sin = rope_cos_sin(torch.randint(0, 10**6, (t,), generator=gen).to(device), r, 5e6)
    assert rel(fused.apply_rope(x, cos, sin), apply_rope_ref(x, cos, sin)) < tol(dtype)


@targets("dtype, t, n", cuda=[(d, 37, 3072) for d in BOTH], interpreter=[(F32, 7, 33)])
def test_swiglu(device, dtype, t, n):
    gen = torch.Generator(device="cpu").manual_seed(n)
    g, u = (rand(gen, device, dtype, t, n, scale=5) for _ in range(2))
    assert rel(fused.swiglu_oai(g, u, 1.702, 7.0), swiglu_oai_ref(g, u, 1.702, 7.0)) < tol(dtype)
    h = rand(gen, device, dtype, t, 2, 2 * n, scale=5)  # packed [gate | up] columns
    assert rel(fused.swiglu_packed(h, 1.702, 7.0), swiglu_oai_ref(h[..., :n], h[..., n:], 1.702, 7.0)) < tol(
        dtype
    )


@targets("dtype, t, n", cuda=[(d, 33, 6144) for d in BOTH], interpreter=[(F32, 5, 40)])
def test_residual_add_and_embedding_with_norm(device, dtype, t, n):
    """The residual add and the next norm in one pass; the embedding and the first norm in one."""
    gen = torch.Generator(device="cpu").manual_seed(n)
    h, d, w = rand(gen, device, dtype, t, n), rand(gen, device, dtype, t, n), rand(gen, device, dtype, n)
    s, y = fused.add_rms_norm(h, d, w, 1e-6)
    assert torch.equal(s, h + d)
    assert rel(y, rms_norm_ref(h + d, w, 1e-6)) < tol(dtype)
    ids = torch.randint(0, t, (2 * t,), generator=gen).to(device)
    e, y = fused.embed_rms_norm(ids, h, w, 1e-6)
    assert torch.equal(e, h[ids]) and torch.equal(y, fused.rms_norm(h[ids], w, 1e-6))


NORM_ROPE_GPU = [(7, 64, 128, 64), (300, 4, 128, 64), (5, 1, 128, 64), (4, 3, 96, 32)]


@targets(
    "dtype, t, n, d, r",
    cuda=[(dt, *s) for dt in BOTH for s in NORM_ROPE_GPU],
    interpreter=[(F32, 5, 3, 24, 8), (F32, 5, 1, 24, 8)],
)
def test_norm_rope_on_a_strided_slice(device, dtype, t, n, d, r):
    """Per-head norm and RoPE on a slice of a wider projection, as the model passes q and k."""
    gen = torch.Generator(device="cpu").manual_seed(t * n)
    wide = rand(gen, device, dtype, t, (n + 2) * d)
    x = wide[:, d : (n + 1) * d].view(t, n, d)
    w = rand(gen, device, dtype, d)
    cos, sin = rope_cos_sin(torch.randint(0, 10**6, (t,), generator=gen).to(device), r, 5e6)
    ref = apply_rope_ref(rms_norm_ref(x, w, 1e-6), cos, sin)
    assert rel(fused.norm_rope(x, w, 1e-6, cos, sin), ref) < tol(dtype)


@targets(
    "dtype, b, h, k, d, di, r, pages, page, index",
    cuda=[(BF16, 5, 64, 4, 128, 128, 64, 12, 128, index) for index in (True, False)],
    interpreter=[(F32, 3, 4, 2, 16, 8, 8, 5, 4, index) for index in (True, False)],
)
def test_decode_heads_match_per_head_norm_rope_and_cache_writes(
    device, dtype, b, h, k, d, di, r, pages, page, index
):
    """One launch for the heads of a decode step: q normed and rotated, k normed, rotated and
    written to the cache with v (and the index query and key), nothing else written."""
    gen = torch.Generator(device="cpu").manual_seed(int(index))
    widths = [h * d, k * d, k * d] + ([k * di, di] if index else [])
    y = rand(gen, device, dtype, b, sum(widths), scale=3)
    outs = y.split(widths, dim=-1)
    norms = [rand(gen, device, dtype, n) for n in (d, d, di, di)[: len(widths) - 1]]
    positions = torch.tensor([4095, 0, 77, 128, 9000][:b])
    cos, sin = (u.to(device) for u in rope_cos_sin(positions, r, 5e6))
    pg = torch.randperm(pages, generator=gen)[:b].to(device)
    sl = torch.randint(0, page, (b,), generator=gen).to(device)
    caches = [torch.zeros(pages, page, *s, device=device, dtype=dtype) for s in ((k, d), (k, d), (di,))]
    q, iq = fused.decode_heads(
        y, (h, k, d, di if index else 0), tuple(norms), 1e-6, cos, sin,
        caches[0], caches[1], caches[2] if index else None, pg, sl,
    )  # fmt: skip

    def want(x, heads, w):
        return apply_rope_ref(rms_norm_ref(x.reshape(b, heads, -1), w, 1e-6), cos, sin)

    close = 5e-3 if dtype == BF16 else 1e-5
    assert (
        rel(q, want(outs[0], h, norms[0])) < close
        and rel(caches[0][pg, sl], want(outs[1], k, norms[1])) < close
    )
    assert torch.equal(caches[1][pg, sl], outs[2].view(b, k, d))
    written = torch.zeros(pages, page, dtype=torch.bool, device=device)
    written[pg, sl] = True
    assert not caches[0][~written].any() and not caches[1][~written].any() and not caches[2][~written].any()
    if index:
        assert rel(iq, want(outs[3], k, norms[2])) < close
        assert rel(caches[2][pg, sl], want(outs[4], 1, norms[3])[:, 0]) < close
    else:
        assert iq is None and not caches[2].any()


@targets(
    "dtype, t, a, c",
    cuda=[(d, 300, 4, 6144) for d in BOTH],
    interpreter=[(F32, 6, 4, 1500)],
)
def test_moe_combine_and_its_fold_into_the_next_norm(device, dtype, t, a, c):
    """The pairs weighted (or already weighted), summed, scaled and added to the shared expert;
    unweighted pairs in expert order gathered by rows; the combine inside the next residual add
    and norm gives the two passes' results bit for bit (the MoE output rounded to the shared
    expert's dtype, which may be wider than h's)."""
    gen = torch.Generator(device="cpu").manual_seed(t)
    pairs = torch.randn(t, a, c, generator=gen).to(device)
    shared = rand(gen, device, dtype, t, c)
    assert rel(fused.moe_combine(pairs, shared, 2.0), (pairs.sum(1) * 2.0 + shared.float()).to(dtype)) < tol(
        dtype
    )
    flat = rand(gen, device, dtype, t * a, c)
    rows = torch.randperm(t * a, generator=gen).view(t, a).to(device)
    weights = torch.rand(t, a, generator=gen).to(device)
    ref = (flat[rows].float() * weights[..., None]).sum(1) * 2.0 + shared.float()
    assert rel(fused.moe_combine(flat, shared, 2.0, rows, weights), ref) < (1e-5 if dtype == F32 else 1e-2)
    h, w = shared.flip(0), rand(gen, device, dtype, c)
    for p, sh, r, wt in [
        (pairs, shared, None, None),
        (pairs.to(dtype), shared, None, weights),
        (pairs, shared.float(), None, None),
        (flat, shared, rows, weights),
    ]:
        s, y = fused.moe_add_rms_norm(h, p, sh, 2.0, w, 1e-6, rows=r, weights=wt)
        want = fused.add_rms_norm(h, fused.moe_combine(p, sh, 2.0, r, wt), w, 1e-6)
        assert torch.equal(s, want[0]) and torch.equal(y, want[1])
