"""Layers holding their weights quantised: the routed experts in MXFP8 or in 4 bits, and every
module of a model kept as its checkpoint stores it (`keep_as_stored_`), before loading."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from m3lm.kernels.fp8 import MX_BLOCK, quantize_mxfp8
from m3lm.layers.linear import MXFP8Linear, Q4Linear, add_q4_parameters, fp8_parameter, q4_extra, to_mxfp8_

EXPERT_WEIGHTS = ("w1", "w3", "w2")


class Kept(NamedTuple):
    """How one weight stays in memory: "mxfp8", or a 4-bit format of `kernels.q4` with its group
    and scale dtype."""

    fmt: str
    group: int = MX_BLOCK
    scale_dtype: torch.dtype = torch.uint8


def experts_to_mxfp8_(experts: nn.Module, quantize: bool = False) -> None:
    """Hold w1/w3/w2 as e4m3 with E8M0 scales `w*_scale` [E, O, In/32]: empty (to be loaded), or
    quantised from the current weights one expert at a time (`quantize`)."""
    for name in EXPERT_WEIGHTS:
        w = getattr(experts, name)
        if w.shape[-1] % MX_BLOCK or w.dtype == torch.float8_e4m3fn:
            continue
        with torch.device(w.device):
            q = fp8_parameter(*w.shape, dtype=torch.float8_e4m3fn)
            s = fp8_parameter(*w.shape[:-1], w.shape[-1] // MX_BLOCK, dtype=torch.uint8)
        if quantize:
            with torch.no_grad():
                for e in range(w.shape[0]):
                    q[e], s[e] = quantize_mxfp8(w[e])
        setattr(experts, name, q)
        setattr(experts, name + "_scale", s)


def experts_to_q4_(experts: nn.Module, kept: Kept) -> None:
    """Hold w1/w3/w2 in 4 bits as published (`kernels.q4`), empty, to be loaded: codes `w*`
    [E, O, In/2] uint8, scales `w*_scale` [E, O, In/G], and `w*_bias` (affine4) or `w*_global`
    [E, O] fp32 (nvfp4)."""
    experts.q4 = (kept.fmt, kept.group)
    for name in EXPERT_WEIGHTS:
        w = getattr(experts, name)
        with torch.device(w.device):
            add_q4_parameters(experts, name, tuple(w.shape[:-1]), w.shape[-1], *kept)


def keep_as_stored_(model: nn.Module, kept: dict[str, Kept]) -> None:
    """Convert the modules whose weights the checkpoint stores quantised (`kept`: parameter name ->
    how) so that loading keeps them so: a Linear's weight (`<module>.weight`) becomes an
    MXFP8Linear or a Q4Linear; a MoE's routed experts (`<experts>.w1`, `.w3`, `.w2`) change
    together, when all three are kept alike; the others stay float (dequantised at load)."""
    experts: dict[str, set[Kept]] = {}
    for name, how in kept.items():
        owner, _, leaf = name.rpartition(".")
        if leaf in EXPERT_WEIGHTS:
            experts.setdefault(owner, set()).add(how)
            continue
        parent, _, attr = owner.rpartition(".")
        lin = model.get_submodule(owner) if leaf == "weight" else None
        if type(lin) is not nn.Linear or lin.in_features % how.group:
            continue
        with torch.device(lin.weight.device):
            new = (
                MXFP8Linear(lin.in_features, lin.out_features)
                if how.fmt == "mxfp8"
                else Q4Linear(lin.in_features, lin.out_features, *how)
            )
        setattr(model.get_submodule(parent), attr, new)
    for owner, hows in experts.items():
        names = [f"{owner}.{w}" for w in EXPERT_WEIGHTS]
        if len(hows) != 1 or not all(n in kept for n in names):
            continue
        (how,) = hows
        module = model.get_submodule(owner)
        experts_to_mxfp8_(module) if how.fmt == "mxfp8" else experts_to_q4_(module, how)


# What each published 4-bit export holds in 4 bits and in MXFP8 (the rest bf16), as the
# benchmarks build it from a float model: Model Optimizer's NVFP4 exports quantise the experts
# and MLPs; compressed-tensors' MXFP4 ones the routed experts, with MXFP8 around them; MLX's
# affine exports every projection of the decoder layers. Routed experts are 4-bit in all three.
OWNERS = ("self_attn", "mlp", "block_sparse_moe.shared_experts")
Q4_LAYOUTS = {  # format: (owners in 4 bits, owners in MXFP8)
    "nvfp4": (OWNERS[1:], ()),
    "mxfp4": ((), OWNERS),
    "affine4": (OWNERS, ()),
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "index_q_proj", "index_k_proj", "gate_proj", "up_proj",
           "down_proj")  # fmt: skip


@torch.no_grad()
def quantize_q4_(model: nn.Module, fmt: str, group: int = 64) -> nn.Module:
    """Quantise a float model's decoder layers in place to `fmt` as its export holds them
    (`Q4_LAYOUTS`; MLX affine in groups of `group`), one expert at a time (for benchmarks)."""
    from m3lm.kernels.q4 import quantize_q4

    in_q4, in_mxfp8 = Q4_LAYOUTS[fmt]
    for layer in model.model.layers:
        owners = [(p, layer.get_submodule(p)) for p in OWNERS if hasattr(layer, p.split(".")[0])]
        for path, owner in owners:
            if path in in_mxfp8:
                to_mxfp8_(owner, LINEARS, quantize=True)
            for name in LINEARS if path in in_q4 else ():
                lin = getattr(owner, name, None)
                if type(lin) is nn.Linear:
                    w = quantize_q4(lin.weight, fmt, group)
                    with torch.device(lin.weight.device):
                        new = Q4Linear(lin.in_features, lin.out_features, fmt, w.group, w.scale.dtype)
                    _fill(new, "weight", w)
                    setattr(owner, name, new)
        if hasattr(layer, "block_sparse_moe"):
            experts = layer.block_sparse_moe.experts
            w0 = quantize_q4(experts.w1[0], fmt, group)
            old = {n: getattr(experts, n) for n in EXPERT_WEIGHTS}
            experts_to_q4_(experts, Kept(fmt, w0.group, w0.scale.dtype))
            for n, w in old.items():
                for e in range(w.shape[0]):
                    _fill(experts, n, quantize_q4(w[e], fmt, group), e)
                del w
    return model


def _fill(owner: nn.Module, name: str, w, slot: int | None = None) -> None:
    """Copy a `Q4Weight` into `owner`'s kept tensors of weight `name` (at `slot` when stacked)."""
    for t, src in ((getattr(owner, name), w.values), (getattr(owner, name + "_scale"), w.scale),
                   (q4_extra(owner, name), w.extra)):  # fmt: skip
        if src is not None:
            (t if slot is None else t[slot]).copy_(src)
