"""The 8k prefill back to back against the same step after a pause, with the SM clock and power
(GPU): how much of a step's time the power limit sets.

    python3 benchmarks/profile/prefill_power.py [--layers 4] [--length 8192] [--rounds 3]
    python3 benchmarks/profile/prefill_power.py --kernels
    python3 benchmarks/profile/prefill_power.py --heat 60,120,240
    TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/profile/prefill_power.py --protocols
    ncu ... --profile-from-start off python3 benchmarks/profile/prefill_power.py --one-step

`m3lm bench` times steps back to back (each case after half a second of the same steps), as a
server busy with prefills would run them. Each round here times ten steps back to back, then ten
steps each after a pause of 0.1 s and of 0.5 s with the GPU idle, and prints the median, the
median SM clock and the highest power nvidia-smi saw in each phase, and the share of its samples
with the software power cap as a clock event. `--kernels` instead records the kernels of ten
steps back to back and of ten steps each after a pause of 0.3 s (PyTorch's profiler, CUPTI
timestamps) and prints each kind's device time per step in both, to show which kernels the
power cap slows. `--heat S1,S2,..` times the step (median of ten after half a second of
steps) and the captured batch-1 decode step at context 4096 with its embedding + norm +
lm_head part (memory-bound, far below the power limit), first on the GPU as it starts, then
after S1, S2, .. seconds more of steps back to back, with the GPU's temperature, mean power and
SM clock (`m3lm.bench.gpu_meter`): whether a warm GPU runs them slower. `--protocols` times the step
as `m3lm bench` did before its warm-up left out the compiling calls (first in the process: with
an empty Triton cache, its steps follow the compilation's idle GPU), as the bench does now,
after 20 s back to back, and one step at a time after 0.5 and 2 s idle. `--one-step` runs one
step between cudaProfilerStart / Stop after warm-up (for Nsight Compute) and exits.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import time

import torch
from torch.profiler import ProfilerActivity, profile

from m3lm.bench.gpu_meter import GpuMeter
from m3lm.bench.run import bench_decode
from m3lm.bench.slice import build_slice, prefill_step
from m3lm.bench.timing import PREFILL_SECONDS, WARMUP_S, event_ms, measure
from m3lm.bench.timing import rested_ms as rested

SMI = [
    "nvidia-smi",
    "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.sw_power_cap",
    "--format=csv,noheader,nounits",
    "-lms",
    "50",
]


def phase(step, pause: float) -> str:
    """Ten steps, each after `pause` seconds idle (0: back to back), under nvidia-smi."""
    smi = subprocess.Popen(SMI, stdout=subprocess.PIPE, text=True)
    times = []
    for _ in range(10):
        if pause:
            torch.cuda.synchronize()
            time.sleep(pause)
        times.append(event_ms(step))
    smi.terminate()
    samples = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 2]
    busy = [s for s in samples if float(s[1]) > 250]  # samples while a step ran, not the pauses
    clock = statistics.median(float(s[0]) for s in busy) if busy else float("nan")
    watts = max((float(s[1]) for s in busy), default=float("nan"))
    capped = sum(s[2].strip() == "Active" for s in busy) / max(1, len(busy))
    return (
        f"median {statistics.median(times):.2f} ms (min {min(times):.2f}, max {max(times):.2f}); "
        f"SM clock {clock:.0f} MHz, power up to {watts:.0f} W, power cap in {capped:.0%} of {len(busy)} samples"
    )


KINDS = [  # (kind, pattern of the kernel names), first match wins
    ("MoE GEMMs", r"_moe_gate_up_kernel|_moe_gemm_kernel"),
    ("cuBLAS products", r"nvjet|gemm|cutlass"),
    ("MSA attention", r"_prefill_kernel"),
    ("dense attention (cuDNN)", r"cudnn|flash"),
    ("the rest", r""),
]


def kernels(step, pause: float, steps: int = 10) -> dict[str, float]:
    """Device ms per step of each kind of kernel over `steps` steps, each after `pause` s idle."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if pause:
                torch.cuda.synchronize()
                time.sleep(pause)
            step()
        torch.cuda.synchronize()
    out = dict.fromkeys([k for k, _ in KINDS], 0.0)
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            kind = next(k for k, pat in KINDS if re.search(pat, e.key))
            out[kind] += e.device_time_total / 1e3 / steps
    return out


