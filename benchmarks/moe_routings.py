"""The routed experts' two GEMMs under four routings of the same 8192 x 4 pairs, with and without
the merged short blocks, in time and energy (GPU, release dimensions).

    PYTHONPATH=. python3 benchmarks/moe_routings.py [--seconds 1]
    PYTHONPATH=. python3 benchmarks/moe_routings.py --tails 0,1,16,17,32,33,48,64,65,128

Routings: exactly 256 pairs an expert with the token sets shared by four experts (the
`step_energy.py` control: token t takes experts 4t .. 4t + 3 mod 128), exactly 256 an expert with
each expert's tokens drawn independently (whether shared rows in L2 are what makes that control
cheap), each token's 4 experts uniformly at random (what a balanced router gives: 217-290 pairs
an expert, so about half the experts end in a short block of a few pairs), and layer 1's routing
in the 4-layer bench slice. Each with `moe_triton`'s default tiles, and with the short blocks in
tiles of their own (`tail=0`). Inputs and weights are layer 1's of one 8k step. Each row: ms, J
and W a call of gate/up and of down, back to back (`step_energy.per_call`). Results in
`benchmarks/results/moe_core_h200.md`.

`--tails t1,t2,..`: every expert takes exactly 256 + t pairs (8192 + 32 t random tokens, each
expert's tokens drawn independently; random weights), so that each ends in a short block of t
pairs (t = 128: three whole blocks); gate/up and down per call, and per pair against the first
t given (0 above): what a short block costs against its pairs.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks.moe_gluon_down import layer1_inputs
from benchmarks.step_energy import per_call
from m3lm.bench.gpu_meter import GpuMeter
from m3lm.kernels import moe_triton as mt

T, A, E = 8192, 4, 128


def routings(ids_bench: torch.Tensor) -> dict[str, torch.Tensor]:
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


def random_experts(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 expert stacks of the release's shapes: w1, w3 [E, 3072, 6144], w2 [E, 6144, 3072]."""
    w1, w3 = ((torch.randn(E, 3072, 6144, device="cuda", generator=gen) * 0.02).bfloat16() for _ in range(2))
    w2 = (torch.randn(E, 6144, 3072, device="cuda", generator=gen) * 0.02).bfloat16()
    return w1, w3, w2


def tails(sizes: list[int], w1, w3, w2, alpha, limit, seconds: float) -> None:
    meter = GpuMeter.open()
    gen = torch.Generator(device="cuda").manual_seed(1)
    base = None
    for t in sizes:
        tokens = E // A * (T * A // E + t)
        x = torch.randn(tokens, w1.shape[2], device="cuda", dtype=torch.bfloat16, generator=gen)
        ids = spread(tokens, gen)
        m = tokens * A
        (up_m, up_cfg), (down_m, down_cfg) = mt.tiles(m, x.dtype)
        aligned = mt.align(ids, E, max(up_m, down_m))
        scale = torch.rand(m, device="cuda", generator=gen)
        gate_up = partial(mt.gate_up, x, w1, w3, m, A, aligned, alpha, limit, up_m, up_cfg)
        h = gate_up()
        down_gemm = partial(
            mt.grouped_gemm, h, w2, m, A, aligned, True, scale, torch.float32, block_m=down_m, config=down_cfg
        )
        up, down = per_call(meter, gate_up, seconds), per_call(meter, down_gemm, seconds)
        base = base or (up[0] / m, down[0] / m)
        print(
            f"{T * A // E + t} pairs an expert (short block {t}): gate/up {up[0]:.3f} ms {up[1]:.3f} J, "
            f"{up[0] / m / base[0]:.3f}x a pair | down {down[0]:.3f} ms {down[1]:.3f} J, "
            f"{down[0] / m / base[1]:.3f}x a pair",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--tails", type=lambda v: [int(x) for x in v.split(",")], default=None)
    args = p.parse_args()
    if args.tails is not None:  # random weights of the release's shapes suffice here
        gen = torch.Generator(device="cuda").manual_seed(0)
        tails(args.tails, *random_experts(gen), 1.702, 7.0, args.seconds)
        return
    x, weights, ids_bench, w1, w3, w2, alpha, limit = layer1_inputs()
    meter = GpuMeter.open()
    m = T * A
    (up_m, up_cfg), (down_m, down_cfg) = mt.tiles(m, x.dtype)
    scale = weights.flatten().float().contiguous()
    for name, ids in routings(ids_bench).items():
        aligned = mt.align(ids, E, max(up_m, down_m))
        counts = torch.bincount(ids.flatten(), minlength=E)
        blocks = int(((counts + up_m - 1) // up_m).sum())
        for tail in (None, 0):
            h = mt.gate_up(x, w1, w3, m, A, aligned, alpha, limit, up_m, up_cfg, tail=tail)

            def up(tail=tail, aligned=aligned):
                return mt.gate_up(x, w1, w3, m, A, aligned, alpha, limit, up_m, up_cfg, tail=tail)

            def down(tail=tail, aligned=aligned, h=h):
                return mt.grouped_gemm(
                    h,
                    w2,
                    m,
                    A,
                    aligned,
                    True,
                    scale,
                    torch.float32,
                    block_m=down_m,
                    config=down_cfg,
                    tail=tail,
                )

            (u_ms, u_j, u_w), (d_ms, d_j, d_w) = (per_call(meter, f, args.seconds) for f in (up, down))
            print(
                f"{name} ({int(counts.min())}..{int(counts.max())} pairs an expert, {blocks} blocks of "
                f"{up_m}), short blocks {'merged' if tail is None else 'in tiles of their own'}: "
                f"gate/up {u_ms:.3f} ms {u_j:.3f} J {u_w:.0f} W | down {d_ms:.3f} ms {d_j:.3f} J {d_w:.0f} W",
                flush=True,
            )


if __name__ == "__main__":
    main()
