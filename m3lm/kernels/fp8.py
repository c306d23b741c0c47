"""MXFP8 weights: float8_e4m3fn values with one E8M0 exponent per 32 consecutive inputs."""

from __future__ import annotations

import torch

MX_BLOCK = 32


def dequant_mxfp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W[..., o, i] = float(q[..., o, i]) * 2^(scale[..., o, i // 32] - 127); scale 255 encodes NaN.

    q [..., O, In] float8_e4m3fn, scale [..., O, In/32] uint8 (named `*_scale_inv`, but it multiplies).
    """
    exp = scale.to(torch.int32) - 127  # [..., O, In/32]
    factor = torch.exp2(exp.float())
    factor = torch.where(scale == 255, torch.full_like(factor, float("nan")), factor)
    w = q.float().unflatten(-1, (-1, MX_BLOCK)) * factor[..., None]  # [..., O, In/32, 32]
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
