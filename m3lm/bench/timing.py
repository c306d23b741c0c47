"""Timing a GPU call as the benchmarks do: CUDA events, a warm-up that leaves out the compiling
calls, medians, CUDA graph replays, and the GPU's state over the timed calls (`gpu_meter`); and
a CPU twin's call by the wall clock (`wall_ms`)."""

from __future__ import annotations

import time

import torch

from m3lm.bench.gpu_meter import GpuMeter, GpuState

WARMUP_S = 0.5  # each case runs three calls (its kernels compile), then this long before it is timed,
# so that it starts from its own clock and power state, not the one the case before left (a
# prefill drops the SM clock for a while)


PREFILL_SECONDS = 1.0  # prefill steps are timed back to back for at least this long: under the
# power limit the SM clock swings from step to step, and the median of a few steps swings with it


def event_ms(fn) -> float:
    """Milliseconds of one call of `fn` on the GPU, between two CUDA events (waits for the end)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_ms(fn, iters: int) -> float:
    """Median ms of `iters` calls of fn, each between CUDA events, after WARMUP_S of calls."""
    return measure(fn, iters)[0]


def measure(fn, iters: int, gpu: bool = False, seconds: float = 0.0) -> tuple[float, GpuState | None]:
    """`time_ms`'s ms, over at least `iters` timed calls and `seconds`, and with `gpu` the GPU's
    state over the warm-up's last WARMUP_S and the timed calls (`gpu_meter`; None where NVML does
    not answer). The first three calls, which may compile kernels while the GPU idles, are not in
    that window nor in the warm-up's time."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    meter = GpuMeter.open() if gpu else None
    window = meter.window() if meter else None
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < WARMUP_S:
        fn()
        calls += 1
        if calls % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    times, start = [], time.perf_counter()
    while len(times) < iters or time.perf_counter() - start < seconds:
        times.append(event_ms(fn))
    return sorted(times)[len(times) // 2], window.close() if window else None


def wall_ms(fn, iters: int) -> float:
    """Median wall-clock ms of `iters` calls of fn after one (the CPU twins' timer)."""
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def rested_ms(fn, samples: int = 3, pause: float = 0.5) -> float:
    """Median ms of single calls, each after `pause` seconds with the GPU idle."""
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        time.sleep(pause)
        times.append(event_ms(fn))
    return sorted(times)[len(times) // 2]


def graph_ms(fn, iters: int) -> float:
    """Median ms of replaying a CUDA graph of `fn` (captured after two warm-up calls)."""
    from m3lm.engine.cuda_graphs import capture_graph

    return time_ms(capture_graph(fn)[0].replay, iters)


def per_call(meter: GpuMeter, fn, seconds: float) -> tuple[float, float, float]:
    """(ms, J, W) per call of fn, called back to back for `seconds` after 0.5 s of warm-up."""
    t_end = time.time() + 0.5
    while time.time() < t_end:
        fn()
    torch.cuda.synchronize()
    n, e0, t0 = 0, meter.joules(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
        if n % 4 == 0:  # keep the host a few calls ahead at most
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    dt, joules = time.perf_counter() - t0, meter.joules() - e0
    return dt / n * 1e3, joules / n, joules / dt
