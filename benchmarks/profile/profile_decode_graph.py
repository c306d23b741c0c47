"""Kernel timeline of the captured decode step, bf16 and then MXFP8 (GPU).

    python3 benchmarks/profile/profile_decode_graph.py [--batch 1] [--layers 2] [--out-dir DIR]

Builds the bench slice (layer 0 dense, the rest MoE + MSA), captures the decode step as the
engine does (`DecodeGraphs`), times its replay, then profiles three replays and writes, per
weight format, one line per kernel of the middle replay: start (us), idle gap before it, duration
and name (`DIR/decode_bf16.txt`, `DIR/decode_mxfp8.txt`). Inside a graph the gaps are about
0.4 us, so the durations are what a step costs; the MXFP8 pass quantises the same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from m3lm.bench.slice import build_slice, captured_decode, fill_cache
from m3lm.bench.timing import time_ms
from m3lm.cache.kv_cache import KVCache
from m3lm.models.minimax_m3 import keep_mxfp8_


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=Path("."))
    args = p.parse_args()
    model = build_slice(args.layers)
    pages = math.ceil(args.ctx / model.args.index_block_size)
    cache = KVCache(model.args, args.batch * pages + 1, "cuda", torch.bfloat16)
    fill_cache(cache, torch.Generator(device="cuda").manual_seed(1))
    for quant in ("bf16", "mxfp8"):
        if quant == "mxfp8":
            keep_mxfp8_(model, quantize=True).prepare_()
            torch.cuda.empty_cache()
        graphs, graph = captured_decode(model, cache, args.batch, pages, args.ctx)
        ms = time_ms(graph.replay, 20)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text())["traceEvents"]
        kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
        n = len(kernels) // 3
        kernels = kernels[n : 2 * n]  # the middle replay
        busy = sum(e["dur"] for e in kernels)
        span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
        print(
            f"{quant} B={args.batch}: graph step {ms:.3f} ms; {n} kernels, busy {busy / 1e3:.3f} ms, span {span / 1e3:.3f} ms"
        )
        lines, prev = [], kernels[0]["ts"]
        for e in kernels:
            lines.append(
                f"{e['ts'] - kernels[0]['ts']:8.1f} gap {e['ts'] - prev:5.1f} dur {e['dur']:6.1f} {e['name'][:90]}"
            )
            prev = e["ts"] + e["dur"]
        (args.out_dir / f"decode_{quant}.txt").write_text("\n".join(lines) + "\n")
        del graphs


if __name__ == "__main__":
    main()
