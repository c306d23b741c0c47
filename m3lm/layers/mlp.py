"""The clamped SwiGLU ("swigluoai") used by the dense MLP, the shared expert and routed experts."""

from __future__ import annotations

import torch
from torch import nn

from m3lm.kernels.activation import swiglu_oai as swiglu_oai
from m3lm.kernels.activation import swiglu_oai_ref as swiglu_oai_ref
from m3lm.kernels.q4 import Q4Weight
from m3lm.layers.linear import pack_rows_, packed_linear


class MLP(nn.Module):
    def __init__(self, dim: int, inter: int, alpha: float, limit: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_proj = nn.Linear(dim, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(dim, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, dim, bias=False, dtype=dtype)
        self.gate_up: tuple[torch.Tensor, ...] | None = None  # set by `prepare_`

    def prepare_(self) -> None:
        """Pack gate and up into one weight [gate rows; up rows] (`pack_rows_`), once the
        weights are final; unprepared, the MLP runs the three products as they are."""
        self.gate_up = pack_rows_(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(swiglu_oai(self.gate_proj(x), self.up_proj(x), self.alpha, self.limit))
        if not x.is_cuda:  # one product, then the reference activation on its two halves
            gate, up = packed_linear(x, self.gate_up).split(self.gate_proj.out_features, dim=-1)
            return self.down_proj(swiglu_oai(gate, up, self.alpha, self.limit))
        return self.down_proj(gate_up_swiglu(x, self.gate_up, self.alpha, self.limit))


def gate_up_swiglu(
    x: torch.Tensor, packed: tuple[torch.Tensor, ...], alpha: float, limit: float
) -> torch.Tensor:
    """swiglu(x @ gate.T, x @ up.T) from the packed [gate rows; up rows] weight (`pack_rows_`), on
    the GPU: one product, then the activation; MXFP8 below DEQUANT_MIN_T rows in one launch, the
    activation applied to the fp32 sums (the FP8 kernel's `act="swiglu"`)."""
    from m3lm.kernels import fused
    from m3lm.kernels.fp8_triton import DEQUANT_MIN_T, GEMV_MAX_T, mxfp8_matmul

    flat = x.reshape(-1, x.shape[-1])  # [T, C]
    if isinstance(packed[0], Q4Weight) and flat.shape[0] <= GEMV_MAX_T:  # 4 bits: in the GEMVs
        w = packed[0]
        y = mxfp8_matmul(flat, w.values, w.scale, act="swiglu", alpha=alpha, limit=limit, q4=w)
        return y.view(*x.shape[:-1], -1)
    if len(packed) == 2 and flat.shape[0] < DEQUANT_MIN_T:  # MXFP8: values [2I, C], scales [2I, C/32]
        y = mxfp8_matmul(flat, *packed, act="swiglu", alpha=alpha, limit=limit)
        return y.view(*x.shape[:-1], -1)
    h = packed_linear(flat, packed)  # [T, 2I]
    return fused.swiglu_packed(h, alpha, limit).view(*x.shape[:-1], -1)
