"""MoE: routing (fp32 router logits, sigmoid scores, a bias that only picks experts, renormalised
weights) and expert dispatch, with `moe`, the one choice between the GPU kernels and the references.

Shapes: T tokens, C hidden, E experts, A active experts per token, I expert width.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from m3lm.kernels.activation import swiglu_oai
from m3lm.kernels.fp8 import dequant_mxfp8
from m3lm.kernels.q4 import Q4Weight, dequant_q4, dequantize_q4

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
    own pass (`RMSNorm(x, residual)`), so the [T, C] output is never written and read again."""

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


def moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    stacked: tuple[torch.Tensor, ...],
    shared: Callable[[torch.Tensor], torch.Tensor],
    alpha: float,
    limit: float,
    scaling: float,
    first: int | None = None,
    shared_fp8: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor | MoEOutput:
    """x [T, C] through its experts (weights, ids [T, A]) and the shared expert -> [T, C], or on
    the GPU's pair path the pairs not yet summed (`MoEOutput`).

    `stacked`: the routed experts as the expert functions take them (w1, w3, w2, or each 8-bit one
    followed by its scales); `first`: under expert parallelism the id of this rank's first expert
    (None: every expert is here). `scaling` (routed_scaling_factor) scales the routed sum only; the
    shared expert enters at 1.0. `shared_fp8`: the shared expert's MXFP8 weights and scales when
    it has a routed expert's shape, so that a decode step runs it in the routed experts' launches.
    """
    q4 = isinstance(stacked[0], Q4Weight)  # 4-bit experts (`kernels.q4`)
    fp8 = (
        not q4 and stacked[0].dtype == torch.float8_e4m3fn
    )  # weight-only FP8 experts (dequantised on the CPU)
    experts = moe_experts_q4 if q4 else moe_experts_mxfp8 if fp8 else moe_experts_ref
    if x.is_cuda and first is None and q4:
        from m3lm.kernels.fp8_triton import DEQUANT_MIN_T
        from m3lm.kernels.moe_fp8_triton import moe_pairs_q4
        from m3lm.kernels.moe_triton import moe_pairs

        if x.shape[0] >= DEQUANT_MIN_T:  # a prefill: the experts dequantised once, then bf16's kernels
            deq = [dequantize_q4(w, x.dtype) for w in stacked]
            return MoEOutput(moe_pairs(x, ids, *deq, alpha, limit), shared(x), scaling, weights)
        return MoEOutput(moe_pairs_q4(x, weights, ids, *stacked, alpha, limit), shared(x), scaling)
    if x.is_cuda and first is None:
        # Triton (imported here so CPU installs need no Triton): the grouped GEMMs leave one
        # output per token-expert pair (bf16: unweighted, rounded as the reference's product;
        # MXFP8: weighted, fp32); one pass weights and sums them, scales, adds the shared
        # expert and casts (`MoEOutput`).
        from m3lm.kernels.moe_fp8_triton import moe_pairs_fp8, pair_path
        from m3lm.kernels.moe_triton import moe_pairs

        shared_fp8 = shared_fp8 if fp8 and pair_path(x.shape[0] * ids.shape[1]) else None
        if shared_fp8 is not None:  # a decode step: the shared expert runs in the routed experts' launches
            pairs, out = moe_pairs_fp8(x, weights, ids, *stacked, alpha, limit, shared=shared_fp8)
            return MoEOutput(pairs, out, scaling)
        if fp8:
            pairs = moe_pairs_fp8(x, weights, ids, *stacked, alpha, limit)  # [T, A, C] fp32
            return MoEOutput(pairs, shared(x), scaling)
        pairs = moe_pairs(x, ids, *stacked, alpha, limit)  # [T, A, C] in x's dtype
        return MoEOutput(pairs, shared(x), scaling, weights)
    if x.is_cuda and not (fp8 or q4):
        from m3lm.kernels.moe_triton import moe_experts as experts
    if first is not None:
        routed = local_experts(experts, x, weights, ids, first, stacked, alpha, limit)
    else:
        routed = experts(x, weights, ids, *stacked, alpha, limit)  # [T, C] fp32
    return (routed * scaling + shared(x).float()).to(x.dtype)


def local_experts(
    experts, x, weights, ids, first: int, stacked: tuple, alpha: float, limit: float
) -> torch.Tensor:
    """Expert parallelism: only the (token, expert) pairs whose expert lives on this rank -> [T, C] fp32.

    `stacked`: the rank's experts first .. first+E/N-1 as `experts` takes them (w1, w3, w2, or each
    8-bit one followed by its scales), leading dim E/N."""
    local = (ids >= first) & (ids < first + stacked[0].shape[0])  # [T, A]
    tok, slot = local.nonzero(as_tuple=True)  # [M]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if tok.numel():
        pair_ids = (ids[tok, slot] - first)[:, None]  # [M, 1]
        y = experts(x[tok], weights[tok, slot][:, None], pair_ids, *stacked, alpha, limit)  # [M, C]
        out.index_add_(0, tok, y)
    return out


