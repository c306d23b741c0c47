"""Energy per useful TFLOP of the routed experts by expert size, and the large experts on cuBLAS
(GPU, release dimensions).

    PYTHONPATH=. python3 benchmarks/moe_expert_sizes.py [--seconds 2]

On the routing of layer 1 of the 4-layer bench slice in one 8k prefill step (as
`moe_gluon_down.py`), back to back (`step_energy.per_call`): `moe_triton.moe_pairs` on every
pair; then, for a few thresholds, the pairs of the experts below the threshold through
`moe_pairs` (their token rows gathered beforehand), the experts at or above it one by one on
cuBLAS (gathered rows, gate and up as one product, `fused.swiglu_packed`, down, weighted into
the pairs' rows), and those same large experts through `moe_pairs` alone. The question: would
the large experts cost fewer joules as dense vendor products than in the fused kernels, so that
the step (bound by energy under the power limit) would gain by splitting them off? Results in
`benchmarks/results/moe_core_h200.md`, taken before version 17, when `moe_pairs` stored its
outputs weighted in fp32 as the cuBLAS path here does (it now stores them unweighted in bf16).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.moe_gluon_down import layer1_inputs
from benchmarks.step_energy import per_call
from m3lm.bench.gpu_meter import GpuMeter
from m3lm.kernels import moe_triton as mt
from m3lm.kernels.fused import swiglu_packed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()
    x, weights, ids, w1, w3, w2, alpha, limit = layer1_inputs()
    t, a = ids.shape
    e, width, c = w1.shape
    meter = GpuMeter.open()
    flat, scale = ids.flatten(), weights.flatten().float()
    token = torch.arange(t * a, device=ids.device) // a  # [M] the token of each pair
    counts = torch.bincount(flat, minlength=e).tolist()
    print("pairs per expert, largest first:", sorted(counts, reverse=True)[:24], flush=True)

    def tflop(pairs: int) -> float:
        return 2 * pairs * 3 * width * c / 1e12

    def line(name: str, pairs: int, fn) -> float:
        with torch.inference_mode():
            ms, joules, watts = per_call(meter, fn, args.seconds)
        print(
            f"  {name}: {ms:.3f} ms {joules:.3f} J {watts:.0f} W ({joules / tflop(pairs):.3f} J per useful TFLOP)"
        )
        return joules

    def fused(pairs: torch.Tensor):  # moe_pairs on a subset of the pairs, one expert a row
        rows, sub_ids = x[token[pairs]].contiguous(), flat[pairs][:, None]
        return lambda: mt.moe_pairs(rows, sub_ids.contiguous(), w1, w3, w2, alpha, limit)

    print("every pair:", flush=True)
    line("moe_pairs", t * a, lambda: mt.moe_pairs(x, ids, w1, w3, w2, alpha, limit))
    for threshold in (1024, 640, 384):
        large = [k for k in range(e) if counts[k] >= threshold]
        is_large = torch.zeros(e, dtype=torch.bool, device=ids.device)
        is_large[large] = True
        big_pairs, rest = is_large[flat].nonzero().flatten(), (~is_large[flat]).nonzero().flatten()
        w13 = {k: torch.cat([w1[k], w3[k]]) for k in large}  # [2I, C]: gate and up as one product
        chosen = {k: (flat == k).nonzero().flatten() for k in large}
        out = torch.empty(t * a, c, device=x.device, dtype=torch.float32)

        def vendor(large=large, w13=w13, chosen=chosen, out=out):
            for k in large:
                pairs = chosen[k]
                h = swiglu_packed(x[token[pairs]] @ w13[k].T, alpha, limit)  # [n, I]
                out[pairs] = (h @ w2[k].T).float() * scale[pairs, None]
            return out

        n = big_pairs.numel()
        print(f">= {threshold} pairs: {len(large)} experts, {n} pairs ({n / (t * a):.0%})", flush=True)
        rest_j = line("the other experts, moe_pairs", t * a - n, fused(rest))
        vendor_j = line("these experts, cuBLAS one by one", n, vendor)
        line("these experts, moe_pairs", n, fused(big_pairs))
        print(f"  split: {rest_j + vendor_j:.3f} J", flush=True)


if __name__ == "__main__":
    main()
