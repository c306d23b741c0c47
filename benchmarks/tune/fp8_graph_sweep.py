"""One-row FP8 products timed the way a decode step runs them: inside a CUDA graph, weights cold (GPU).

    python3 benchmarks/tune/fp8_graph_sweep.py [--out FILE] [--skip-dense] [--skip-moe]

Dense: for each projection of the release at batch 1 ([O, In], the gate/up ones packed with
act="swiglu"), a graph of `mxfp8_matmul` calls on enough copies of the weight (about 400 MB) that
none is still in L2 when its turn comes; us per call for the default tile and the best of a grid
of GEMV tiles, beside bf16 cuBLAS timed the same way. MoE: one token's 4 routed experts of 128
(release widths), 8 routings per graph: the aligned tile kernels against `pair_gemv` (one program
per pair), and `pair_gemv` under a grid of gate/up and down tiles. Unlike `fp8_configs.py` (launch
overheads included, L2 flushed by a memset), this is what the captured decode step sees. The
winners go into `m3lm/kernels/fp8_triton.py` (GEMV_TILES, GEMV_PROGRAMS_PER_SM) and
`m3lm/kernels/moe_fp8_triton.py` (PAIR_GEMV_TILES).
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import torch

from m3lm.bench import report
from m3lm.bench.timing import graph_ms
from m3lm.kernels import moe_fp8_triton as mf
from m3lm.kernels.fp8 import quantize_mxfp8
from m3lm.kernels.fp8_triton import Config, matmul_config, mxfp8_matmul
from m3lm.kernels.host import sm_count
from m3lm.kernels.router_triton import route

DENSE = [  # name, weight rows, inputs, act
    ("q|k|v|index q|index k", 9856, 6144, None),
    ("q|k|v (dense layer)", 9216, 6144, None),
    ("o_proj", 6144, 8192, None),
    ("dense gate|up", 24576, 6144, "swiglu"),
    ("dense down", 6144, 12288, None),
    ("shared gate|up", 6144, 6144, "swiglu"),
    ("shared down", 6144, 3072, None),
]
GEMV_GRID = [
    Config("gemv", bn, bk, warps, stages)
    for bn, bk, warps, stages in itertools.product((8, 16, 32), (512, 1024), (4, 8), (3, 4))
]
COLD_BYTES = 400e6


def per_call_us(fn, calls: int) -> float:
    return graph_ms(fn, 20) * 1e3 / calls


def dense_case(say, name: str, o: int, k: int, act: str | None, sms: int) -> None:
    copies = max(2, math.ceil(COLD_BYTES / (o * k)))
    q, s = quantize_mxfp8(torch.randn(o, k, device="cuda") * 0.02)
    weights = [(q.clone(), s.clone()) for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    bf16 = [torch.randn(o, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
    bf_us = per_call_us(lambda: [torch.nn.functional.linear(x, w) for w in bf16], len(bf16))
    mb = o * k * (1 + 1 / 32) / 1e6

    def run(cfg=None):
        for w, sc in weights:
            mxfp8_matmul(x, w, sc, config=cfg, act=act)

    default = matmul_config(1, o // (2 if act else 1), k, sms, act is not None)
    times = sorted((per_call_us(lambda c=c: run(c), copies), c) for c in GEMV_GRID)
    us = per_call_us(run, copies)
    say(
        f"{name} [{o}, {k}]: bf16 {bf_us:.1f} us ({o * k * 2 / bf_us / 1e6:.2f} TB/s); "
        f"fp8 default {default} {us:.1f} us ({mb / us:.2f} TB/s)"
    )
    for t, c in times[:3]:
        say(f"    {t:6.1f} us ({mb / t:.2f} TB/s) {c}")


def dense(say) -> None:
    sms = sm_count(torch.device("cuda"))
    for case in DENSE:
        dense_case(say, *case, sms)
        torch.cuda.empty_cache()


def moe(say) -> None:
    e, c, i, a, sets = 128, 6144, 3072, 4, 8
    torch.manual_seed(0)
    w1, w3 = (quantize_mxfp8(torch.randn(e, i, c, device="cuda") * 0.02) for _ in range(2))
    w2 = quantize_mxfp8(torch.randn(e, c, i, device="cuda") * 0.02)
    x = torch.randn(1, c, device="cuda", dtype=torch.bfloat16)
    routings = [
        route(torch.randn(1, e, device="cuda"), torch.zeros(e, device="cuda"), a) for _ in range(sets)
    ]
    aligned = mf.tiles(a, torch.bfloat16)

    def tiles():
        for wts, ids in routings:
            mf.moe_pairs_fp8(x, wts, ids, *w1, *w3, *w2, 1.702, 7.0, aligned)

    def pairs(up=None, down=None):
        for wts, ids in routings:
            flat = ids.flatten()
            h = mf.pair_gemv(x, flat, *w1, *w3, top_k=a, alpha=1.702, limit=7.0, config=up)
            mf.pair_gemv(
                h, flat, *w2, pair_rows=True, scale=wts.flatten(), out_dtype=torch.float32, config=down
            )

    say(f"MoE T=1, {a} of {e} experts: aligned tiles {per_call_us(tiles, sets):.1f} us per token")
    say(f"MoE T=1: pair_gemv default {mf.PAIR_GEMV_TILES} {per_call_us(pairs, sets):.1f} us per token")
    grid = list(itertools.product((8, 16, 32), (256, 512), (4,), (3, 4)))
    for role in ("up", "down"):
        times = sorted((per_call_us(lambda t=t, r=role: pairs(**{r: t}), sets), t) for t in grid)
        say(f"    {role} best: " + ", ".join(f"{t} {us:.1f} us" for us, t in times[:3]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--skip-dense", action="store_true")
    p.add_argument("--skip-moe", action="store_true")
    args = p.parse_args()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    if not args.skip_dense:
        dense(say)
    if not args.skip_moe:
        moe(say)
    if args.out:
        dev = f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}"
        report.write_section(
            args.out, "MXFP8 decode products in a CUDA graph", "python3 benchmarks/tune/fp8_graph_sweep.py",
            [dev], "```\n" + "\n".join(lines) + "\n```",
        )  # fmt: skip


if __name__ == "__main__":
    main()
