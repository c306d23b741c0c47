"""The routed experts' weights in the k-chunked layout (`moe_triton.chunk_k`) against [E, N, K]:
what the GPU's memory spends on each, and the MoE GEMMs' time and energy (GPU, release dimensions).

    PYTHONPATH=. python3 benchmarks/moe_weight_layout.py [--seconds 1] [--rounds 3]
    PYTHONPATH=. python3 benchmarks/moe_weight_layout.py --step [--layers 4] [--rounds 4]

A program of the grouped GEMMs reads, at each K step, BN x BK weights: in [E, N, K] that is BN
runs of BK values (128 bytes each at BK = 64), 12 KB apart, so each run may open a DRAM row of
its own; in [E, K / 64, N, 64] it is one contiguous run of BN x 128 bytes. The first part reads
one expert stack in the GEMMs' order with no products (GB/s, and joules per GB from NVML's
counter); the second times gate/up and down back to back on two routings of 8192 x 4 pairs
(each token's 4 experts uniformly at random; exactly 256 an expert), alternating the layouts,
and on decode-sized batches. Outputs are checked bit for bit between the layouts. `--step`
times the 8k prefill step of the bench slice back to back as `m3lm bench` does, its experts'
weights converted in place between the layouts every round, with the GPU's energy a step.
Results in `benchmarks/results/moe_core_h200.md`.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import triton
import triton.language as tl

from benchmarks.moe_routings import spread
from benchmarks.step_energy import per_call
from m3lm.bench import PREFILL_SECONDS, _measure, build_slice, prefill_step
from m3lm.core import ForwardBatch
from m3lm.gpu_meter import GpuMeter
from m3lm.kernels import moe_triton as mt
from m3lm.kernels.moe_triton import _w_tile

T, A, E, C, WIDTH = 8192, 4, 128, 6144, 3072


@triton.jit
def _read_kernel(w_ptr, out_ptr, s_we, s_wn, s_wc, N: tl.constexpr, KDIM: tl.constexpr, CH: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """Sum of the BN x KDIM weights of one (expert, column block), read BK at a time as the GEMMs do."""
    e = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros([BK, BN], tl.float32)
    for k0 in range(0, KDIM, BK):
        acc += _w_tile(w_ptr, e, offs_n, k0 + tl.arange(0, BK), s_we, s_wn, s_wc, N, KDIM, CH).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(acc, 1), 0))


def read_all(w: torch.Tensor, out: torch.Tensor) -> None:
    n, kdim, s_we, s_wn, s_wc, ch = mt._weight_dims(w)
    _read_kernel[(w.shape[0], n // 128)](
        w, out, s_we, s_wn, s_wc, n, kdim, ch, 128, 64, num_warps=8, num_stages=4
    )


def tiled_pair(w1: torch.Tensor, w3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`tile_k`'s layout for gate and up, each gate tile next to its up tile: views of one
    [E, N / 64, K / 64, 2, 64, 64] tensor, so that a K step reads one contiguous run of both."""
    both = torch.stack([mt.tile_k(w1), mt.tile_k(w3)], 3)
    return both[:, :, :, 0], both[:, :, :, 1]


def shifted(w: torch.Tensor, by: int = (1 << 19) + 3 * 4096) -> torch.Tensor:
    """A copy of w whose first element sits `by` elements past the start of its allocation."""
    buf = torch.empty(w.numel() + by, device=w.device, dtype=w.dtype)
    out = buf[by:].view(w.shape)
    out.copy_(w)
    return out


def plain(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] from any layout here."""
    if w.dim() == 4:  # [E, K / CH, N, CH]
        e, chunks, n, ch = w.shape
        return w.permute(0, 2, 1, 3).reshape(e, n, chunks * ch).contiguous()
    if w.dim() == 5:  # [E, N / CH, K / CH, CH, CH]
        e, blocks, chunks, ch, _ = w.shape
        return w.permute(0, 1, 3, 2, 4).reshape(e, blocks * ch, chunks * ch).contiguous()
    return w


def up_layouts(w1: torch.Tensor, w3: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {
        "[E, N, K]": (w1, w3),
        "tiled": (mt.tile_k(w1), mt.tile_k(w3)),
        "tiled, up shifted": (mt.tile_k(w1), shifted(mt.tile_k(w3))),
        "tiled pair": tiled_pair(w1, w3),
    }


def down_layouts(w2: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"[E, N, K]": w2, "chunked": mt.chunk_k(w2), "tiled": mt.tile_k(w2)}


STEP_VARIANTS = {  # (gate and up, down) from the plain weights
    "[E, N, K]": (lambda w1, w3: (w1, w3), lambda w2: w2),
    "tiled pair, down tiled": (tiled_pair, mt.tile_k),
    "down tiled": (lambda w1, w3: (w1, w3), mt.tile_k),
}


def step_ab(layers: int, length: int, rounds: int) -> None:
    """The prefill step back to back, the experts' weights in each layout in turn; the last
    position's logits must not change with the layout."""
    model = build_slice(layers)
    experts = [m.block_sparse_moe.experts for m in model.model.layers if hasattr(m, "block_sparse_moe")]
    step = prefill_step(model, length)
    ids = torch.randint(0, model.args.vocab_size, (length,), device="cuda")
    batch, last = ForwardBatch.full(1, length, "cuda"), torch.tensor([length - 1], device="cuda")
    want = None
    for r in range(rounds):
        for lay, (up_layout, down_layout) in STEP_VARIANTS.items():
            for ex in experts:
                w1, w3 = up_layout(plain(ex.w1.data), plain(ex.w3.data))
                ex.w1.data, ex.w3.data, ex.w2.data = w1, w3, down_layout(plain(ex.w2.data))
            torch.cuda.empty_cache()
            with torch.inference_mode():
                logits = model.forward_batch(ids, batch, last)  # [1, V]
            want = logits if want is None else want
            assert torch.equal(logits, want), lay
            ms, gpu = _measure(step, 10, gpu=True, seconds=PREFILL_SECONDS)
            joules = f", {gpu.watts * ms / 1e3:.1f} J a step" if gpu and gpu.watts else ""
            print(
                f"step round {r} {lay}: {ms:.2f} ms ({length / ms * 1e3:,.0f} tok/s){joules}; {gpu}",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-reads", action="store_true", help="skip the reads without products")
    p.add_argument("--step", action="store_true")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--length", type=int, default=8192)
    args = p.parse_args()
    if args.step:
        step_ab(args.layers, args.length, args.rounds)
        return
    meter = GpuMeter.open()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1, w3 = ((torch.randn(E, WIDTH, C, device="cuda", generator=gen) * 0.02).bfloat16() for _ in range(2))
    w2 = (torch.randn(E, C, WIDTH, device="cuda", generator=gen) * 0.02).bfloat16()
    alpha, limit = 1.702, 7.0
    ups, downs = up_layouts(w1, w3), down_layouts(w2)

    out = torch.empty(E * WIDTH // 128, device="cuda")
    gb = w1.numel() * w1.element_size() / 1e9
    for r in range(0 if args.no_reads else args.rounds):
        for name, w in downs.items():
            ms, j, watts = per_call(meter, partial(read_all, w, out), args.seconds)
            print(
                f"read round {r} {name}: {ms:.3f} ms {gb / ms:.2f} TB/s {j / gb * 1e3:.1f} mJ/GB {watts:.0f} W",
                flush=True,
            )

    x = torch.randn(T, C, device="cuda", dtype=torch.bfloat16, generator=gen)
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
        down_of = partial(mt.grouped_gemm, h, m=m, top_k=A, aligned=aligned, pair_rows=True, scale=scale,
                          out_dtype=torch.float32, block_m=down_m, config=down_cfg)  # fmt: skip
        y = down_of(w=w2)
        calls = {}
        for lay, (u1, u3) in ups.items():
            calls[f"gate/up {lay}"] = partial(
                mt.gate_up, x, u1, u3, m, A, aligned, alpha, limit, up_m, up_cfg
            )
            assert torch.equal(calls[f"gate/up {lay}"](), h), lay
        for lay, w in downs.items():
            calls[f"down {lay}"] = partial(down_of, w=w)
            assert torch.equal(calls[f"down {lay}"](), y), lay
        for r in range(args.rounds):
            for lay, f in calls.items():
                ms, j, watts = per_call(meter, f, args.seconds)
                print(f"{name} round {r} {lay}: {ms:.3f} ms {j:.3f} J {watts:.0f} W", flush=True)
        del calls, h, y

    for tokens in (1, 16, 64):
        ids = torch.rand(tokens, E, device="cuda", generator=gen).topk(A).indices
        xd = x[:tokens].contiguous()
        m = tokens * A
        (up_m, up_cfg), (down_m, down_cfg) = mt.tiles(m, x.dtype)
        aligned = mt.align(ids, E, max(up_m, down_m))
        scale = torch.rand(m, device="cuda", generator=gen)
        h = mt.gate_up(xd, w1, w3, m, A, aligned, alpha, limit, up_m, up_cfg)
        row = []
        for lay, (u1, u3) in ups.items():
            up = partial(mt.gate_up, xd, u1, u3, m, A, aligned, alpha, limit, up_m, up_cfg)
            row.append(f"gate/up {lay} {per_call(meter, up, args.seconds / 2)[0] * 1e3:.1f} us")
        for lay, w in downs.items():
            down = partial(mt.grouped_gemm, h, w, m, A, aligned, True, scale, torch.float32, down_m, down_cfg)
            row.append(f"down {lay} {per_call(meter, down, args.seconds / 2)[0] * 1e3:.1f} us")
        print(f"decode T={tokens}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
