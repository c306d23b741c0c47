"""MoE for long prefills on PyTorch's grouped GEMM (`torch.nn.functional.grouped_mm`, CUTLASS on
the GPU), next to `moe_triton`'s fused kernels, which serve decode and short chunks.

With thousands of token-expert pairs the experts' products are large matrix multiplies and
their speed is the tensor cores' rate: the pairs are sorted by expert, each expert's rows are
gathered once into a contiguous block, and three grouped GEMMs (gate, up, down) run over the
blocks, with the clamped SwiGLU between them. Each product is rounded to bf16, as in the
reference (`moe.moe_experts_ref`). No host synchronisation.

Shapes: T tokens, A experts per token, M = T*A pairs, E experts, C hidden, I expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from m3lm.layers.mlp import swiglu_oai

MIN_PAIRS = 4096  # from `benchmarks/moe_configs.py --grouped`: below, the fused Triton kernels win


def available(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")


def moe_sorted(
    x: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    alpha: float,
    limit: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair's expert output, unweighted, in expert order, and where each pair landed:
    (y [M, C] in x's dtype, row [T, A] int64: pair (t, a)'s row of y)."""
    t, a = ids.shape
    flat = ids.flatten()  # [M]
    order = torch.sort(flat, stable=True).indices  # [M] pairs grouped by expert
    counts = torch.zeros(w1.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] end of each expert's rows
    xs = x[order // a]  # [M, C] each pair's token, grouped by expert
    gate = F.grouped_mm(xs, w1.transpose(1, 2), offs=offs)  # [M, I]
    up = F.grouped_mm(xs, w3.transpose(1, 2), offs=offs)
    h = swiglu_oai(gate, up, alpha, limit)  # [M, I]
    y = F.grouped_mm(h, w2.transpose(1, 2), offs=offs)  # [M, C]
    row = torch.empty_like(order)
    row[order] = torch.arange(order.numel(), device=x.device)
    return y, row.view(t, a)
