"""Tile choices for the weight-only FP8 kernels at the release's decode shapes (GPU).

Dense: for T = 1, 4, 16, 64 rows and each projection's weight [O, In], times `mxfp8_matmul`
under every configuration of each kernel variant ("gemv" on the CUDA cores and "gemv_tc" on the
tensor cores for T <= 16, "tile" for any T) and prints each variant's best with the bandwidth it
reaches over the weight bytes (fp8 + scales), beside the current default, the tile kernel's
earlier decode choice ("before") and the bf16 product (cuBLAS) on the same shape. For the gate/up
shapes, the packed gate+up weight with act="swiglu" (one launch) under the default too.
MoE: 1, 16 and 64 tokens, 128 experts [3072, 6144] gate/up and [6144, 3072] down, top 4: the
fused fp8 gate/up + SwiGLU and the fp8 down GEMM under a grid of tiles, against the bf16
`moe_triton` kernels under their tuned tiles.

Dense times are `triton.testing.do_bench` medians with the L2 flushed before each call (as in a
decode step, where every layer's weights arrive cold); they include each launch's own overhead,
which a CUDA graph removes, so small kernels read slower here than in the decode step. MoE times
are per call inside a CUDA graph of calls on different routings (`graph_us`). The winners go into
`m3lm/kernels/fp8_triton.py` (GEMV_TILES, GEMV_MIN_BN, GEMV_PROGRAMS_PER_SM) and
`m3lm/kernels/moe_fp8_triton.py::tiles`.

Run: `python3 benchmarks/tune/fp8_configs.py [--out FILE] [--dry-run]`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch
import triton

from m3lm.bench import report
from m3lm.bench.timing import graph_ms
from m3lm.kernels.fp8_triton import GEMV_MAX_T, Config, matmul_config, mxfp8_matmul

SHAPES = {  # name: weight [O, In]
    "q_proj": (8192, 6144),
    "k/v_proj": (512, 6144),
    "o_proj": (6144, 8192),
    "dense gate/up": (12288, 6144),
    "dense down": (6144, 12288),
    "shared gate/up": (3072, 6144),
    "shared down": (6144, 3072),
}
TOKENS = (1, 4, 16, 64)
EXPERTS, HIDDEN, WIDTH, TOP_K = 128, 6144, 3072, 4
MOE_TOKENS = (1, 16, 64)
MOE_SETS = 8  # routings per timed graph
MOE_TILES = [  # (BN, BK, warps, stages, swap), BLOCK_M 16
    (bn, bk, 4, stages, swap)
    for bn, bk, stages, swap in itertools.product((16, 32, 64, 128), (128, 256, 512), (3, 4), (False, True))
]


def dense_grid(t: int) -> dict[str, list[Config]]:
    """The configurations tried at T rows, per kernel variant (at most 24 each)."""
    if t > GEMV_MAX_T:
        space = itertools.product((16, 32, 64), (64, 128), (128, 256), (3, 4))
        return {"tile": [Config("tile", bn, bk, 4, st, bm) for bm, bn, bk, st in space]}
    tc = itertools.product((16, 32, 64), (128, 256, 512), (3, 4))
    # On the CUDA cores each weight costs T multiply-adds: beyond a few rows only narrow tiles,
    # for the shapes with too few outputs to fill the GPU with 16-row tensor-core tiles.
    if t <= 4:
        cuda = itertools.product((4, 8, 16, 32), (256, 512, 1024), (2, 4))
    else:
        cuda = itertools.product((2, 4, 8), (512, 1024), (3,))
    return {
        "gemv_tc": [Config("gemv_tc", bn, bk, 4, st) for bn, bk, st in tc],
        "gemv": [Config("gemv", bn, bk, 8 if bn * bk >= 16384 else 4, st) for bn, bk, st in cuda],
    }


def before(t: int, o: int, kdim: int, sms: int) -> Config:
    """The tile kernel's decode choice before the GEMV kernel: BM 16, BN 64..16, BK 256."""
    bn = 64
    while bn > 16 and -(-o // bn) < 2 * sms:
        bn //= 2
    return Config("tile", bn, min(256, triton.next_power_of_2(kdim)), 4, 4, bm=16)


def timed(fn) -> float | None:
    """Median ms of fn, None when the configuration does not compile or launch (resources)."""
    try:
        return triton.testing.do_bench(fn, warmup=3, rep=15, return_mode="median")
    except Exception:
        return None


def mxfp8(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 values and E8M0 exponents near 2^-5 (bytes are what matter, not values)."""
    q = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.5).to(torch.float8_e4m3fn)
    return q, torch.randint(120, 124, (*shape[:-1], shape[-1] // 32), device="cuda", dtype=torch.uint8)


def bf16_weight(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)


def rate(ms: float | None, nbytes: float) -> str:
    """'12.3 us (4.10 TB/s)' over nbytes, or 'failed'."""
    return "failed" if ms is None else f"{ms * 1e3:6.1f} us ({nbytes / ms / 1e9:4.2f} TB/s)"


def dense(log: Log, sms: int, rows=TOKENS) -> None:
    for t in rows:
        x = torch.randn(t, max(k for _, k in SHAPES.values()), device="cuda", dtype=torch.bfloat16)
        for name, (o, kdim) in SHAPES.items():
            q, s = mxfp8(o, kdim)
            xk = x[:, :kdim].contiguous()
            nbytes = o * kdim * (1 + 1 / 32)  # fp8 values + E8M0 exponents
            w16 = bf16_weight(o, kdim)
            cublas = timed(functools.partial(torch.nn.functional.linear, xk, w16))
            del w16
            default = matmul_config(t, o, kdim, sms)
            run = functools.partial(mxfp8_matmul, xk, q, s)
            log(
                f"T={t:2d} {name:14s} [{o:5d}, {kdim:5d}]: bf16 cuBLAS {rate(cublas, 2 * o * kdim)}; "
                f"fp8 default {default} {rate(timed(functools.partial(run, default)), nbytes)}; "
                f"before {rate(timed(functools.partial(run, before(t, o, kdim, sms))), nbytes)}"
            )
            for variant, configs in dense_grid(t).items():
                ok = sorted((ms, c) for c in configs if (ms := timed(functools.partial(run, c))) is not None)
                if not ok:
                    log(f"    {variant:7s}: no configuration ran")
                    continue
                (ms, cfg), others = ok[0], ", ".join(f"{m * 1e3:.1f}" for m, _ in ok[1:4])
                log(
                    f"    {variant:7s}: best {cfg} {rate(ms, nbytes)}; next {others} us; {len(ok)} of {len(configs)} ran"
                )
            if "gate/up" in name:  # gate and up packed: one launch writes swiglu(gate, up)
                q2, s2 = mxfp8(2 * o, kdim)
                ms = timed(functools.partial(mxfp8_matmul, xk, q2, s2, act="swiglu"))
                log(
                    f"    packed gate+up, act=swiglu, {matmul_config(t, o, kdim, sms, act=True)}: {rate(ms, 2 * nbytes)}"
                )
                del q2, s2
            del q, s


def graph_us(fns: list) -> float | None:
    """Median us per call of fns captured back to back in one CUDA graph (as a decode step runs
    them: no launch overhead between kernels), None when a configuration does not compile."""
    try:
        return graph_ms(lambda: [fn() for fn in fns], 20) * 1e3 / len(fns)
    except Exception:
        return None


def moe(log: Log) -> None:
    """Each configuration timed over MOE_SETS routings in one graph: every call reads other
    experts, so the weights come from HBM as in a decode step."""
    from m3lm.kernels import moe_fp8_triton as mf
    from m3lm.kernels import moe_triton as mt

    gen = torch.Generator(device="cuda").manual_seed(0)
    w1, s1 = mxfp8(EXPERTS, WIDTH, HIDDEN)
    w3, s3 = mxfp8(EXPERTS, WIDTH, HIDDEN)
    w2, s2 = mxfp8(EXPERTS, HIDDEN, WIDTH)
    b1, b3 = (bf16_weight(EXPERTS, WIDTH, HIDDEN) for _ in range(2))
    b2 = bf16_weight(EXPERTS, HIDDEN, WIDTH)
    for t in MOE_TOKENS:
        m = t * TOP_K
        sets = []
        for _ in range(MOE_SETS):
            ids = torch.stack(
                [torch.randperm(EXPERTS, device="cuda", generator=gen)[:TOP_K] for _ in range(t)]
            )
            x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
            h = torch.randn(m, WIDTH, device="cuda", dtype=torch.bfloat16, generator=gen)
            sets.append((ids, x, h, mt.align(ids, EXPERTS, 16)))
        hit = sum(int(ids.unique().numel()) for ids, *_ in sets) / MOE_SETS
        (up_m, up16), (down_m, down16) = mt.tiles(m, torch.bfloat16)
        bf16 = {
            "gate_up": [functools.partial(mt.gate_up, x, b1, b3, m, TOP_K, mt.align(ids, EXPERTS, up_m), 1.702, 7.0, up_m, up16) for ids, x, _, _ in sets],
            "down": [functools.partial(mt.grouped_gemm, h, b2, m, TOP_K, mt.align(ids, EXPERTS, down_m), True, block_m=down_m, config=down16) for ids, _, h, _ in sets],
        }  # fmt: skip
        fp8 = {
            "gate_up": lambda cfg, m=m, sets=sets: [functools.partial(mf.gate_up_fp8, x, w1, s1, w3, s3, m, TOP_K, al, 1.702, 7.0, 16, cfg) for _, x, _, al in sets],
            "down": lambda cfg, m=m, sets=sets: [functools.partial(mf.grouped_gemm_fp8, h, w2, s2, m, TOP_K, al, True, block_m=16, config=cfg) for _, _, h, al in sets],
        }  # fmt: skip
        for i, (name, mats) in enumerate((("gate_up", 2), ("down", 1))):
            count = mats * hit * WIDTH * HIDDEN  # weights of the touched experts
            default = mf.tiles(m, torch.bfloat16)[i][1]
            ok = sorted((us, cfg) for cfg in MOE_TILES if (us := graph_us(fp8[name](cfg))) is not None)
            best = f"best {ok[0][1]} {rate_us(ok[0][0], count * (1 + 1 / 32))}" if ok else "no tile ran"
            log(
                f"MoE T={t:2d} {name:7s} ({hit:.1f} experts): bf16 {rate_us(graph_us(bf16[name]), 2 * count)}; "
                f"fp8 default {default} {rate_us(graph_us(fp8[name](default)), count * (1 + 1 / 32))}; {best}; "
                f"next {', '.join(f'{us:.1f}' for us, _ in ok[1:4])} us; {len(ok)} of {len(MOE_TILES)} ran"
            )


def rate_us(us: float | None, nbytes: float) -> str:
    return "failed" if us is None else f"{us:6.1f} us ({nbytes / us / 1e6:4.2f} TB/s)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out",
        type=Path,
        help="also write the lines as a dated Markdown section to this file (its latest run)",
    )
    p.add_argument("--dry-run", action="store_true", help="list the shapes and configurations, touch no GPU")
    p.add_argument("--skip-moe", action="store_true")
    p.add_argument("--skip-dense", action="store_true")
    p.add_argument("--rows", type=int, nargs="*", default=list(TOKENS), help="row counts of the dense shapes")
    args = p.parse_args()
    if args.dry_run:
        for t in TOKENS:
            for variant, configs in dense_grid(t).items():
                print(f"T={t}: {variant}: {len(configs)} configurations", *configs, sep="\n  ")
            sizes = ", ".join(f"{n} {matmul_config(t, o, k, 132)}" for n, (o, k) in SHAPES.items())
            print(f"T={t}: defaults at 132 SMs: {sizes}")
        print(f"MoE: {len(MOE_TILES)} tiles", *MOE_TILES, sep="\n  ")
        return
    log = Log()
    props = torch.cuda.get_device_properties(0)
    if not args.skip_dense:
        dense(log, props.multi_processor_count, args.rows)
    if not args.skip_moe:
        moe(log)
    if args.out:
        details = [f"Device: {props.name}, torch {torch.__version__}, triton {triton.__version__}"]
        cmd = "python3 benchmarks/tune/fp8_configs.py " + " ".join(sys.argv[1:])
        body = "```\n" + "\n".join(log.lines) + "\n```"
        report.write_section(args.out, "MXFP8 decode tiles (release dimensions)", cmd, details, body)


if __name__ == "__main__":
    main()