def moe_experts_ref(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """sum_a weights[t, a] * expert_{ids[t, a]}(x[t]) -> [T, C], accumulated in fp32.

    x [T, C], weights [T, A] fp32, ids [T, A], w1 (gate) / w3 (up) [E, I, C], w2 (down) [E, C, I].
    Fewer pairs than experts (a decode step): each pair on its own (`experts_by_pair`); else
    each expert once over its tokens (`experts_by_expert`). Inside a compiled graph, where the
    expert ids cannot be read on the host: every pair's weights gathered (`experts_gathered`).
    """
    if torch.compiler.is_compiling():  # a compiled CPU decode step: no host reads in its graph
        return experts_gathered(x, weights, ids, w1, w3, w2, alpha, limit)
    by = experts_by_pair if ids.numel() < w1.shape[0] else experts_by_expert
    return by(x, weights, ids, w1, w3, w2, alpha, limit)


def experts_by_expert(x, weights, ids, w1, w3, w2, alpha: float, limit: float) -> torch.Tensor:
    """`moe_experts_ref` one expert at a time over the tokens that chose it.

    The pairs are sorted by expert once, so each expert's products read a slice of one gathered
    copy of the rows and the activation runs once over every pair; each token's pairs then add
    up in the order of their expert ids.
    """
    t, a = ids.shape
    ids, slot = ids.sort(dim=1)  # [T, A]: each token's experts in id order
    flat = ids.flatten()  # [P = T*A]
    order = flat.argsort(stable=True)  # the pairs grouped by expert
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    xs = x.index_select(0, order // a)  # [P, C]
    ends = list(itertools.accumulate(counts))
    spans = [(e, end - n, end) for e, (n, end) in enumerate(zip(counts, ends, strict=True)) if n]
    h = swiglu_oai(_grouped(xs, w1, spans), _grouped(xs, w3, spans), alpha, limit)  # [P, I]
    y = _grouped(h, w2, spans).float() * weights.gather(1, slot).flatten()[order, None]  # [P, C]
    pairs = y.index_select(0, order.argsort()).view(t, a, -1)  # back in token order: [T, A, C]
    out = pairs[:, 0]
    for j in range(1, a):
        out = out + pairs[:, j]
    return out  # [T, C]


def _grouped(rows: torch.Tensor, w: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """rows [P, In] grouped by expert (spans: expert, first row, end) -> [P, O]: each group's
    rows @ w[e].T, written in place (joined when autograd needs the products)."""
    if torch.is_grad_enabled() and (rows.requires_grad or w.requires_grad):
        return torch.cat([rows[lo:hi] @ w[e].T for e, lo, hi in spans])
    out = rows.new_empty(rows.shape[0], w.shape[1])
    for e, lo, hi in spans:
        torch.mm(rows[lo:hi], w[e].T, out=out[lo:hi])
    return out


def experts_by_pair(x, weights, ids, w1, w3, w2, alpha: float, limit: float) -> torch.Tensor:
    """`moe_experts_ref` one (token, expert) pair at a time: no sort and no gather, for a few
    tokens. Each token's pairs add up in the order of their expert ids, as there."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, C]
    linear = torch.nn.functional.linear
    for t, (row, row_weights) in enumerate(zip(ids.tolist(), weights.tolist(), strict=True)):
        xt = x[t : t + 1]  # [1, C]
        for e, w in sorted(zip(row, row_weights, strict=True)):
            h = swiglu_oai(linear(xt, w1[e]), linear(xt, w3[e]), alpha, limit)  # [1, I]
            out[t] += linear(h, w2[e])[0].float() * w
    return out


def experts_gathered(x, weights, ids, w1, w3, w2, alpha: float, limit: float) -> torch.Tensor:
    """`moe_experts_ref` with each (token, expert) pair's weights gathered on the device: batched
    products over the T*A pairs, no host read of the ids (what a compiled graph can hold)."""
    t, a = ids.shape
    flat = ids.flatten()  # [T*A]
    xp = x.repeat_interleave(a, 0)[:, None, :]  # [T*A, 1, C]
    # Written as products and sums over gathered rows: compiled, one loop reads each pair's
    # weights where they are, with no copy of them.
    gate = (w1[flat] * xp).sum(-1)  # [T*A, I]
    up = (w3[flat] * xp).sum(-1)
    h = swiglu_oai(gate, up, alpha, limit)[:, None, :]  # [T*A, 1, I]
    y = (w2[flat] * h).sum(-1).float()  # [T*A, C]
    return (y.view(t, a, -1) * weights[..., None]).sum(1)  # [T, C]


def moe_experts_mxfp8(x, weights, ids, w1, s1, w3, s3, w2, s2, alpha: float, limit: float) -> torch.Tensor:
    """`moe_experts_ref`'s contract with MXFP8 experts: w1/w3 [E, I, C] + scales [E, I, C/32], w2 [E, C, I]
    + [E, C, I/32]. GPU: weight-only FP8 grouped GEMM; CPU: dequantise, then the reference."""
    if x.is_cuda:
        from m3lm.kernels.moe_fp8_triton import moe_experts_fp8

        return moe_experts_fp8(x, weights, ids, w1, s1, w3, s3, w2, s2, alpha, limit)
    deq = [dequant_mxfp8(w, s, x.dtype) for w, s in ((w1, s1), (w3, s3), (w2, s2))]
    return moe_experts_ref(x, weights, ids, *deq, alpha, limit)


def moe_experts_q4(x, weights, ids, w1: Q4Weight, w3: Q4Weight, w2: Q4Weight, alpha: float, limit: float):
    """`moe_experts_ref`'s contract with 4-bit experts (`kernels.q4`). GPU: the weight-only kernels
    of `moe_fp8_triton`; CPU: the experts the tokens chose, dequantised, then the reference's own
    schedule for this many pairs and experts (so the sums are the dequantised model's)."""
    if x.is_cuda:
        from m3lm.kernels.moe_fp8_triton import moe_pairs_q4

        return moe_pairs_q4(x, weights, ids, w1, w3, w2, alpha, limit).sum(1)
    used, local = ids.unique(sorted=True, return_inverse=True)  # [U], ids as positions in used
    deq = [dequant_q4(w.take(used), x.dtype) for w in (w1, w3, w2)]
    by = experts_by_pair if ids.numel() < w1.values.shape[0] else experts_by_expert
    return by(x, weights, local.view(ids.shape), *deq, alpha, limit)
