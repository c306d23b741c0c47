"""Tile sizes for the fused-MoE grouped GEMM on the release's dimensions (GPU).

For several token counts, times the gate/up GEMM (N = I, K = C) and the down GEMM (N = C, K = I)
under each tile configuration and prints the best, with the bandwidth it reaches on the expert
weights it must read. Run: `PYTHONPATH=. python3 benchmarks/moe_configs.py`.
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton

from m3lm.kernels.moe_triton import _gemm, align


def main() -> None:
    e, c, i, a = 128, 6144, 3072, 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_up = torch.randn(e, i, c, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w_down = torch.randn(e, c, i, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    configs = list(itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4)))
    for t in (1, 16, 64, 512, 8192):
        ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:a] for _ in range(t)])
        block_m = 16 if t * a <= 1024 else 64
        aligned = align(ids, e, block_m)
        hit = int(ids.unique().numel())
        for name, w, rows, kdim in (("gate", w_up, torch.randn(t, c, device="cuda", dtype=torch.bfloat16), c),
                                     ("down", w_down, torch.randn(t * a, i, device="cuda", dtype=torch.bfloat16), i)):  # fmt: skip
            best = None
            for cfg in configs:
                if block_m == 64 and cfg[0] < 64:
                    continue
                call = functools.partial(
                    _gemm, rows, w, t * a, a, aligned, name == "down", block_m=block_m, config=cfg
                )
                try:
                    ms = triton.testing.do_bench(call, warmup=5, rep=20, return_mode="median")
                except Exception:  # a configuration the compiler rejects (resources)
                    continue
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            gbytes = hit * w.shape[1] * kdim * 2 / 1e9
            print(
                f"T={t:5d} {name}: best {best[1]} {best[0] * 1e3:8.1f} us, {gbytes / best[0]:7.0f} GB/s over {hit} experts",
                flush=True,
            )


if __name__ == "__main__":
    main()
