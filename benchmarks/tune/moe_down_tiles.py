"""The down GEMM's prefill tile with bf16 per-pair outputs (GPU, release dimensions).

    python3 benchmarks/tune/moe_down_tiles.py [--rounds 3]

The prefill tile of `moe_triton.tiles` (BLOCK_M 128; BN 256, BK 64, 8 warps, 4 stages, GROUP_M
16) was chosen when the down GEMM stored fp32 outputs; since version 17 it stores bf16 ones, a
lighter epilogue. This times the down GEMM on layer 1's routing of one 8k step of the bench slice
under a few tiles, back to back (ms and J a call, rounds alternating), outputs checked bit for
bit against the default tile where the K loop is the same.
"""

from __future__ import annotations

import argparse

import torch

from m3lm.bench.gpu_meter import GpuMeter
from m3lm.bench.inputs import layer1_inputs
from m3lm.bench.timing import per_call
from m3lm.kernels import moe_triton as mt

TILES = {  # (BN, BK, warps, stages, GROUP_M)
    "default (256, 64, 8, 4, 16)": (256, 64, 8, 4, 16),
    "(256, 64, 8, 3, 16)": (256, 64, 8, 3, 16),
    "(128, 64, 8, 4, 16)": (128, 64, 8, 4, 16),
    "(128, 64, 4, 4, 16)": (128, 64, 4, 4, 16),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    x, _, ids, w1, w3, w2, alpha, limit = layer1_inputs()
    t, a = ids.shape
    (up_m, up_cfg), (down_m, _) = mt.tiles(t * a, x.dtype)
    aligned = mt.align(ids, w1.shape[0], max(up_m, down_m))
    h = mt.gate_up(x, w1, w3, t * a, a, aligned, alpha, limit, up_m, up_cfg)
    calls = {
        name: lambda cfg=cfg: mt.grouped_gemm(h, w2, t * a, a, aligned, True, block_m=down_m, config=cfg)
        for name, cfg in TILES.items()
    }
    want = next(iter(calls.values()))()
    for name, fn in calls.items():
        print(f"{name}: outputs bitwise equal to the default: {torch.equal(fn(), want)}", flush=True)
    meter = GpuMeter.open()
    for r in range(args.rounds):
        for name, fn in calls.items():
            ms, j, w = per_call(meter, fn, 1.0)
            print(f"round {r} {name}: {ms:.3f} ms {j:.3f} J {w:.0f} W", flush=True)


if __name__ == "__main__":
    main()
