"""Fused elementwise kernels for the GPU (Triton), each the same function as its reference in
`m3lm/layers/`: Gemma RMSNorm, partial NeoX RoPE and the clamped SwiGLU. One launch replaces
the handful of small PyTorch ops of the reference, which matters in a decode step where launches,
not bytes, dominate. fp32 math throughout; outputs in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    tl.store(y_ptr + row * n + offs, (x * inv * (1.0 + w)).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm over the last dim of a contiguous x (any leading shape)."""
    x = x.contiguous()
    n = x.shape[-1]
    y = torch.empty_like(x)
    _rms_norm_kernel[(x.numel() // n,)](x, weight, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return y


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr, heads, D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)  # one (token, head) row of D channels
    t = row // heads
    offs = tl.arange(0, BLOCK)
    base = x_ptr + row * D
    x = tl.load(base + offs, mask=offs < D, other=0.0)
    rot = offs < 2 * HALF
    first = offs < HALF
    j = tl.where(first, offs, offs - HALF)
    c = tl.load(cos_ptr + t * HALF + j, mask=rot, other=1.0)
    s = tl.load(sin_ptr + t * HALF + j, mask=rot, other=0.0)
    partner = tl.load(base + tl.where(first, offs + HALF, offs - HALF), mask=rot, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    out = tl.where(first, xf * c - partner * s, xf * c + partner * s)
    out = tl.where(rot, out, xf)
    tl.store(y_ptr + row * D + offs, out.to(y_ptr.dtype.element_ty), mask=offs < D)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary embedding of x [T, n, D] with cos/sin [T, R/2] fp32."""
    x = x.contiguous()
    t, n, d = x.shape
    y = torch.empty_like(x)
    _rope_kernel[(t * n,)](
        x, cos.contiguous(), sin.contiguous(), y, n, D=d, HALF=cos.shape[-1], BLOCK=triton.next_power_of_2(d)
    )
    return y


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, numel, alpha, limit, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.minimum(tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32), limit)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    y = g * tl.sigmoid(alpha * g) * (u + 1.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n = gate.numel()
    _swiglu_kernel[(triton.cdiv(n, 1024),)](gate, up, y, n, alpha, limit, BLOCK=1024)
    return y
