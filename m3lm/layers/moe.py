"""MoE routing: sigmoid scores, a bias that only picks experts, renormalised weights."""

from __future__ import annotations

import torch


def route(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_ref`; on the GPU one Triton launch."""
    if router_logits.is_cuda:
        from m3lm.kernels.moe_triton import route as route_triton

        return route_triton(router_logits, bias, top_k)
    return route_ref(router_logits, bias, top_k)


def route_ref(
    router_logits: torch.Tensor, bias: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose `top_k` experts per token; returns weights [T, A] fp32 and ids [T, A].

    router_logits [T, E] must be fp32. The bias changes which experts are chosen, never their
    weights; exact ties go to the lower expert id (stable sort).
    """
    scores = torch.sigmoid(router_logits.float())  # [T, E]
    order = torch.sort(scores + bias.float(), dim=-1, descending=True, stable=True).indices
    ids = order[:, :top_k]  # [T, A]
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids
