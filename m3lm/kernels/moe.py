"""Expert dispatch: run each token through its chosen experts and sum with the routing weights."""

from __future__ import annotations

import torch

from m3lm.kernels.activation import swiglu_oai


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
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, C]
    flat_ids = ids.flatten()  # [T*A]
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=w1.shape[0]).tolist()
    tokens = order // ids.shape[1]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start : start + n]
        tok = tokens[start : start + n]
        start += n
        xe = x[tok]  # [n, C]
        h = swiglu_oai(xe @ w1[e].T, xe @ w3[e].T, alpha, limit)  # [n, I]
        ye = (h @ w2[e].T).float() * weights.flatten()[sel, None]  # [n, C]
        out.index_add_(0, tok, ye)
    return out
