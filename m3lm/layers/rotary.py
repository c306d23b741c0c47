"""Partial rotary embedding, NeoX "rotate half" pairing inside the first `rotary_dim` channels."""

from __future__ import annotations

import torch

_INV_FREQ: dict[tuple, torch.Tensor] = {}


def _inv_freq(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """Computed on the CPU (bitwise the reference's) and moved once; reused inside CUDA graphs,
    and read, not computed, by a compiled step (an eager step made it first)."""
    key = (rotary_dim, theta, str(device))
    if key not in _INV_FREQ:
        inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        _INV_FREQ[key] = inv.to(device)
    return _INV_FREQ[key]


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, R/2] in fp32 for absolute positions [T]."""
    inv_freq = _inv_freq(rotary_dim, float(theta), positions.device)
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, R/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channels [0, R) of x [T, n, D]; channels [R, D) pass through. Math in fp32."""
    if x.is_cuda:
        from m3lm.kernels import fused

        return fused.apply_rope(x, cos, sin)
    return apply_rope_ref(x, cos, sin)


def norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Per-head RMSNorm of x [T, n, D] (one weight [D] for every head), then partial RoPE; one GPU pass."""
    if x.is_cuda:
        from m3lm.kernels import fused

        return fused.norm_rope(x, weight, eps, cos, sin)
    from m3lm.layers.norm import rms_norm_ref

    return apply_rope_ref(rms_norm_ref(x, weight, eps), cos, sin)


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """cos, sin [T, R/2] -> (c, s) [T, 1, D] and R/2 for `apply_rope_rows`: c = (cos, cos, 1...),
    s = (-sin, sin, 0...)."""
    half, t = cos.shape[-1], cos.shape[0]
    rest = head_dim - 2 * half
    c = torch.cat([cos, cos, cos.new_ones(t, rest)], -1)[:, None]
    s = torch.cat([-sin, sin, sin.new_zeros(t, rest)], -1)[:, None]
    return c, s, half


def apply_rope_rows(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
    """`apply_rope_ref` of fp32 x [T, n, D] by products over whole heads (`rope_rows`): x * c,
    then each rotary half adds the other half's product with s (x1 cos - x2 sin is
    x1 cos + x2 (-sin)); the pass-through channels are x * 1."""
    c, s, half = rows
    out = x * c
    out[..., :half].addcmul_(x[..., half : 2 * half], s[..., :half])
    out[..., half : 2 * half].addcmul_(x[..., :half], s[..., half : 2 * half])
    return out


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R/2]
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)  # [T, n, R]
    return torch.cat([out, x[..., 2 * half :]], dim=-1)  # [T, n, D]
