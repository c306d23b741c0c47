"""Gemma-style RMSNorm, computed in fp32 whatever the activation dtype."""

from __future__ import annotations

import torch
from torch import nn

from m3lm.kernels.moe import MoEOutput


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * (1 + w)` over the last dim; stored `w` = 0 is the identity."""
    if x.is_cuda:
        from m3lm.kernels import fused

        return fused.rms_norm(x, weight, eps)
    return rms_norm_cpu(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_ref` with its normalisation as torch's one `rms_norm` op (the same arithmetic,
    fewer dispatches). `weight` [..., D] may hold a row per head of x [..., n, D]."""
    y = nn.functional.rms_norm(x.float(), (x.shape[-1],), None, eps)  # a new tensor: scaled in place
    return y.mul_(1.0 + weight.float()).to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the norm that follows it: (h + delta, rms_norm(h + delta)); one GPU pass."""
    if h.is_cuda:
        from m3lm.kernels import fused

        return fused.add_rms_norm(h, delta, weight, eps)
    s = h + delta
    return s, rms_norm_cpu(s, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: torch.Tensor | MoEOutput, residual: torch.Tensor | None = None):
        """norm(x) [T, C]; with the residual stream: (norm(residual + x), residual + x), one GPU
        pass in which x may be a MoE's pairs not yet summed (`MoEOutput`)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        if isinstance(x, MoEOutput):
            residual, x = x.add_rms_norm(residual, self.weight, self.eps)
        else:
            residual, x = add_rms_norm(residual, x, self.weight, self.eps)
        return x, residual
