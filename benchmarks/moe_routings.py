"""The routed experts' two GEMMs under four routings of the same 8192 x 4 pairs, with and without
the merged short blocks, in time and energy (GPU, release dimensions).

    PYTHONPATH=. python3 benchmarks/moe_routings.py [--seconds 1]

Routings: exactly 256 pairs an expert with the token sets shared by four experts (the
`step_energy.py` control: token t takes experts 4t .. 4t + 3 mod 128), exactly 256 an expert with
each expert's tokens drawn independently (whether shared rows in L2 are what makes that control
cheap), each token's 4 experts uniformly at random (what a balanced router gives: 217-290 pairs
an expert, so about half the experts end in a short block of a few pairs), and layer 1's routing
in the 4-layer bench slice. Each with `moe_triton`'s default tiles, and with the short blocks in
tiles of their own (`tail=0`). Inputs and weights are layer 1's of one 8k step. Each row: ms, J
and W a call of gate/up and of down, back to back (`step_energy.per_call`). Results in
`benchmarks/results/moe_core_h200.md`.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.moe_gluon_down import layer1_inputs
from benchmarks.step_energy import per_call
from m3lm.gpu_meter import GpuMeter
from m3lm.kernels import moe_triton as mt

T, A, E = 8192, 4, 128


def routings(ids_bench: torch.Tensor) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.arange(T, device="cuda")[:, None]
    shared = (tokens * A + torch.arange(A, device="cuda")) % E
    # column j gives expert 4k + j the 256 tokens whose place in the j-th random permutation is k mod 32
    perms = [torch.randperm(T, device="cuda", generator=gen) for _ in range(A)]
    independent = torch.stack([(A * perms[j] + j) % E for j in range(A)], 1)
    uniform = torch.rand(T, E, device="cuda", generator=gen).topk(A).indices
    return {
        "exactly 256, shared token sets": shared,
        "exactly 256, independent token sets": independent,
        "uniform random": uniform,
        "bench slice layer 1": ids_bench,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=1.0)
    args = p.parse_args()
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
