"""CPU threads for torch, chosen and set in the process that runs the model.

On a CPU, a decode step of a small model is a few small matrix products: more threads only add
the cost of waking them, and on a machine busy with other work each step then waits for a
thread that has no core. OpenMP's default wait policy makes it worse: a waiting thread spins
and takes the core that the thread it waits for needs (benchmarks/cpu/cpu_threads.py measures it).
"""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger("m3lm")

# Below this many parameters a model runs on one thread by default: its products are too small
# for a second thread to pay for its wake-ups (benchmarks/results/cpu_threads.md).
SMALL_MODEL_PARAMS = 100_000_000
MAX_DEFAULT_THREADS = 4  # decode is bound by memory bandwidth, which a few threads use up


def quiet_waits() -> None:
    """Make OpenMP's waiting threads sleep instead of spinning (unless the user chose a policy).

    OpenMP reads the setting when torch loads it, so call this before torch is imported; a
    process started afterwards (the engine process) inherits it."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def cpu_threads(requested: int | None, device_type: str, cores: int, params: int) -> int | None:
    """Threads for torch's CPU kernels, or None to leave torch alone (off the CPU)."""
    if device_type != "cpu":
        return None
    if requested is not None:
        return requested
    return 1 if params < SMALL_MODEL_PARAMS else min(MAX_DEFAULT_THREADS, cores)


def use_threads(model, requested: int | None) -> int | None:
    """Set torch's thread counts for the process that runs `model`; returns the count (None off
    the CPU). Inter-op threads (torch.jit.fork) are never used by m3lm: one is enough."""
    import torch

    first = next(model.parameters(), None)
    device_type = first.device.type if first is not None else "cpu"
    params = sum(p.numel() for p in model.parameters())
    n = cpu_threads(requested, device_type, usable_cores(), params)
    if n is None:
        return None
    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):  # possible only before the first inter-op work
        torch.set_num_interop_threads(1)
    if getattr(model, "_m3lm_threads", None) != n:
        log.info("torch runs on %d CPU thread%s", n, "s" if n > 1 else "")
    model._m3lm_threads = n
    return n


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def library_threads(model) -> int | None:
    """The Python API's policy, applied when an engine is made for `model` (the CLI and the
    server choose when they load): `use_threads`' default once a model, unless the caller chose
    through OMP_NUM_THREADS or MKL_NUM_THREADS (torch's count is then left alone)."""
    if hasattr(model, "_m3lm_threads") or any(os.environ.get(v) for v in THREAD_VARIABLES):
        return None
    return use_threads(model, None)
