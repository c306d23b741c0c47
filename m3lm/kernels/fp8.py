"""MXFP8 weights: float8_e4m3fn values with one E8M0 exponent per 32 consecutive inputs."""

from __future__ import annotations

import torch

from m3lm.kernels.mx_block import MX_BLOCK as MX_BLOCK


def e8m0_factor(scale: torch.Tensor) -> torch.Tensor:
    """The fp32 factor 2^(s - 127) of E8M0 exponents (uint8, or torch's float8_e8m0fnu); 255 encodes NaN."""
    s = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    factor = torch.exp2((s.to(torch.int32) - 127).float())
    return torch.where(s == 255, torch.full_like(factor, float("nan")), factor)


def dequant_mxfp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W[..., o, i] = float(q[..., o, i]) * 2^(scale[..., o, i // 32] - 127); scale 255 encodes NaN.

    q [..., O, In] float8_e4m3fn, scale [..., O, In/32] uint8 (named `*_scale_inv`, but it multiplies).
    """
    w = q.float().unflatten(-1, (-1, MX_BLOCK)) * e8m0_factor(scale)[..., None]  # [..., O, In/32, 32]
    return w.flatten(-2).to(dtype)


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The release's scheme: per 32-block E8M0 scale = ceil(log2(amax / 448)), values rounded to e4m3.

    Used to build MXFP8 checkpoints for tests and benchmarks; returns (q, scale) as dequant_mxfp8 reads.
    """
    blocks = w.float().unflatten(-1, (-1, MX_BLOCK))  # [..., O, In/32, 32]
    amax = blocks.abs().amax(-1).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    q = (blocks / torch.exp2(exp)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.flatten(-2), (exp + 127).to(torch.uint8)


def mxfp8_invalid(q: torch.Tensor, scale: torch.Tensor) -> bool:
    """True when a kept-8-bit tensor encodes NaN: e4m3fn S.1111.111 (it has no Inf) or E8M0 255."""
    return bool(((q.view(torch.uint8) & 0x7F) == 0x7F).any() or (scale == 255).any())


def mxfp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x @ W.T with W = dequant_mxfp8(q, scale): x [..., In], q [O, In], scale [O, In/32] -> [..., O].

    On the GPU a weight-only FP8 kernel dequantises each 32-block in registers; on the CPU the
    weight is dequantised to x's dtype and multiplied (the reference).
    """
    if x.is_cuda:
        from m3lm.kernels.fp8_triton import mxfp8_matmul

        return mxfp8_matmul(x.reshape(-1, x.shape[-1]), q, scale).view(*x.shape[:-1], q.shape[0])
    return x @ dequant_mxfp8(q, scale, x.dtype).T


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 with one fp32 scale (amax / 448): x [..., D] -> (q [..., D], scale [...]).

    Used for the optional FP8 index-key cache (one scale per cached token)."""
    scale = x.float().abs().amax(-1).clamp(min=1e-12) / 448.0
    return (x.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def dequant_rows_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)
