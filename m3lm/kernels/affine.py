"""MLX's affine integer weights: the reference dequantiser.

Each row's `bits`-bit codes q (0 .. 2^bits - 1) are one little-endian bit stream, code i at bits
[i * bits, (i + 1) * bits), stored as uint32 words (so 3-, 5- and 6-bit codes cross bytes).
Every `group` consecutive inputs share a scale and a bias: W = scale * q + bias.
"""

from __future__ import annotations

import torch

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """packed [..., n * bits / 32] 32-bit words -> the n codes [..., n] as int32."""
    assert bits in AFFINE_BITS and (n * bits) % 32 == 0
    stream = packed.contiguous().view(torch.uint8).to(torch.int32)  # [..., n * bits / 8], little-endian
    stream = torch.nn.functional.pad(stream, (0, 1))  # a code may end in the byte after the last
    first = torch.arange(n, device=packed.device) * bits  # each code's first bit
    lo, hi = stream[..., first // 8], stream[..., first // 8 + 1]
    return ((lo | (hi << 8)) >> (first % 8)) & ((1 << bits) - 1)


def dequant_affine(
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """packed [..., O, In * bits / 32] uint32, scales and biases [..., O, In / group] -> W [..., O, In].

    In fp32: a bf16 scale times a code is exact, so each weight is rounded once, by the bias."""
    n_groups = scales.shape[-1]
    n = packed.shape[-1] * 32 // bits
    q = unpack_codes(packed, bits, n).float().unflatten(-1, (n_groups, -1))  # [..., O, In/group, group]
    w = scales.float()[..., None] * q + biases.float()[..., None]
    return w.flatten(-2).to(dtype)
