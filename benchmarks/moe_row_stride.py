"""The routed experts' GEMMs with their weight rows padded (a row stride of K + pad elements
instead of K), in time and energy (GPU, release dimensions).

    PYTHONPATH=. python3 benchmarks/moe_row_stride.py [--pads 0,64,128] [--rounds 3]
    PYTHONPATH=. python3 benchmarks/moe_row_stride.py --step [--pads 0,64,128] [--rounds 3]

At each K step a program reads one 128-byte run from each of BN weight rows; with rows of
6144 values those runs are 12 KB apart (6 KB in down), a stride that may keep landing in the
same memory channels and cache sets. Padding a row by `pad` values changes that stride and
nothing else (the kernels take any row stride). Each row: gate/up and down back to back for a
second, rounds alternating the pads, outputs checked bit for bit; `--step` times the 8k prefill
of the bench slice back to back (`m3lm bench`'s protocol) with its experts' weights re-laid in
place. Results: `benchmarks/results/moe_core_h200.md`, "The experts' weight rows padded" (no
pad helps; the engine keeps unpadded rows).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks.moe_routings import random_experts, spread
from benchmarks.step_energy import per_call
from m3lm.bench.gpu_meter import GpuMeter
from m3lm.bench.slice import build_slice, prefill_step
from m3lm.bench.timing import PREFILL_SECONDS, measure
from m3lm.core import ForwardBatch
from m3lm.kernels import moe_triton as mt

T, A, E, C = 8192, 4, 128, 6144


def padded(w: torch.Tensor, pad: int) -> torch.Tensor:
    """w [E, N, K] copied into rows of K + pad values: a view of shape [E, N, K]."""
    e, n, k = w.shape
    out = torch.empty(e, n, k + pad, device=w.device, dtype=w.dtype)[:, :, :k]
    out.copy_(w)
    return out


def kernels(pads: list[int], seconds: float, rounds: int) -> None:
    meter = GpuMeter.open()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1, w3, w2 = random_experts(gen)
    alpha, limit = 1.702, 7.0
    x = torch.randn(T, C, device="cuda", dtype=torch.bfloat16, generator=gen)
    weights = {pad: tuple(padded(w, pad) for w in (w1, w3, w2)) for pad in pads}
    routings = {
        "uniform random": torch.rand(T, E, device="cuda", generator=gen).topk(A).indices,
        "exactly 256": spread(T, gen),
    }
    for name, ids in routings.items():
        m = T * A
        (up_m, up_cfg), (down_m, down_cfg) = mt.tiles(m, x.dtype)
        aligned = mt.align(ids, E, max(up_m, down_m))
        scale = torch.rand(m, device="cuda", generator=gen)
        h = mt.gate_up(x, w1, w3, m, A, aligned, alpha, limit, up_m, up_cfg)
        y = mt.grouped_gemm(h, w2, m, A, aligned, True, scale, torch.float32, down_m, down_cfg)
        calls = {}
        for pad, (p1, p3, p2) in weights.items():
            up = partial(mt.gate_up, x, p1, p3, m, A, aligned, alpha, limit, up_m, up_cfg)
            down = partial(
                mt.grouped_gemm, h, p2, m, A, aligned, True, scale, torch.float32, down_m, down_cfg
            )
            assert torch.equal(up(), h) and torch.equal(down(), y), pad
            calls[pad] = (up, down)
        for r in range(rounds):
            for pad, (up, down) in calls.items():
                (u_ms, u_j, u_w), (d_ms, d_j, d_w) = (per_call(meter, f, seconds) for f in (up, down))
                print(
                    f"{name} round {r} pad {pad}: gate/up {u_ms:.3f} ms {u_j:.3f} J {u_w:.0f} W | "
                    f"down {d_ms:.3f} ms {d_j:.3f} J {d_w:.0f} W",
                    flush=True,
                )


def step_ab(pads: list[int], rounds: int, layers: int = 4, length: int = 8192) -> None:
    """The prefill step back to back with each pad in turn; the last position's logits must not
    change with the pad."""
    model = build_slice(layers)
    experts = [m.block_sparse_moe.experts for m in model.model.layers if hasattr(m, "block_sparse_moe")]
    step = prefill_step(model, length)
    ids = torch.randint(0, model.args.vocab_size, (length,), device="cuda")
    batch, last = ForwardBatch.full(1, length, "cuda"), torch.tensor([length - 1], device="cuda")
    want = None
    for r in range(rounds):
        for pad in pads:
            for ex in experts:
                for name in ("w1", "w3", "w2"):
                    p = getattr(ex, name)
                    p.data = padded(p.data, pad)
            torch.cuda.empty_cache()
            with torch.inference_mode():
                logits = model.forward_batch(ids, batch, last)  # [1, V]
            want = logits if want is None else want
            assert torch.equal(logits, want), pad
            ms, gpu = measure(step, 10, gpu=True, seconds=PREFILL_SECONDS)
            joules = f", {gpu.watts * ms / 1e3:.1f} J a step" if gpu and gpu.watts else ""
            print(
                f"step round {r} pad {pad}: {ms:.2f} ms ({length / ms * 1e3:,.0f} tok/s){joules}; {gpu}",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pads", type=lambda v: [int(x) for x in v.split(",")], default=[0, 64, 128])
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--step", action="store_true")
    args = p.parse_args()
    if args.step:
        step_ab(args.pads, args.rounds)
    else:
        kernels(args.pads, args.seconds, args.rounds)


if __name__ == "__main__":
    main()
