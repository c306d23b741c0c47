"""Load for an engine (`load_for_engine`, the one entry): on one device, or over a tensor-parallel
group: N-1 worker processes on this node, or the ranks torchrun made.

Rank 0 loads its shard, runs the engine (and the HTTP server) and sends every step to the
followers; the followers load their shards and mirror the steps (`m3lm.engine.follower`). On one
node rank 0 watches its workers: a worker that exits before it was told to stop ends the whole
program with a clear error instead of leaving rank 0 waiting in a collective. Under torchrun,
torchrun itself tears the group down when a rank fails.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from m3lm.config import LoadSpec
from m3lm.device import under_torchrun
from m3lm.distributed import steps
from m3lm.distributed.parallel import ParallelConfig, init_group
from m3lm.errors import ConfigError
from m3lm.loader import load

log = logging.getLogger("m3lm.distributed")
COLLECTIVE_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str | None, local_rank: int) -> torch.device:
    """The device of a rank: GPU `local_rank` when the device is CUDA, else the CPU."""
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    return dev


def _backend(dev: torch.device) -> str:
    return "nccl" if dev.type == "cuda" else "gloo"


def _cpu_threads(dev: torch.device, ranks_here: int) -> None:
    if dev.type == "cpu":  # the node's cores are shared by its ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))


class Group:
    """Rank 0's handle on the group: stop the followers, and watch the local workers."""

    def __init__(self, pc: ParallelConfig, procs: list):
        self.pc, self.procs = pc, procs
        self._stopping = threading.Event()
        self._reported = False
        self._watcher = threading.Thread(target=self._watch, name="m3lm-tp-watch", daemon=True)
        if procs:
            self._watcher.start()

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None and not self._stopping.is_set():
                    msg = f"tensor-parallel worker rank {rank} exited with code {p.exitcode}; stopping"
                    print(f"m3lm: error: {msg}", file=sys.stderr, flush=True)
                    for q in self.procs:
                        if q.is_alive():
                            q.terminate()
                    os._exit(1)  # rank 0 may be blocked in a collective: leave without waiting

    def dead_worker(self, wait: float = 5.0) -> str | None:
        """Why the group broke, if a local worker has exited: a collective on rank 0 can fail
        (connection closed) just before the watcher sees the exit, so wait for it briefly."""
        deadline = time.monotonic() + wait
        while True:
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    self._reported = True  # the caller reports it; shutdown need not
                    return f"tensor-parallel worker rank {rank} exited with code {p.exitcode}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Send STOP to the followers and wait for the local workers to exit."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.pc.control is not None:
            try:
                steps.send(self.pc, None)
            except RuntimeError as e:  # a follower already gone: nothing left to stop
                log.warning("could not send STOP to the followers: %s", e)
        for rank, p in enumerate(self.procs, start=1):
            p.join(timeout)
            if p.is_alive():
                p.terminate()
            elif p.exitcode and not self._reported:  # failed before the watcher saw it
                print(
                    f"m3lm: error: tensor-parallel worker rank {rank} exited with code {p.exitcode}",
                    file=sys.stderr,
                    flush=True,
                )
        if dist.is_initialized():
            dist.destroy_process_group()


def _load(model_dir: str, dev: torch.device, dtype: Any, quant: str, pc: ParallelConfig, progress=None):
    return load(model_dir, device=dev, dtype=dtype, progress=progress, quant=quant, parallel=pc)


def _follow(model_dir: str, dev: torch.device, dtype: Any, quant: str, pc: ParallelConfig) -> None:
    from m3lm.engine.follower import follow

    model, _ = _load(model_dir, dev, dtype, quant, pc)
    follow(model)


def _worker(rank: int, world: int, ep: bool, port: int, model_dir: str, device, dtype, quant: str) -> None:
    """Entry point of a spawned worker process on this node."""
    try:
        dev = rank_device(device, rank)
        _cpu_threads(dev, world)
        pc = init_group(
            ParallelConfig(world, rank, ep), _backend(dev), f"tcp://127.0.0.1:{port}", COLLECTIVE_TIMEOUT_S
        )
        _follow(model_dir, dev, dtype, quant, pc)
    except Exception as e:
        print(f"m3lm: error: tensor-parallel rank {rank}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    dist.destroy_process_group()


def load_for_engine(
    spec: LoadSpec, progress: Callable[[int, int], None] | None = None
) -> tuple[Any, Any, Group | None] | None:
    """The one way to load for an engine: (model, tokenizer or None, group or None) on one
    device, or rank 0's shard and its group under tensor parallelism (worker processes started
    here, or torchrun's ranks); None on a torchrun follower rank, which has served rank 0's steps
    by the time it returns."""
    spec.check(under_torchrun())
    if spec.tensor_parallel_size > 1 or under_torchrun():
        return launch(
            spec.model_dir,
            spec.tensor_parallel_size,
            spec.expert_parallel,
            spec.device,
            spec.dtype,
            progress=progress,
            quant=spec.quant,
        )
    model, tokenizer = load(
        spec.model_dir,
        device=spec.device,
        dtype=spec.dtype,
        progress=progress,
        quant=spec.quant,
        load_format=spec.load_format,
        skip_tokenizer_init=spec.skip_tokenizer_init,
    )
    return model, tokenizer, None


def launch(
    model_dir: str | Path,
    tensor_parallel_size: int,
    expert_parallel: bool = False,
    device: str | None = None,
    dtype: Any = None,
    progress: Callable[[int, int], None] | None = None,
    quant: str = "auto",
) -> tuple[Any, Any, Group] | None:
    """Start (or join, under torchrun) the group and load this rank's shard (`quant` as in `m3lm.load`).

    Rank 0 gets (model, tokenizer, group) and must call `group.shutdown()` when done; a follower
    rank under torchrun runs rank 0's steps until STOP and gets None.
    """
    model_dir = str(model_dir)
    if under_torchrun():
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if tensor_parallel_size not in (1, world):
            raise ConfigError(
                f"--tensor-parallel-size {tensor_parallel_size} but torchrun started {world} ranks"
            )
        dev = rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
        _cpu_threads(dev, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        pc = init_group(
            ParallelConfig(world, rank, expert_parallel), _backend(dev), "env://", COLLECTIVE_TIMEOUT_S
        )
        if rank != 0:
            _follow(model_dir, dev, dtype, quant, pc)
            dist.destroy_process_group()
            return None
        group = Group(pc, [])
    else:
        world = tensor_parallel_size
        pc = ParallelConfig(world, 0, expert_parallel)  # checks the size before anything starts
        port, ctx = free_port(), mp.get_context("spawn")
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world, expert_parallel, port, model_dir, device, dtype, quant),
                name=f"m3lm-tp{rank}",
                daemon=True,
            )
            for rank in range(1, world)
        ]
        for p in procs:
            p.start()
        group = Group(pc, procs)  # watching from now on: a worker that fails to start stops us
        dev = rank_device(device, 0)
        _cpu_threads(dev, world)
        group.pc = pc = init_group(pc, _backend(dev), f"tcp://127.0.0.1:{port}", COLLECTIVE_TIMEOUT_S)
    try:
        model, tokenizer = _load(model_dir, dev, dtype, quant, pc, progress)
    except BaseException:
        group.shutdown(timeout=5.0)
        raise
    return model, tokenizer, group
