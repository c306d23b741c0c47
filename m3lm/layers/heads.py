"""The CPU's heads of a packed q, k, v (index q, index k) product: every head normed and rotated
in one pass, each with its own norm weight, instead of a norm and a rotation per kind of head."""

from __future__ import annotations

import torch

from m3lm.layers.norm import rms_norm_cpu
from m3lm.layers.rotary import apply_rope_rows


def packed_heads(y: torch.Tensor | None, attn, batch) -> tuple | None:
    """The heads of the packed product y [T, W] of `attn` (the model's `Attention`): q [T, H, D],
    k and v [T, K, D], and on sparse layers iq [T, K, D] and ik [T, D] (else None), as its
    per-kind norms and RoPE make them, with the batch's `rope_rows`. None unless y is fp32 on
    the CPU and every head is as wide as the attention heads."""
    h, k, d, di = attn.dims  # di 0 on full-attention layers
    if y is None or y.dtype != torch.float32 or y.is_cuda or di not in (0, d):
        return None
    rope = batch.rope_rows(*attn.rotary, d)
    counts = (h, k, k, k, 1) if di else (h, k, k)
    norms = attn._norms()  # the weights of every kind of head but v
    heads = y.view(y.shape[0], -1, d)  # [T, N, D]
    out = apply_rope_rows(rms_norm_cpu(heads, _stacked(attn, norms, counts), attn.q_norm.eps), rope)
    q, k_, v = out[:, :h], out[:, h : h + k], heads[:, h + k : h + 2 * k]
    if not di:
        return q, k_, v, None, None
    return q, k_, v, out[:, h + 2 * k : h + 3 * k], out[:, h + 3 * k]


def _stacked(owner, norms: tuple[torch.Tensor, ...], counts: tuple[int, ...]) -> torch.Tensor:
    """[N, D]: each head's norm weight (v's rows zero: never read), kept on `owner` and made again
    whenever a weight changes; inside a compiled graph the kept ones (an eager step made them)."""
    if torch.compiler.is_compiling() and "_stacked_norms" in owner.__dict__:
        return owner.__dict__["_stacked_norms"][1]
    if any(w.is_inference() for w in norms):  # no version counter to tell a change by: made anew
        return _stack(norms, counts)
    key = tuple((w.data_ptr(), w._version) for w in norms)
    kept = owner.__dict__.get("_stacked_norms")
    if kept is None or kept[0] != key:
        kept = owner.__dict__["_stacked_norms"] = (key, _stack(norms, counts))
    return kept[1]


def _stack(norms: tuple[torch.Tensor, ...], counts: tuple[int, ...]) -> torch.Tensor:
    rows = [*norms[:2], torch.zeros_like(norms[0]), *norms[2:]]
    return torch.cat([w.detach()[None].expand(n, -1) for w, n in zip(rows, counts, strict=True)])
