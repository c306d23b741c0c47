"""4-bit weights kept as published: two codes a byte plus per-group scales, dequantised where they
are multiplied. One layout for the three 4-bit formats m3lm reads:

- "mxfp4": E2M1 codes, one E8M0 exponent (uint8) per 32 inputs: W = e2m1 x 2^(s - 127).
- "nvfp4": E2M1 codes, one e4m3 factor per 16 inputs and an fp32 factor per row (a tensor's
  `weight_scale_2`, repeated over its rows so that tensors can be stacked and packed):
  W = (e2m1 x s) x g.
- "affine4": MLX's 4-bit integer codes q, a scale and a bias per group (32, 64 or 128 inputs),
  in the checkpoint's float dtype: W = s x q + b.

Every format packs input 2j in the low nibble of byte j and 2j + 1 in the high one (MLX's bit
stream at 4 bits is that too). The formulas are `fp4.dequant_*` and `affine.dequant_affine`'s,
in the same fp32 order, so a weight kept in 4 bits is the weight those dequantise at load.

Shapes: values [..., O, In/2] uint8, scale [..., O, In/G], extra: bias [..., O, In/G] (affine4),
global [..., O] fp32 (nvfp4), or None (mxfp4).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from m3lm.kernels.fp4 import E2M1_MAGNITUDES, nibbles, unpack_e2m1
from m3lm.kernels.fp8 import e8m0_factor

Q4_FORMATS = {"mxfp4": 32, "nvfp4": 16, "affine4": None}  # format: its fixed group (affine: the config's)


class Q4Weight(NamedTuple):
    """One 4-bit weight (or a stack of them, or several packed along O) as the kernels take it."""

    values: torch.Tensor  # [..., O, In/2] uint8
    scale: torch.Tensor  # [..., O, In/G]
    extra: torch.Tensor | None  # bias [..., O, In/G] (affine4), global [..., O] fp32 (nvfp4), None
    fmt: str
    group: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantised weight's shape [..., O, In]."""
        return (*self.values.shape[:-1], self.values.shape[-1] * 2)

    def take(self, index) -> Q4Weight:
        """Leading entries of a stacked weight (e.g. some experts): values, scales and extra alike."""
        extra = None if self.extra is None else self.extra[index]
        return Q4Weight(self.values[index], self.scale[index], extra, self.fmt, self.group)


def dequant_q4(w: Q4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [..., O, In] in `dtype`, computed in fp32 and rounded once."""
    g = w.group
    if w.fmt == "affine4":
        q = nibbles(w.values).float().unflatten(-1, (-1, g))  # [..., O, In/G, G]
        out = w.scale.float()[..., None] * q + w.extra.float()[..., None]
    elif w.fmt == "mxfp4":
        out = unpack_e2m1(w.values).unflatten(-1, (-1, g)) * e8m0_factor(w.scale)[..., None]
    else:
        assert w.fmt == "nvfp4", w.fmt
        blocks = unpack_e2m1(w.values).unflatten(-1, (-1, g)) * w.scale.float()[..., None]
        out = blocks * w.extra.float()[..., None, None]
    return out.flatten(-2).to(dtype)


def dequantize_q4(w: Q4Weight, dtype: torch.dtype) -> torch.Tensor:
    """`dequant_q4` of a weight or a stack [..., O, In/2]; on the GPU in one launch (`fp8_triton`)."""
    if not w.values.is_cuda:
        return dequant_q4(w, dtype)
    from m3lm.kernels.fp8_triton import dequantize

    rows = w.values.shape[-1]
    flat = Q4Weight(
        w.values.reshape(-1, rows), w.scale.reshape(-1, w.scale.shape[-1]),
        None if w.extra is None else w.extra.reshape(-1, *w.extra.shape[w.values.dim() - 1 :]), w.fmt, w.group,
    )  # fmt: skip
    return dequantize(flat.values, flat.scale, dtype, flat).view(w.shape)


def q4_linear(x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
    """y = x @ W.T: x [..., In] -> [..., O]. GPU: the weight-only kernel of `fp8_triton`
    (dequantised in registers); CPU: the weight dequantised to x's dtype, then multiplied."""
    if x.is_cuda:
        from m3lm.kernels.fp8_triton import mxfp8_matmul

        flat = x.reshape(-1, x.shape[-1])
        return mxfp8_matmul(flat, w.values, w.scale, q4=w).view(*x.shape[:-1], w.values.shape[-2])
    return x @ dequant_q4(w, x.dtype).T


# --- quantisers (benchmarks and tests build 4-bit weights from float ones) ----------------------

_E2M1 = torch.tensor(E2M1_MAGNITUDES)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code of each fp32 value (already scaled into [-6, 6]) as uint8 0..15."""
    table = _E2M1.to(x.device)
    mag = (x.abs()[..., None] - table).abs().argmin(-1)  # ties to the smaller magnitude
    return (mag | ((x < 0).to(mag.dtype) << 3)).to(torch.uint8)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_q4(w: torch.Tensor, fmt: str, group: int | None = None) -> Q4Weight:
    """A float weight [..., O, In] in `fmt` (scales from each group's largest magnitude)."""
    g = Q4_FORMATS[fmt] or group or 64
    blocks = w.float().unflatten(-1, (-1, g))  # [..., O, In/G, G]
    amax = blocks.abs().amax(-1)
    if fmt == "mxfp4":
        exp = torch.ceil(torch.log2(amax.clamp(min=2.0**-126) / 6.0)).clamp(-127, 127)
        codes = _e2m1_codes(blocks / torch.exp2(exp)[..., None])
        return Q4Weight(_pack(codes.flatten(-2)), (exp + 127).to(torch.uint8), None, fmt, g)
    if fmt == "nvfp4":
        glob = (amax.amax((-2, -1)) / (6.0 * 448.0)).clamp(min=2.0**-120)  # [...] one per tensor
        scale = (amax / 6.0 / glob[..., None, None]).clamp(max=448.0).to(torch.float8_e4m3fn)
        step = scale.float() * glob[..., None, None]
        codes = _e2m1_codes(blocks / torch.where(step > 0, step, 1.0)[..., None])
        rows = glob[..., None].expand(*w.shape[:-1]).contiguous()
        return Q4Weight(_pack(codes.flatten(-2)), scale, rows, fmt, g)
    assert fmt == "affine4", fmt
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8).to(torch.bfloat16)
    bias = lo.to(torch.bfloat16)
    q = ((blocks - bias.float()[..., None]) / scale.float()[..., None]).round().clamp(0, 15)
    return Q4Weight(_pack(q.to(torch.uint8).flatten(-2)), scale, bias, fmt, g)
