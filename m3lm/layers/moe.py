"""MoE routing: fp32 router logits, sigmoid scores, a bias that only picks experts, renormalised weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# From this many tokens (prefill) the GPU computes bf16 activations' router logits as three bf16
# products (`split_bf16`) on the tensor cores; below it the fp32 weight is read once (decode).
SPLIT_ROUTER_MIN_T = 256


def split_bf16(w: torch.Tensor) -> torch.Tensor:
    """fp32 w [...] -> [3, ...] bf16 slices whose fp32 sum is w exactly (the 24-bit significand in
    three 8-bit pieces; bf16 has fp32's exponent range)."""
    hi = w.bfloat16()
    mid = (w - hi.float()).bfloat16()
    lo = (w - hi.float() - mid.float()).bfloat16()
    return torch.stack([hi, mid, lo])


def router_logits(x: torch.Tensor, weight: torch.Tensor, split: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C] @ weight [E, C].T in fp32 -> [T, E] fp32.

    On the GPU, up to ROUTER_GEMV_MAX_T tokens take one Triton launch (`router_gemv`). With
    `split` (= split_bf16(weight)) and bf16 x on the GPU: one bf16 GEMM against the three
    slices with fp32 output, summed. The product of a bf16 input and a bf16 slice is exact in fp32
    and fp32 accumulates, so this is the fp32 product up to the order of summation, on the
    tensor cores instead of fp32 units.
    """
    if x.is_cuda and split is None:
        from m3lm.kernels.router_triton import ROUTER_GEMV_MAX_T, router_gemv

        if x.shape[0] <= ROUTER_GEMV_MAX_T:  # a decode step: one launch reading the fp32 weight once
            return router_gemv(x, weight)
    if split is None or not x.is_cuda or x.dtype != torch.bfloat16:
        return torch.nn.functional.linear(x.float(), weight)
    e = weight.shape[0]
    parts = torch.mm(x, split.view(3 * e, -1).T, out_dtype=torch.float32)  # [T, 3E]
    return parts.view(-1, 3, e).sum(1)


def route(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_ref`; on the GPU one Triton launch."""
    if router_logits.is_cuda:
        from m3lm.kernels.router_triton import route as route_triton

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


@dataclass
class MoEOutput:
    """A MoE layer's output on the GPU before its sum over the pairs: `sum_a w[t, a] * pairs[t, a] *
    scaling + shared[t]`, rounded to shared's dtype. The next residual add and norm sum it in their
    own pass (`add_norm`), so the [T, C] output is never written and read again."""

    pairs: torch.Tensor  # [T, A, C]: bf16 and unweighted, or fp32 and weighted (MXFP8)
    shared: torch.Tensor  # [T, C] the shared expert's output
    scaling: float  # routed_scaling_factor (routed pairs only)
    weights: torch.Tensor | None = None  # [T, A] fp32 when the pairs are unweighted

    def __getitem__(self, rows: torch.Tensor) -> MoEOutput:
        """Only the tokens `rows` [R] (the rows whose logits a prefill needs)."""
        w = None if self.weights is None else self.weights[rows]
        return MoEOutput(self.pairs[rows], self.shared[rows], self.scaling, w)

    def sum(self) -> torch.Tensor:
        """The output [T, C] itself (`fused.moe_combine`)."""
        from m3lm.kernels.fused import moe_combine

        return moe_combine(self.pairs, self.shared, self.scaling, weights=self.weights)

    def add_rms_norm(
        self, h: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`norm.add_rms_norm(h, self.sum(), weight, eps)`, bit for bit, in one pass."""
        from m3lm.kernels.fused import moe_add_rms_norm

        return moe_add_rms_norm(h, self.pairs, self.shared, self.scaling, weight, eps, weights=self.weights)
