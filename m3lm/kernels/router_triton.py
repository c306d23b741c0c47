"""The MoE router on the GPU (Triton), next to `moe.py`'s references: a decode step's fp32 router
logits (`router_gemv`) and the top-k routing (`route`), one launch each.

Shapes: T tokens, C hidden, E experts, A experts per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, n_experts, s_lt,
    A: tl.constexpr, AP: tl.constexpr, EP: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    offs = tl.arange(0, EP)
    ok = offs < n_experts
    score = tl.sigmoid(tl.load(logits_ptr + t * s_lt + offs, mask=ok, other=0.0))
    key = tl.where(ok, score + tl.load(bias_ptr + offs, mask=ok, other=0.0), float("-inf"))
    slots = tl.arange(0, AP)
    ids = tl.zeros([AP], tl.int32)
    weights = tl.zeros([AP], tl.float32)
    for i in range(A):  # the best remaining expert by biased score; ties to the lower id
        best = tl.argmax(key, axis=0, tie_break_left=True).to(tl.int32)
        ids = tl.where(slots == i, best, ids)
        weights = tl.where(slots == i, tl.sum(tl.where(offs == best, score, 0.0), axis=0), weights)
        key = tl.where(offs == best, float("-inf"), key)
    weights = weights / tl.sum(weights, axis=0)
    tl.store(w_ptr + t * A + slots, weights, mask=slots < A)
    tl.store(ids_ptr + t * A + slots, ids.to(tl.int64), mask=slots < A)


def route(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route_ref` in one launch: weights [T, A] fp32, ids [T, A] int64."""
    t, e = router_logits.shape
    logits = router_logits.float().contiguous()
    weights = torch.empty(t, top_k, device=logits.device, dtype=torch.float32)
    ids = torch.empty(t, top_k, device=logits.device, dtype=torch.int64)
    _route_kernel[(t,)](
        logits, bias.float().contiguous(), weights, ids, e, logits.stride(0),
        A=top_k, AP=max(2, triton.next_power_of_2(top_k)), EP=max(16, triton.next_power_of_2(e)),
    )  # fmt: skip
    return weights, ids


@triton.jit
def _router_gemv_kernel(x_ptr, w_ptr, y_ptr, s_xt, s_we, s_yt, C: tl.constexpr, BK: tl.constexpr):
    """y[t, e] = sum_c x[t, c] * w[e, c] in fp32 (x converted exactly), one program per (t, e)."""
    t = tl.program_id(0)
    e = tl.program_id(1)
    offs = tl.arange(0, BK)
    wide = tl.zeros([BK], tl.float32)
    for k0 in range(0, C, BK):
        kk = k0 + offs
        x = tl.load(x_ptr + t * s_xt + kk, mask=kk < C, other=0.0).to(tl.float32)
        wide += x * tl.load(w_ptr + e * s_we + kk, mask=kk < C, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * s_yt + e, tl.sum(wide, axis=0))


ROUTER_GEMV_MAX_T = 8


def router_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`moe.router_logits` for a few tokens (decode): x [T, C] @ weight [E, C].T in fp32 -> [T, E],
    one launch on the CUDA cores (fp32 products, no tf32), instead of a cast and a vendor GEMV."""
    t, c = x.shape
    e = weight.shape[0]
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty(t, e, device=x.device, dtype=torch.float32)
    _router_gemv_kernel[(t, e)](
        x, weight, y, x.stride(0), weight.stride(0), y.stride(0), C=c, BK=min(1024, triton.next_power_of_2(c)),
        num_warps=4,
    )  # fmt: skip
    return y
