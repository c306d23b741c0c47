"""Where an 8k prefill of the bench slice spends its wall time, and what the MoE pads (GPU).

    python3 benchmarks/profile/prefill_timeline.py [--length 8192] [--layers 4]

Prints, for one prefill step: the step time from CUDA events beside the host's enqueue time;
from a profiler trace, the kernels' summed time, their span and the idle gaps between them (the
largest named); the SM clock and power sampled by nvidia-smi while the steps ran; and, per MoE
layer, the spread of tokens over experts with the rows the grouped GEMMs compute per useful row
when each expert's group is padded to a BLOCK_M of 16..128 rows, or to 128-row blocks plus a
tail of 64 or 32.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import m3lm.kernels.moe_triton as mt
from m3lm.bench.slice import build_slice, prefill_step


def padding(counts: torch.Tensor) -> str:
    c = counts.double()
    useful = c.sum().item()
    parts = [f"BM={bm}: {(torch.ceil(c / bm) * bm).sum().item() / useful:.3f}" for bm in (16, 32, 64, 128)]
    for tail in (64, 32):
        rows = (c // 128) * 128 + torch.ceil((c % 128) / tail) * tail
        parts.append(f"128+{tail} tail: {rows.sum().item() / useful:.3f}")
    return (
        f"tokens per expert mean {c.mean():.0f} std {c.std():.0f} min {c.min():.0f} max {c.max():.0f}; "
        f"computed / useful rows {', '.join(parts)}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    model = build_slice(args.layers)
    step = prefill_step(model, args.length)

    counts, align = [], mt.align

    def counting_align(pair_ids, n_experts, block_m):
        counts.append(torch.bincount(pair_ids.flatten(), minlength=n_experts).cpu())
        return align(pair_ids, n_experts, block_m)

    mt.align = counting_align
    step()
    mt.align = align
    for i, c in enumerate(counts):
        print(f"MoE layer {i + 1}: {padding(c)}")

    with tempfile.TemporaryDirectory() as tmp:
        smi_log = Path(tmp) / "smi.csv"
        query = [
            "nvidia-smi",
            "--query-gpu=clocks.sm,power.draw",
            "--format=csv,noheader,nounits",
            "-lms",
            "50",
        ]
        with smi_log.open("w") as out:
            smi = subprocess.Popen(query, stdout=out)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            runs = []
            for _ in range(10):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                step()
                t1 = time.perf_counter()
                end.record()
                end.synchronize()
                runs.append((start.elapsed_time(end), 1e3 * (t1 - t0)))
            smi.terminate()
        samples = [line.split(",") for line in smi_log.read_text().splitlines() if line.strip()]
        clocks = sorted(int(float(s[0])) for s in samples)
        power = sorted(float(s[1]) for s in samples)
        print("step ms (CUDA events) / host enqueue ms:", " ".join(f"{a:.1f}/{b:.1f}" for a, b in runs))
        if clocks:
            print(
                f"SM clock {clocks[0]}-{clocks[-1]} MHz (median {clocks[len(clocks) // 2]}), power up to {power[-1]:.0f} W"
            )

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            with record_function("step"):
                step()
            torch.cuda.synchronize()
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    begin = min(e["ts"] for e in events if e.get("name") == "step" and e.get("ph") == "X")
    busy = sum(e["dur"] for e in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    gaps = sorted(
        (
            (b["ts"] - a["ts"] - a["dur"], a["name"][:60], b["name"][:60])
            for a, b in itertools.pairwise(kernels)
        ),
        reverse=True,
    )
    print(
        f"{len(kernels)} kernels: {busy / 1e3:.2f} ms busy over a {span / 1e3:.2f} ms span, first one "
        f"{(kernels[0]['ts'] - begin) / 1e3:.2f} ms after the step began; idle gaps {sum(g for g, _, _ in gaps) / 1e3:.2f} ms"
    )
    for g, before, after in gaps[:5]:
        print(f"  {g:.0f} us between {before} and {after}")


if __name__ == "__main__":
    main()
