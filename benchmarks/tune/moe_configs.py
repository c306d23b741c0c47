"""Tile sizes for the fused MoE on the release's dimensions (GPU).

For several token counts, times the fused gate/up + SwiGLU kernel (N = I, K = C) and the down
GEMM (N = C, K = I) under each tile configuration and BLOCK_M, and prints the best, with the
bandwidth it reaches on the expert weights it must read and its arithmetic rate. The winners
go into `moe_triton.tiles`. Run: `python3 benchmarks/tune/moe_configs.py [T ...]`.
"""

from __future__ import annotations

import functools
import itertools
import sys

import torch
import triton

from m3lm.kernels.moe_triton import align, gate_up, grouped_gemm

SPACE = {  # T: (BLOCK_M choices, BN, BK, warps, stages, GROUP_M)
    1: ((16,), (64, 128), (128, 256), (4,), (3, 4), (8,)),
    64: ((16,), (64, 128), (128, 256), (4,), (3,), (8,)),
    8192: ((64, 128), (128, 256), (64,), (8,), (3, 4), (1, 8, 32)),
}


def main() -> None:
    only = {int(t) for t in sys.argv[1:]}  # token counts to sweep (default: all)
    e, c, i, a = 128, 6144, 3072, 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1, w3 = (
        torch.randn(e, i, c, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(2)
    )
    w2 = torch.randn(e, c, i, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    for t, (block_ms, *space) in SPACE.items():
        if only and t not in only:
            continue
        ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:a] for _ in range(t)])
        x = torch.randn(t, c, device="cuda", dtype=torch.bfloat16, generator=gen)
        h = torch.randn(t * a, i, device="cuda", dtype=torch.bfloat16, generator=gen)
        hit = int(ids.unique().numel())
        for name, gbytes, flops in (("gate_up", 2 * hit * i * c * 2, 2 * 2 * t * a * i * c), ("down", hit * c * i * 2, 2 * t * a * i * c)):  # fmt: skip
            best = None
            for block_m, cfg in itertools.product(block_ms, itertools.product(*space)):
                aligned = align(ids, e, block_m)
                if name == "gate_up":
                    call = functools.partial(gate_up, x, w1, w3, t * a, a, aligned, 1.702, 7.0, block_m, cfg)
                else:
                    call = functools.partial(
                        grouped_gemm, h, w2, t * a, a, aligned, True, block_m=block_m, config=cfg
                    )
                try:
                    ms = triton.testing.do_bench(call, warmup=5, rep=20, return_mode="median")
                except Exception:  # a configuration the compiler rejects (resources)
                    continue
                if best is None or ms < best[0]:
                    best = (ms, block_m, cfg)
            ms, block_m, cfg = best
            print(
                f"T={t:5d} {name:7s}: best BLOCK_M={block_m} {cfg} {ms * 1e3:8.1f} us, "
                f"{gbytes / ms / 1e9:5.2f} TB/s over {hit} experts, {flops / ms / 1e9:5.0f} TFLOP/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
