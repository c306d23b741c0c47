"""4-bit float weights (E2M1, two to a byte) with NVFP4's or MXFP4's block scales: the references.

E2M1 code c: bit 3 the sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. A byte
holds inputs 2j (low nibble) and 2j + 1 (high nibble). NVFP4 scales 16 inputs by an FP8-E4M3
factor and the whole tensor by an fp32 one; MXFP4 scales 32 inputs by an E8M0 power of two.
"""

from __future__ import annotations

import torch

from m3lm.kernels.fp8 import e8m0_factor
from m3lm.kernels.mx_block import MX_BLOCK

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
MXFP4_BLOCK = MX_BLOCK


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """packed [..., In/2] uint8 -> the 4-bit codes [..., In] (input 2j the low nibble), uint8."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """packed [..., In/2] uint8 -> the E2M1 values [..., In] in fp32."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=packed.device)
    table = torch.cat([table, -table])  # codes 8-15 are the negatives (-0.0 included)
    return table[nibbles(packed).long()]


def dequant_nvfp4(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W = e2m1 * float(scale) * global_scale: packed [..., O, In/2] uint8, scale [..., O, In/16]
    float8_e4m3fn (`weight_scale`), global_scale one fp32 value (`weight_scale_2`) -> [..., O, In].

    e2m1 x e4m3 is exact in fp32, so the result is rounded once, by the global factor."""
    blocks = unpack_e2m1(packed).unflatten(-1, (-1, NVFP4_BLOCK)) * scale.float()[..., None]
    return (blocks.flatten(-2) * global_scale.float().reshape(())).to(dtype)


def dequant_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W = e2m1 * 2^(scale - 127): packed [..., O, In/2] uint8, scale [..., O, In/32] E8M0 -> [..., O, In]."""
    blocks = unpack_e2m1(packed).unflatten(-1, (-1, MXFP4_BLOCK)) * e8m0_factor(scale)[..., None]
    return blocks.flatten(-2).to(dtype)
