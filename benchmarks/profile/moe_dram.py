"""What the MoE GEMMs read from DRAM on three routings of the same 8k pairs, for a profiler (GPU).

    ncu --clock-control none --profile-from-start off -k regex:"_moe_(gate_up|gemm)_kernel" \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \\
        python3 benchmarks/profile/moe_dram.py

The routings: layer 1's of the 4-layer bench slice in one 8k step, uniform random (each token's
4 experts at random), and exactly 256 pairs an expert (no short or partial blocks). Each engine
call runs once to compile, then once more between cudaProfilerStart / Stop. The script also
prints, for each routing, how the experts' pairs fall into 128-row blocks: whole blocks, short
last blocks merged into their previous block (`moe_triton._tail`), half-height and partial
tiles, and how many merged blocks have siblings (other whole blocks of their expert, which read
the same weight tiles and run ahead of the longer merged programs). Results in
`benchmarks/results/moe_core_h200.md`.
"""

from __future__ import annotations

import torch

from m3lm.bench.inputs import A, E, layer1_inputs, routings
from m3lm.kernels import moe_triton as mt


def blocks(ids: torch.Tensor, bm: int = 128, tail: int = 64) -> str:
    """Counts of the block kinds in gate/up's launch for ids, as the kernels choose them."""
    counts = torch.bincount(ids.flatten(), minlength=E).tolist()
    whole = merged = with_siblings = halves = partial = 0
    for c in counts:
        n, rest = divmod(c, bm)
        whole += n
        if rest and n and rest <= tail:
            merged += 1
            with_siblings += n >= 2
        elif rest and rest <= bm // 2:
            halves += 1
        elif rest:
            partial += 1
    return (
        f"{min(counts)}..{max(counts)} pairs an expert; {whole} whole blocks, {merged} merged short blocks "
        f"({with_siblings} with siblings), {halves} half-height, {partial} partial"
    )


def main() -> None:
    x, weights, ids_bench, w1, w3, w2, alpha, limit = layer1_inputs()
    t = x.shape[0]
    calls = []
    for name, ids in routings(ids_bench).items():
        print(f"{name}: {blocks(ids)}", flush=True)
        (up_m, up_cfg), (down_m, down_cfg) = mt.tiles(t * A, x.dtype)
        aligned = mt.align(ids, E, max(up_m, down_m))
        scale = weights.flatten().float().contiguous()

        def call(ids=ids, aligned=aligned, scale=scale, up=(up_m, up_cfg), down=(down_m, down_cfg)):
            h = mt.gate_up(x, w1, w3, t * A, A, aligned, alpha, limit, *up)
            mt.grouped_gemm(
                h, w2, t * A, A, aligned, pair_rows=True, scale=scale, out_dtype=torch.float32,
                block_m=down[0], config=down[1],
            )  # fmt: skip

        call()
        calls.append((name, call))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, call in calls:
        call()
        torch.cuda.synchronize()
        print(f"profiled: {name} (gate/up, then down)", flush=True)
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
