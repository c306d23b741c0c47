"""Where the fused MoE loses against cuBLAS at an 8k prefill: the GEMM core, the grouping, or
the padding (GPU, release dimensions).

    PYTHONPATH=. python3 benchmarks/moe_core.py

Times, in one process:

- cuBLAS on dense products of the MoE's shapes (gate and up as one [6144 -> 6144] product, down
  [3072 -> 6144]) at 8192 and 36864 rows (36864: about the rows the grouped GEMMs compute for
  32768 pairs);
- `moe_triton.gate_up` and `grouped_gemm` (the prefill tiles of `tiles`) on 8192 tokens x top 4
  routed three ways: 4 experts of 8192 rows (large groups, no padding), 128 experts of exactly 256
  rows (small groups, no padding), and the routing of layer 1 of the 4-layer bench slice (small,
  skewed groups, padded);
- on the bench slice's routing, each expert's group padded to 64 rows with 32-row last blocks
  against the default 128 with 64-row last blocks, for a few tiles (outputs checked equal).

Rates are on the useful rows (2 x pairs x C x I per product). The results are in
`benchmarks/results/moe_core_h200.md`.
"""

from __future__ import annotations

import torch

from m3lm.bench.run import bench_prefill
from m3lm.bench.slice import build_slice
from m3lm.bench.timing import time_ms
from m3lm.kernels import moe_triton as mt
from m3lm.kernels.moe import route, router_logits

C, WIDTH, E, A, T = 6144, 3072, 128, 4, 8192  # hidden, expert width, experts, top-k, tokens
ALPHA, LIMIT = 1.702, 7.0
ITERS = 20


def cublas() -> None:
    for rows in (T, 36864):
        x = torch.randn(rows, C, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(rows, WIDTH, device="cuda", dtype=torch.bfloat16)
        w13 = (torch.randn(2 * WIDTH, C, device="cuda") * 0.02).to(torch.bfloat16)
        w2 = (torch.randn(C, WIDTH, device="cuda") * 0.02).to(torch.bfloat16)
        up = time_ms(lambda x=x, w=w13: x @ w.T, ITERS)
        down = time_ms(lambda h=h, w=w2: h @ w.T, ITERS)
        flops = 2 * rows * C * 2 * WIDTH, 2 * rows * WIDTH * C
        print(
            f"cuBLAS {rows} rows: gate_up {up:.3f} ms ({flops[0] / up / 1e9:.0f} TFLOP/s), "
            f"down {down:.3f} ms ({flops[1] / down / 1e9:.0f} TFLOP/s)",
            flush=True,
        )


def fused(name, x, ids, w1, w3, w2, align_m=None, tiles=None, ref=None) -> torch.Tensor:
    """Times the gate/up and down kernels for one routing; align_m / tiles override `tiles`'."""
    m = ids.numel()
    (up_m, up_cfg), (down_m, down_cfg) = tiles or mt.tiles(m, x.dtype)
    aligned = mt.align(ids, w1.shape[0], align_m or max(up_m, down_m))
    scale = torch.rand(
        m, device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )  # same for every call

    def gate_up():
        return mt.gate_up(x, w1, w3, m, A, aligned, ALPHA, LIMIT, up_m, up_cfg, halves=True)

    h = gate_up()

    def down():
        return mt.grouped_gemm(
            h, w2, m, A, aligned, True, scale, torch.float32, block_m=down_m, config=down_cfg, halves=True
        )

    out = down()
    t_up, t_down = time_ms(gate_up, ITERS), time_ms(down, ITERS)
    flops = 2 * m * C * WIDTH * 2, 2 * m * WIDTH * C
    counts = torch.bincount(ids.flatten(), minlength=w1.shape[0]).float()
    check = "" if ref is None else f", outputs equal: {torch.equal(out, ref)}"
    print(
        f"{name}: tokens per expert {counts.mean():.0f} +- {counts.std():.0f} "
        f"({counts.min():.0f}..{counts.max():.0f}), align {aligned.sorted_ids.numel() // aligned.block_expert.numel()}, "
        f"gate_up {up_m} {up_cfg}, down {down_m} {down_cfg}: gate_up {t_up:.3f} ms "
        f"({flops[0] / t_up / 1e9:.0f} TFLOP/s), down {t_down:.3f} ms ({flops[1] / t_down / 1e9:.0f}), "
        f"sum {t_up + t_down:.3f} ms{check}",
        flush=True,
    )
    return out


def bench_routing():
    """Layer 1's input and routing in an 8k prefill of the 2-layer bench slice."""
    model = build_slice(2)
    moe = model.model.layers[1].block_sparse_moe
    seen = {}
    moe.register_forward_pre_hook(lambda mod, args: seen.__setitem__("x", args[0].detach().clone()))
    bench_prefill(model, T, 1)
    x = seen["x"]
    logits = router_logits(x, moe.gate.weight, moe._router_split(x))
    _, ids = route(logits, moe.e_score_correction_bias, A)
    return x, ids, moe.experts


def main() -> None:
    torch.manual_seed(0)
    cublas()
    w1, w3 = ((torch.randn(E, WIDTH, C, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(2))
    w2 = (torch.randn(E, C, WIDTH, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(T, C, device="cuda", dtype=torch.bfloat16)
    fused("4 experts x 8192 rows", x, torch.arange(A, device="cuda").repeat(T, 1), w1, w3, w2)
    uniform = (torch.arange(T, device="cuda")[:, None] * A + torch.arange(A, device="cuda")) % E
    fused("128 experts x 256 rows", x, uniform, w1, w3, w2)
    del w1, w3, w2
    x, ids, ex = bench_routing()
    args = (x, ids, ex.w1, ex.w3, ex.w2)
    ref = fused("bench slice layer 1", *args)
    for up in [(128, 64, 4, 4, 8), (256, 64, 8, 3, 8)]:
        for down in [(256, 64, 8, 3, 8), (256, 64, 8, 4, 8)]:
            fused("bench slice layer 1", *args, align_m=64, tiles=((64, up), (64, down)), ref=ref)
    fused("bench slice layer 1 (again)", *args, ref=ref)


if __name__ == "__main__":
    main()
