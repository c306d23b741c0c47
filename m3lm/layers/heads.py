"""The CPU's heads of a packed q, k, v (index q, index k) product: every head normed and rotated
in one pass, each with its own norm weight, instead of a norm and a rotation per kind of head."""

from __future__ import annotations

import torch

from m3lm.layers.norm import rms_norm_cpu
from m3lm.layers.rotary import apply_rope_rows


def packed_heads(
    y: torch.Tensor, norms: torch.Tensor, dims: tuple[int, int, int, int], rope: tuple, eps: float
) -> tuple:
    """The heads of the packed product y [T, W] (fp32, on the CPU): q [T, H, D], k and v
    [T, K, D], and on sparse layers iq [T, K, D] and ik [T, D] (else None), each normed by its
    row of `norms` [N, D] (`stack_norms`) and rotated by `rope` (`ForwardBatch.rope_rows`).
    `dims`: (H, K, D, Di or 0 on full-attention layers), with Di = D."""
    h, k, d, di = dims
    heads = y.view(y.shape[0], -1, d)  # [T, N, D]
    out = apply_rope_rows(rms_norm_cpu(heads, norms, eps), rope)
    q, k_, v = out[:, :h], out[:, h : h + k], heads[:, h + k : h + 2 * k]
    if not di:
        return q, k_, v, None, None
    return q, k_, v, out[:, h + 2 * k : h + 3 * k], out[:, h + 3 * k]


def stack_norms(norms: tuple[torch.Tensor, ...], dims: tuple[int, int, int, int]) -> torch.Tensor | None:
    """[N, D]: each head's norm weight, from the q, k (index q, index k) weights `norms` (v's rows
    zero: never read); None unless every head is as wide as the attention heads."""
    h, k, d, di = dims  # di 0 on full-attention layers
    if di not in (0, d):
        return None
    counts = (h, k, k, k, 1) if di else (h, k, k)
    rows = [*norms[:2], torch.zeros_like(norms[0]), *norms[2:]]
    return torch.cat([w.detach()[None].expand(n, -1) for w, n in zip(rows, counts, strict=True)])
