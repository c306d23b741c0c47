"""Inputs of the MoE benchmarks: layer 1's MoE of the 4-layer bench slice in one 8k prefill step,
and routings of the same T x A pairs (GPU, release dimensions)."""

from __future__ import annotations

import torch

from m3lm.bench.slice import build_slice, prefill_step
from m3lm.kernels.moe import route, router_logits

T, A, E = 8192, 4, 128  # tokens of the step, experts per token, experts


def layer1_inputs():
    """(x [T, C], weights [T, A], ids [T, A], w1, w3, w2, alpha, limit) of layer 1's MoE in one 8k step."""
    model = build_slice(4)
    moe = model.model.layers[1].block_sparse_moe
    seen = []
    hook = moe.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    try:
        prefill_step(model, T)()
        torch.cuda.synchronize()
    finally:
        hook.remove()
    x = seen[0]
    with torch.inference_mode():
        weights, ids = route(
            router_logits(x, moe.gate.weight, moe.router_split), moe.e_score_correction_bias, A
        )
    ex = moe.experts
    return x, weights, ids, ex.w1, ex.w3, ex.w2, moe.alpha, moe.limit


def routings(ids_bench: torch.Tensor) -> dict[str, torch.Tensor]:
    """ids [T, A] of four routings: exactly T A / E pairs an expert, with the token sets shared
    by A experts or drawn independently; each token's A experts uniformly at random; and
    `ids_bench` (layer 1's routing of the bench slice)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.arange(T, device="cuda")[:, None]
    shared = (tokens * A + torch.arange(A, device="cuda")) % E
    independent = spread(T, gen)
    uniform = torch.rand(T, E, device="cuda", generator=gen).topk(A).indices
    return {
        "exactly 256, shared token sets": shared,
        "exactly 256, independent token sets": independent,
        "uniform random": uniform,
        "bench slice layer 1": ids_bench,
    }


def spread(tokens: int, gen: torch.Generator) -> torch.Tensor:
    """ids [tokens, A]: column j gives expert A k + j the tokens whose place in the j-th random
    permutation is k mod E / A, so every expert takes tokens * A / E pairs."""
    perms = [torch.randperm(tokens, device="cuda", generator=gen) for _ in range(A)]
    return torch.stack([(A * perms[j] + j) % E for j in range(A)], 1)
