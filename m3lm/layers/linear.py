"""A Linear whose weight stays MXFP8 in memory: e4m3 values plus one E8M0 exponent per 32 inputs."""

from __future__ import annotations

import torch
from torch import nn

from m3lm.kernels.fp8 import MX_BLOCK, mxfp8_linear, quantize_mxfp8


def fp8_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised frozen parameter (float8 and uint8 tensors cannot require gradients)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class MXFP8Linear(nn.Module):
    """`y = x @ W.T` with W = weight [O, In] e4m3 * 2^(weight_scale [O, In/32] - 127); no bias."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        assert in_features % MX_BLOCK == 0, "MXFP8 needs the input width to be a multiple of 32"
        self.in_features, self.out_features = in_features, out_features
        self.weight = fp8_parameter(out_features, in_features, dtype=torch.float8_e4m3fn)
        self.weight_scale = fp8_parameter(out_features, in_features // MX_BLOCK, dtype=torch.uint8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mxfp8_linear(x, self.weight, self.weight_scale)


def _rows(module: nn.Module) -> tuple[torch.Tensor, ...]:
    """The row-indexed tensors of a Linear (weight) or MXFP8Linear (weight, weight_scale)."""
    if isinstance(module, MXFP8Linear):
        return module.weight, module.weight_scale
    return (module.weight,)


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """b's rows start where a's end, in one storage."""
    return (
        a.is_contiguous()
        and b.is_contiguous()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.storage_offset() == a.storage_offset() + a.numel()
    )


def packed_rows(a: nn.Module, b: nn.Module) -> tuple[torch.Tensor, ...] | None:
    """The weights of two layers on the same input as one [Oa + Ob, In] tensor (a's rows, then
    b's; with MXFP8, the scales likewise), for one product instead of two; None when they differ
    in kind or width, or would have to be moved during CUDA graph capture.

    The first call moves both into one buffer, and their parameters become views of it, so
    loading, state dicts and the unpacked path see the same tensors as before.
    """
    if (
        type(a) is not type(b)
        or not isinstance(a, nn.Linear | MXFP8Linear)
        or getattr(a, "bias", None) is not None
    ):
        return None
    pairs = list(zip(_rows(a), _rows(b), strict=True))
    if any(ta.shape[1:] != tb.shape[1:] or ta.dtype != tb.dtype for ta, tb in pairs):
        return None
    if not all(_follows(ta, tb) for ta, tb in pairs):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None
        for ta, tb in pairs:
            both = torch.cat([ta.data, tb.data])
            ta.data, tb.data = both[: ta.shape[0]], both[ta.shape[0] :]
    return tuple(
        ta.detach().as_strided((ta.shape[0] + tb.shape[0], *ta.shape[1:]), ta.stride()) for ta, tb in pairs
    )


def to_mxfp8_(owner: nn.Module, names: tuple[str, ...], quantize: bool = False) -> None:
    """Replace the nn.Linear children `names` of `owner` by MXFP8Linear (where the width allows it):
    empty, to be loaded, or quantised from the Linear's weight (`quantize`)."""
    for name in names:
        lin = getattr(owner, name, None)
        if not isinstance(lin, nn.Linear) or lin.in_features % MX_BLOCK:
            continue
        with torch.device(lin.weight.device):
            new = MXFP8Linear(lin.in_features, lin.out_features)
        if quantize:
            with torch.no_grad():
                q, s = quantize_mxfp8(lin.weight)
                new.weight.copy_(q)
                new.weight_scale.copy_(s)
        setattr(owner, name, new)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Resident bytes of the parameters and buffers, by dtype (e.g. {'torch.float8_e4m3fn': ...})."""
    out: dict[str, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out
