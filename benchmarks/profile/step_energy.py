"""Energy of the 8k prefill step and of each kind of work in it, back to back (GPU).

    python3 benchmarks/profile/step_energy.py [--layers 4] [--length 8192] [--rounds 2]

Back to back the step runs at the H200's power limit, so its time is its energy over the
limit's watts, and a kernel gains the step what it saves in joules, not in milliseconds. Each
row calls one piece of the step again and again for `--seconds` (after half a second of the
same calls) and divides the GPU's cumulative energy counter (NVML) by the calls. The pieces
take the inputs that one step gave them: layer 1's MoE (router to combine, and the routed
experts alone), layer 1's block-sparse attention, layer 0's dense attention, and one cuBLAS
product for the joules a TFLOP of dense products costs. The routed experts also run with two
other routings of the same pairs (each token's 4 experts uniformly at random; exactly
T * 4 / E pairs an expert, no padding) and, for comparison, as PyTorch's grouped GEMM chain
(`torch._grouped_mm`, CUTLASS) with the same SwiGLU.
"""

from __future__ import annotations

import argparse

import torch

import m3lm.kernels.msa as msa
import m3lm.kernels.msa_prefill_triton as mp
from m3lm.bench.gpu_meter import GpuMeter
from m3lm.bench.slice import build_slice, prefill_step
from m3lm.bench.timing import per_call
from m3lm.kernels import moe_triton as mt
from m3lm.kernels.moe import SPLIT_ROUTER_MIN_T, route, router_logits


def capture(model, length: int):
    """The step, and the inputs one step gives the pieces timed here."""
    seen = {}
    sparse, dense = mp.msa_prefill_attention, msa.msa_attention_sdpa

    def keep(name, fn):
        def call(*a, **k):
            seen.setdefault(name, (fn, a, k))
            return fn(*a, **k)

        return call

    mp.msa_prefill_attention = keep("sparse", sparse)
    msa.msa_attention_sdpa = keep("dense", dense)
    moe = model.model.layers[1].block_sparse_moe
    hook = moe.register_forward_pre_hook(lambda mod, args: seen.setdefault("moe", args[0].detach().clone()))
    step = prefill_step(model, length)
    try:
        step()
        torch.cuda.synchronize()
    finally:
        hook.remove()
        mp.msa_prefill_attention, msa.msa_attention_sdpa = sparse, dense
    return step, seen


def grouped_mm_experts(x, ids, w13_t, w2, alpha: float, limit: float):
    """The routed experts by `torch._grouped_mm` (w13_t [E, C, 2I], w2 [E, C, I]): rows gathered
    by expert, gate/up, the clamped SwiGLU, down -> [M, C] in expert order."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=w2.shape[0]), 0).to(torch.int32)
    gate_up = torch._grouped_mm(x[order // ids.shape[1]], w13_t, offs=offs).float()  # [M, 2I]
    g, u = gate_up.chunk(2, dim=-1)
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    h = (g * torch.sigmoid(alpha * g) * (u + 1)).to(x.dtype)
    return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=1.5)
    args = p.parse_args()
    meter = GpuMeter.open()
    model = build_slice(args.layers)
    step, seen = capture(model, args.length)
    moe = model.model.layers[1].block_sparse_moe
    ex = moe.experts
    w13_t = torch.cat([ex.w1, ex.w3], dim=1).transpose(1, 2)  # [E, C, 2I], for grouped_mm only
    x = seen["moe"]
    t, n_experts = x.shape[0], ex.w1.shape[0]
    split = moe.router_split if t >= SPLIT_ROUTER_MIN_T else None  # as the model's prefill
    _, ids = route(router_logits(x, moe.gate.weight, split), moe.e_score_correction_bias, 4)
    gen = torch.Generator(device="cuda").manual_seed(0)
    routings = {
        "the step's routing": ids,
        "uniform random routing": torch.rand(t, n_experts, device="cuda", generator=gen).topk(4).indices,
        f"exactly {t * 4 // n_experts} pairs an expert": (
            torch.arange(t * 4, device="cuda") % n_experts
        ).view(t, 4),
    }
    w = torch.randn(4 * 6144, 6144, device="cuda", dtype=torch.bfloat16, generator=gen)
    a = torch.randn(args.length, 6144, device="cuda", dtype=torch.bfloat16, generator=gen)
    tflop = 2 * a.shape[0] * w.shape[0] * w.shape[1] / 1e12
    pieces = [
        (f"{args.length}-token step ({args.layers} layers)", step),
        ("MoE layer (router .. combine, shared expert)", lambda: moe(x)),
    ]
    for name, r in routings.items():
        pieces.append((f"routed experts, {name} (Triton)", lambda r=r: mt.moe_pairs(x, r, ex.w1, ex.w3, ex.w2, moe.alpha, moe.limit)))  # fmt: skip
        pieces.append((f"routed experts, {name} (grouped_mm)", lambda r=r: grouped_mm_experts(x, r, w13_t, ex.w2, moe.alpha, moe.limit)))  # fmt: skip
    for key, name in (
        ("sparse", "block-sparse attention, one layer"),
        ("dense", "dense attention (layer 0)"),
    ):
        if key in seen:
            fn, fa, fk = seen[key]
            pieces.append((name, lambda fn=fn, fa=fa, fk=fk: fn(*fa, **fk)))
    pieces.append((f"cuBLAS product, {tflop:.2f} TFLOP", lambda: a @ w.T))
    print("| round | piece | ms a call | J a call | W |\n|---|---|---|---|---|", flush=True)
    for r in range(args.rounds):
        for name, piece in pieces:
            ms, j, watts = per_call(meter, piece, args.seconds)
            extra = f" ({j / tflop:.2f} J a TFLOP)" if name.startswith("cuBLAS") else ""
            print(f"| {r} | {name} | {ms:.3f} | {j:.3f}{extra} | {watts:.0f} |", flush=True)


if __name__ == "__main__":
    main()
