"""Program shape of the block-sparse prefill attention kernel on the release's dimensions (GPU).

Times `msa_prefill_attention` under each (query rows per program, warps, stages, keys per step)
for the selections `m3lm bench --attention` uses, and prints each case's best. The winner
becomes the kernel's default. Run: `python3 benchmarks/tune/prefill_configs.py [LENGTH:KIND ...]`.
"""

from __future__ import annotations

import itertools
import math
import sys

import torch
import triton

from m3lm.bench.attention import selection
from m3lm.bench.slice import build_slice
from m3lm.kernels.msa_prefill_triton import msa_prefill_attention

CONFIGS = [
    *itertools.product((64,), (4,), (2, 3, 4), (32, 64)),
    (64, 4, 3, 128),
    *itertools.product((128,), (8,), (2, 3), (64, 128)),
    (32, 4, 3, 64),
]


def main() -> None:
    a = build_slice(1).args  # dimensions only
    h, k, d, s = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.index_block_size
    gen = torch.Generator(device="cuda").manual_seed(3)
    cases = ((8192, "random"), (65536, "drift"), (65536, "random"))
    only = sys.argv[1:]  # e.g. 8192:random (default: every case)
    for length, kind in cases:
        if only and f"{length}:{kind}" not in only:
            continue
        q = torch.randn(length, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        kk, vv = (
            torch.randn(length, k, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2)
        )
        pos = torch.arange(length, device="cuda")
        sel = selection(kind, k, length, s, a, gen)
        results = []
        for cfg in CONFIGS:
            try:
                ms = triton.testing.do_bench(
                    lambda: msa_prefill_attention(q, kk, vv, pos, d**-0.5, sel, s, 0, cfg),  # noqa: B023
                    warmup=3,
                    rep=20,
                    return_mode="median",
                )
            except Exception:  # a configuration the compiler rejects (resources)
                continue
            results.append((ms, cfg))
        results.sort()
        shown = ", ".join(f"{c}: {m:.2f} ms" for m, c in results[:4])
        print(f"T={length} {kind}: {shown} (of {len(results)}; {math.ceil(length / s)} blocks)", flush=True)


if __name__ == "__main__":
    main()
