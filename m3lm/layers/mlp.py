"""The clamped SwiGLU ("swigluoai") used by the dense MLP, the shared expert and routed experts."""

from __future__ import annotations

import torch
from torch import nn


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """`min(g, limit) * sigmoid(alpha * g) * (clamp(u, -limit, limit) + 1)`: gate clamped from above only."""
    if gate.is_cuda:
        from m3lm.kernels import fused

        return fused.swiglu_oai(gate, up, alpha, limit)
    return swiglu_oai_ref(gate, up, alpha, limit)


def swiglu_oai_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    g = gate.clamp(max=limit)
    u = up.clamp(min=-limit, max=limit)
    return g * torch.sigmoid(alpha * g) * (u + 1.0)


class MLP(nn.Module):
    def __init__(self, dim: int, inter: int, alpha: float, limit: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_proj = nn.Linear(dim, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(dim, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_oai(self.gate_proj(x), self.up_proj(x), self.alpha, self.limit))
