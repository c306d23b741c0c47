"""The MLP activation (clamped SwiGLU) and its reference; the MoE kernels and the layers share it."""

from __future__ import annotations

import torch


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
