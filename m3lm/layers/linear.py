"""Linears whose weight stays quantised in memory: MXFP8 (e4m3 values plus one E8M0 exponent per
32 inputs) or 4 bits as published (`kernels.q4`), and the packing of several into one product."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from m3lm.kernels.fp8 import MX_BLOCK, mxfp8_linear, quantize_mxfp8
from m3lm.kernels.q4 import Q4Weight, q4_linear


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


class Q4Linear(nn.Module):
    """`y = x @ W.T` with W a 4-bit weight kept as published: `weight` [O, In/2] uint8 codes,
    `weight_scale` [O, In/G], and `weight_bias` [O, In/G] (affine4) or `weight_global` [O] fp32
    (nvfp4); no bias term."""

    def __init__(self, in_features: int, out_features: int, fmt: str, group: int, scale_dtype: torch.dtype):
        super().__init__()
        assert in_features % group == 0, f"{fmt} needs the input width to be a multiple of {group}"
        self.in_features, self.out_features, self.fmt, self.group = in_features, out_features, fmt, group
        add_q4_parameters(self, "weight", (out_features,), in_features, fmt, group, scale_dtype)

    def q4(self) -> Q4Weight:
        return Q4Weight(self.weight, self.weight_scale, q4_extra(self, "weight"), self.fmt, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return q4_linear(x, self.q4())


def add_q4_parameters(
    owner: nn.Module,
    name: str,
    rows: tuple[int, ...],
    inputs: int,
    fmt: str,
    group: int,
    scale_dtype: torch.dtype,
) -> None:
    """Empty 4-bit weight `name` on `owner` ([*rows, inputs] dequantised): codes `name` [*rows,
    inputs/2] uint8, scales `name_scale` [*rows, inputs/G], and `name_bias` (affine4, like the
    scales) or `name_global` [*rows] fp32 (nvfp4)."""
    setattr(owner, name, fp8_parameter(*rows, inputs // 2, dtype=torch.uint8))
    setattr(owner, name + "_scale", fp8_parameter(*rows, inputs // group, dtype=scale_dtype))
    if fmt == "affine4":
        setattr(owner, name + "_bias", fp8_parameter(*rows, inputs // group, dtype=scale_dtype))
    elif fmt == "nvfp4":
        setattr(owner, name + "_global", fp8_parameter(*rows, dtype=torch.float32))


def q4_extra(owner: nn.Module, name: str) -> torch.Tensor | None:
    """The bias (affine4) or row factors (nvfp4) of 4-bit weight `name` on `owner`, else None."""
    return (
        getattr(owner, name + "_bias", None)
        if hasattr(owner, name + "_bias")
        else getattr(owner, name + "_global", None)
    )


def _rows(module: nn.Module) -> tuple[torch.Tensor, ...]:
    """The row-indexed tensors of a Linear (weight), MXFP8Linear (weight, weight_scale) or
    Q4Linear (weight, weight_scale and its bias or row factors)."""
    if isinstance(module, MXFP8Linear):
        return module.weight, module.weight_scale
    if isinstance(module, Q4Linear):
        extra = q4_extra(module, "weight")
        return (module.weight, module.weight_scale) + (() if extra is None else (extra,))
    return (module.weight,)


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """b's rows start where a's end, in one storage."""
    return (
        a.is_contiguous()
        and b.is_contiguous()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.storage_offset() == a.storage_offset() + a.numel()
    )


def pack_rows_(*layers: nn.Module) -> tuple[torch.Tensor, ...] | None:
    """The weights of layers on the same input as one [O1 + O2 + ..., In] tensor (their rows in
    order; with MXFP8, the scales likewise; in 4 bits, one `Q4Weight`), for one product instead
    of several; None when they differ in kind or width.

    Their tensors move into one buffer and their parameters become views of it, so loading,
    state dicts and the unpacked path see the same tensors as before, and a weight copied in
    place shows in the packed one. A parameter replaced or moved afterwards is not: pack again
    (`MiniMaxM3.prepare_`).
    """
    first = layers[0]
    if (
        len(layers) < 2
        or any(type(m) is not type(first) for m in layers)
        or not isinstance(first, nn.Linear | MXFP8Linear | Q4Linear)
        or any(getattr(m, "bias", None) is not None for m in layers)
        or any(
            (getattr(m, "fmt", None), getattr(m, "group", None))
            != (getattr(first, "fmt", None), getattr(first, "group", None))
            for m in layers
        )
    ):
        return None
    groups = list(zip(*(_rows(m) for m in layers), strict=True))  # per tensor kind: one per layer
    if any(t.shape[1:] != g[0].shape[1:] or t.dtype != g[0].dtype for g in groups for t in g):
        return None
    for g in groups:
        if not all(_follows(a, b) for a, b in itertools.pairwise(g)):
            whole = torch.cat([t.data for t in g])
            for t, part in zip(g, whole.split([t.shape[0] for t in g]), strict=True):
                t.data = part
    packed = tuple(
        g[0].detach().as_strided((sum(t.shape[0] for t in g), *g[0].shape[1:]), g[0].stride()) for g in groups
    )
    if isinstance(first, Q4Linear):  # one 4-bit weight of all the rows
        packed = (
            Q4Weight(packed[0], packed[1], packed[2] if len(packed) == 3 else None, first.fmt, first.group),
        )
    return packed


def packed_linear(x: torch.Tensor, packed: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x [..., In] @ the `pack_rows_` weight .T -> [..., O1 + O2 + ...] (bf16/fp32, MXFP8 or 4-bit)."""
    flat = x.reshape(-1, x.shape[-1])
    # MXFP8: values [O, In] e4m3 and scales [O, In/32]; 4 bits: one Q4Weight; else one weight [O, In]
    if isinstance(packed[0], Q4Weight):
        y = q4_linear(flat, packed[0])
    else:
        y = mxfp8_linear(flat, *packed) if len(packed) == 2 else nn.functional.linear(flat, packed[0])
    return y.view(*x.shape[:-1], -1)


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