def kernel_table(step) -> None:
    t0 = time.time()
    while time.time() - t0 < 2:  # back to back again first: the clock settles under the power cap
        step()
    busy, rested = kernels(step, 0.0), kernels(step, 0.3)
    print("| kernels | back to back, ms a step | after 0.3 s idle | ratio |\n|---|---|---|---|")
    for kind in busy:
        print(
            f"| {kind} | {busy[kind]:.2f} | {rested[kind]:.2f} | {busy[kind] / max(rested[kind], 1e-9):.2f} |"
        )
    b, r = sum(busy.values()), sum(rested.values())
    print(f"| all | {b:.2f} | {r:.2f} | {b / r:.2f} |", flush=True)


def heat(model, step, soaks: list[float]) -> None:
    """The step and the decode step, cold and after each soak of steps back to back."""
    soaked = 0.0
    for soak in [0.0, *soaks]:
        t0 = time.time()
        while time.time() - t0 < soak:
            step()
        torch.cuda.synchronize()
        soaked += soak
        ms, gpu = measure(step, 10, gpu=True)
        dec = bench_decode(model, 1, 4096, 10)
        print(
            f"after {soaked:.0f} s of steps: prefill {ms:.2f} ms ({gpu}); decode B=1 ctx=4096 "
            f"{dec.ms:.3f} ms, embedding+norm+lm_head {dec.parts['head']:.3f} ms ({dec.gpu})",
            flush=True,
        )


def counted_warmup(step, iters: int = 3) -> str:
    """The bench's timing before its warm-up left out the first calls: WARMUP_S or three calls,
    whichever lasts longer, the compiling calls counted, then the median of `iters`."""
    start, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - start < WARMUP_S:
        step()
        calls += 1
        if calls % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    warm = time.perf_counter() - start
    times = [event_ms(step) for _ in range(iters)]
    return f"{statistics.median(times):.2f} ms (steps {', '.join(f'{t:.2f}' for t in times)}; warm-up {calls} calls in {warm:.1f} s)"


def protocols(step) -> None:
    meter = GpuMeter.open()
    print(f"warm-up counting the compiling calls, first in the process: {counted_warmup(step)}", flush=True)
    time.sleep(5)
    print(f"the same after 5 s idle: {counted_warmup(step)}", flush=True)
    for iters, seconds in ((3, 0.0), (10, 0.0), (3, PREFILL_SECONDS)):
        time.sleep(5)
        ms, gpu = measure(step, iters, gpu=True, seconds=seconds)
        print(
            f"after 5 s idle, the bench's warm-up, then {iters} steps over >= {seconds} s: {ms:.2f} ms ({gpu})",
            flush=True,
        )
    t0 = time.time()
    while time.time() - t0 < 20:
        step()
    ms, gpu = measure(step, 10, gpu=True)
    print(f"after 20 s back to back, the bench's warm-up, then 10 steps: {ms:.2f} ms ({gpu})", flush=True)
    for pause in (0.5, 2.0):
        print(
            f"one step at a time after {pause} s idle: {rested(step, 5, pause):.2f} ms (median of 5)",
            flush=True,
        )
    print(f"{meter.temperature_c()} C at the end" if meter else "", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--one-step", action="store_true")
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--heat", type=lambda v: [float(x) for x in v.split(",")], default=None)
    p.add_argument("--protocols", action="store_true")
    args = p.parse_args()
    model = build_slice(args.layers)
    step = prefill_step(model, args.length)
    if args.heat is not None:
        heat(model, step, args.heat)
        return
    if args.protocols:
        protocols(step)
        return
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if args.one_step:
        torch.cuda.profiler.start()
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    t0 = time.time()
    while time.time() - t0 < 3:  # the clock that steps back to back settle at
        step()
    for r in range(args.rounds):
        if args.kernels:
            kernel_table(step)
            continue
        for pause in (0.0, 0.5, 0.1):
            print(f"round {r}, pause {pause:.1f} s: {phase(step, pause)}", flush=True)


if __name__ == "__main__":
    main()
