"""Copy checkpoint tensor slices into parameters: 8-bit parameters take MXFP8 values and scales
as stored (or quantise a float slice with the release's scheme), float parameters take the slice
dequantised; 4-bit and MLX affine weights are dequantised (`decode_packed`), or kept in 4 bits
as stored where the parameter is (`write_q4_piece`); NaN and Inf are refused in every encoding."""

from __future__ import annotations

import torch

from m3lm.checkpoint_quant import AFFINE, MXFP4, NVFP4
from m3lm.errors import CheckpointError
from m3lm.kernels.affine import dequant_affine
from m3lm.kernels.fp4 import dequant_mxfp4, dequant_nvfp4
from m3lm.kernels.fp8 import MX_BLOCK, dequant_mxfp8, mxfp8_invalid, quantize_mxfp8
from m3lm.models.minimax_m3 import Piece


def decode_packed(kind: str, values: torch.Tensor, parts: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """A 4-bit or MLX affine weight [..., O, In] in fp32 from its stored values and scale tensors."""
    if kind == NVFP4:  # `input_scale` quantises activations (W4A4); a weight-only product needs none
        return dequant_nvfp4(values, parts["scale"], parts["global"])
    if kind == MXFP4:
        return dequant_mxfp4(values, parts["scale"])
    assert kind == AFFINE, kind
    return dequant_affine(values, parts["scale"], parts["biases"], bits)


def e8m0_bytes(scale: torch.Tensor | None) -> torch.Tensor | None:
    """E8M0 scales as raw exponent bytes (safetensors may type them F8_E8M0)."""
    return scale.view(torch.uint8) if scale is not None and scale.dtype == torch.float8_e8m0fnu else scale


def read_slice(sl, scale, index: tuple) -> torch.Tensor:
    """Source tensor `sl` at `index` (every dim indexed); MXFP8 is dequantised by whole 32-blocks
    along the input dim and then trimmed, so a slice need not start on a block boundary."""
    if scale is None:
        return sl[index]
    lo, hi = index[-1].start, index[-1].stop
    first, last = lo // MX_BLOCK, -(-hi // MX_BLOCK)
    q = sl[(*index[:-1], slice(first * MX_BLOCK, last * MX_BLOCK))]
    w = dequant_mxfp8(q, scale[(*index[:-1], slice(first, last))])
    return w[..., lo - first * MX_BLOCK : hi - first * MX_BLOCK]


def write_piece(params: dict, p: Piece, t: torch.Tensor, scale: torch.Tensor | None, name: str) -> None:
    """Copy one piece into its parameter: kept in 8 bits when the parameter is (quantised at load if
    the checkpoint is not), otherwise dequantised; NaN/Inf in any encoding is refused."""
    target = params[p.param] if p.slot is None else params[p.param][p.slot]
    scale = e8m0_bytes(scale)
    if target.dtype == torch.float8_e4m3fn:
        if scale is None:
            check_finite(t, name)
            t, scale = quantize_mxfp8(t)
        elif mxfp8_invalid(t, scale):
            raise CheckpointError(f"{name} holds NaN values (e4m3 or E8M0 NaN encodings)")
        sc = params[p.param + "_scale"]
        target.copy_(t)
        (sc if p.slot is None else sc[p.slot]).copy_(scale)
        return
    if scale is not None:
        t = dequant_mxfp8(t, scale)
    check_finite(t, name)
    target.copy_(t)


def write_slice(params: dict, p: Piece, sl, scale, index: tuple, name: str) -> None:
    """Copy a rank's slice `index` of a source tensor into local piece `p`: an 8-bit parameter takes
    the e4m3 values and the scales of the same rows and 32-blocks as they are (or the slice,
    quantised); a float one takes the slice dequantised."""
    target = params[p.param] if p.slot is None else params[p.param][p.slot]
    if target.dtype == torch.float8_e4m3fn:
        s = scale[(*index[:-1], _block_slice(index[-1], name))] if scale is not None else None
        write_piece(params, p, sl[index], s, name)
        return
    t = read_slice(sl, scale, index)
    check_finite(t, name)
    target.copy_(t)


def _block_slice(ix: slice, name: str) -> slice:
    """The scale columns of input columns `ix` (whole 32-blocks; the shard plan guarantees it)."""
    if ix.start % MX_BLOCK or ix.stop % MX_BLOCK:
        raise CheckpointError(f"{name}: input columns [{ix.start}, {ix.stop}) are not whole MXFP8 blocks")
    return slice(ix.start // MX_BLOCK, ix.stop // MX_BLOCK)


def check_finite(t: torch.Tensor, name: str) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{name} holds NaN or Inf values")


def write_q4_piece(params: dict, p: Piece, values: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
    """Copy one piece of a 4-bit weight into parameters that keep it as stored (`kernels.q4`):
    the codes (MLX's 32-bit words read as their bytes), the scales, and the biases (affine4) or
    the tensor's fp32 factor repeated over the piece's rows (nvfp4)."""

    def target(name: str) -> torch.Tensor:
        return params[name] if p.slot is None else params[name][p.slot]

    target(p.param).copy_(values.view(torch.uint8))
    target(p.param + "_scale").copy_(e8m0_bytes(parts["scale"]))
    if "biases" in parts:
        target(p.param + "_bias").copy_(parts["biases"])
    if "global" in parts:
        target(p.param + "_global").fill_(float(parts["global"].reshape(())))
