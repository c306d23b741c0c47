"""A real-dimension slice of MiniMax-M3 under tensor (and expert) parallelism, timed per rank.

Each rank builds its shard of the slice directly on its device (meta-device construction with
its `ParallelConfig`, then a seeded fill, `tp_slice.py`): by default the `full` fill, so the
shards join into the weights a single-device build of the same seed gets. Timed on every rank
with CUDA events after a barrier, reported from rank 0 (median of `--iters`):

- decode steps at each `--decode BxCTX` over a paged cache of CTX positions holding random keys,
  through `forward_batch` (path `batch`, what the engine runs under tensor parallelism) and, on
  GPUs, `forward_batch` over a `DecodeBatch` run eagerly (path `decode`, the graph-ready kernels).
  CUDA graphs are off under tensor parallelism (collectives are not captured), so both are eager.
- prefill of one sequence of each `--prefill` length (one packed forward, logits of the last row).

Each case is also timed at depth 0 (embedding + final norm + lm_head) and depth 1 (plus the
dense layer 0), which gives one MoE + MSA layer by subtraction and the 60-layer projection: head
+ 3 dense + 57 MoE + MSA layers, set beside the published vLLM figures. `--out FILE` writes a
dated section. NCCL_NVLS_ENABLE is set to 0 (any other value is refused).

    torchrun --nproc-per-node 8 benchmarks/tp_bench.py --layers 16 --expert-parallel
    python benchmarks/tp_bench.py --cpu-gloo 4 --expert-parallel --tiny --check   # CPU, gloo

`--check` first compares the sharded logits with a single-device run (`tp_check.py`);
`--golden DIR...` compares the sharded fixtures with their CPU reference. A failed check exits 1.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tp_check import barrier, check, golden

from m3lm.bench.report import machine, write_section
from m3lm.bench.timing import event_ms
from m3lm.bench.tp_slice import (
    Depth,
    build_shard,
    parse_decode,
    parse_ints,
    per_layer,
    require_nvls_off,
    slice_args,
    table,
)
from m3lm.cache.kv_cache import KVCache, PagedKV
from m3lm.distributed.parallel import ParallelConfig, init_group
from m3lm.engine.launch import COLLECTIVE_TIMEOUT_S, free_port, rank_device
from m3lm.layers.batch import DecodeBatch, ForwardBatch
from m3lm.layers.linear import weight_bytes
from m3lm.models.minimax_m3 import MiniMaxM3, keep_mxfp8_

GRAPHS_NOTE = (
    "CUDA graphs are off under tensor parallelism (collectives are not captured): every step is eager"
)


def time_ms(fn, iters: int, pc: ParallelConfig, dev: torch.device) -> float:
    """Median ms of `fn` on this rank after two warm-up calls and a barrier (CUDA events on a GPU)."""
    fn()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    barrier(pc, dev)
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            times.append(event_ms(fn))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _cache(model: MiniMaxM3, pages: int) -> KVCache:
    """A paged cache of this rank's KV heads holding random keys (the same seed on every rank)."""
    a, w = model.args, model.lm_head.weight
    cache = KVCache(a, pages, w.device, w.dtype, kv_heads=model.model.layers[0].self_attn.n_kv)
    gen = torch.Generator(device=w.device).manual_seed(1)
    for t in (*cache.k, *cache.v, *cache.ik.values()):
        t.normal_(0.0, 1.0, generator=gen)
    return cache


def decode_step(model: MiniMaxM3, cache: KVCache, batch: int, ctx: int, path: str):
    """A function running one decode step of `batch` sequences at position ctx - 1."""
    a, dev = model.args, model.lm_head.weight.device
    pages = math.ceil(ctx / a.index_block_size)
    tokens = torch.randint(0, a.vocab_size, (batch,), generator=torch.Generator().manual_seed(2)).to(dev)
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    positions = torch.full((batch,), ctx - 1, device=dev)
    if path == "decode":  # GPU kernels, no host sync: the step CUDA graphs capture on one GPU
        tab = torch.tensor(tables, dtype=torch.int32, device=dev)  # [B, pages]
        dec = DecodeBatch.build(positions, tab, cache, a.index_block_size)
        return lambda: model.forward_batch(tokens, dec)

    def step():
        kv = PagedKV(cache, tables, [ctx - 1] * batch, [1] * batch)
        model.forward_batch(tokens, ForwardBatch(positions, [1] * batch, kv=kv))  # [B, V]

    return step


def prefill_step(model: MiniMaxM3, cache: KVCache, length: int):
    a, dev = model.args, model.lm_head.weight.device
    ids = torch.randint(0, a.vocab_size, (length,), generator=torch.Generator().manual_seed(3)).to(dev)
    pos, last = torch.arange(length, device=dev), torch.tensor([length - 1], device=dev)
    table = [list(range(math.ceil(length / a.index_block_size)))]

    def step():
        kv = PagedKV(cache, table, [0], [length])
        model.forward_batch(ids, ForwardBatch(pos, [length], kv=kv), last)  # [1, V]

    return step


def bench_case(model, make, iters: int, pc, dev) -> tuple[float, dict]:
    """ms at full depth and the per-layer parts (depths 0 and 1)."""
    n = len(model.model.layers)
    ms = {}
    for k in (0, 1):
        with Depth(model, k):
            ms[k] = time_ms(make(), iters, pc, dev)
    ms[n] = time_ms(make(), iters, pc, dev)
    return ms[n], per_layer(ms[0], ms[1], ms[n], n)


def run(ns, pc: ParallelConfig, dev: torch.device) -> tuple[list[dict], list[str], bool]:
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    notes, rows = [], []
    for quant in ns.quant if ns.check else []:
        ok, line = check(ns.check_layers, ns.tiny, pc, dev, dtype, ns.seed, quant)
        notes.append(line)
        if not ok:
            return rows, notes, False
    if ns.golden:
        ok, lines = golden(ns.golden, pc, dev)
        notes += lines
        if not ok:
            return rows, notes, False
    if not ns.decode and not ns.prefill:
        return rows, notes, True
    t0 = time.time()
    model = build_shard(slice_args(ns.layers, ns.tiny), pc, dev, dtype, ns.seed, ns.fill)
    notes.append(f"built rank {pc.rank}'s shard of the {ns.layers}-layer slice in {time.time() - t0:.1f} s")
    paths = ns.decode_path or (["batch", "decode"] if dev.type == "cuda" else ["batch"])
    for quant in ns.quant:
        if quant == "mxfp8":
            keep_mxfp8_(model, quantize=True)  # each rank quantises its shard (32-blocks stay aligned)
            model.prepare_()
        resident = weight_bytes(model)
        label = quant if dev.type == "cuda" or quant == "mxfp8" else "fp32"
        sizes = ", ".join(f"{k} {v / 1e6:,.1f}" for k, v in resident.items())
        notes.append(
            f"rank {pc.rank} resident weights [{label}]: {sum(resident.values()) / 1e6:,.1f} MB ({sizes})"
        )
        for b, ctx in ns.decode:
            cache = _cache(model, b * math.ceil(ctx / model.args.index_block_size))
            for path in paths:
                make = lambda c=cache, b=b, ctx=ctx, p=path: decode_step(model, c, b, ctx, p)  # noqa: E731
                ms, parts = bench_case(model, make, ns.iters, pc, dev)
                case = f"decode B={b} ctx={ctx}"
                rows.append(dict(case=case, quant=label, path=path, ms=ms, tokens=b, parts=parts, batch=b))
            del cache
        for t in ns.prefill:
            cache = _cache(model, math.ceil(t / model.args.index_block_size))
            make = lambda c=cache, t=t: prefill_step(model, c, t)  # noqa: E731
            ms, parts = bench_case(model, make, max(2, ns.iters // 5), pc, dev)
            rows.append(dict(case=f"prefill T={t}", quant=label, path="batch", ms=ms, tokens=t, parts=parts))
            del cache
    if dev.type == "cuda":
        notes.append(f"rank 0 peak memory allocated: {torch.cuda.max_memory_allocated(dev) / 1e9:.1f} GB")
    return rows, notes, True


def rank_main(rank: int, world: int, port: int | None, local_rank: int, ns) -> None:
    dev = torch.device("cpu") if ns.cpu_gloo else rank_device("cuda", local_rank)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    pc = ParallelConfig(world, rank, ns.expert_parallel)
    if world > 1:
        init = f"tcp://127.0.0.1:{port}" if port else "env://"
        pc = init_group(pc, "nccl" if dev.type == "cuda" else "gloo", init, COLLECTIVE_TIMEOUT_S)
    with torch.inference_mode():
        rows, notes, ok = run(ns, pc, dev)
    if rank == 0:
        report(ns, pc, dev, rows, notes)
    if world > 1:
        dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


def report(ns, pc: ParallelConfig, dev: torch.device, rows: list[dict], notes: list[str]) -> None:
    command = "python benchmarks/tp_bench.py " + shlex.join(ns.argv)
    if not ns.cpu_gloo:
        command = f"torchrun --nproc-per-node {pc.world} benchmarks/tp_bench.py " + shlex.join(ns.argv)
    if dev.type == "cuda":
        nccl = torch.cuda.nccl.version()  # a tuple (major, minor, patch) in recent torch
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        where = f"{pc.world} x {torch.cuda.get_device_name(dev)}, NCCL {nccl}"
    else:
        where = f"{pc.world} gloo processes on {machine()}"
    details = [
        f"Machine: {where}; torch {torch.__version__}; NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}",
        f"Group: TP {pc.world}{' with expert parallelism' if pc.ep else ''}; "
        f"{'tiny' if ns.tiny else 'release'}-dimension slice of {ns.layers} layers "
        f"(layer 0 dense + full attention, the rest MoE + MSA), random weights, fill `{ns.fill}`",
        f"{GRAPHS_NOTE}. Projection: head + 3 x dense + 57 x MoE+MSA layer (per-layer times from depths 0, 1 and {ns.layers}).",
    ]
    body = (table(rows, ns.layers) + "\n\n" if rows else "") + "\n".join(f"- {n}" for n in notes)
    print("\n\n".join([f"Command: `{command}`", *details, body]), flush=True)
    if ns.out:
        write_section(Path(ns.out), "Tensor-parallel slice benchmarks", command, details, body)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None, help="slice depth (default 16; 3 with --tiny)")
    p.add_argument("--expert-parallel", action="store_true")
    p.add_argument("--cpu-gloo", type=int, default=0, metavar="N", help="spawn N CPU ranks over gloo")
    p.add_argument("--tiny", action="store_true", help="CPU-sized dimensions with the release's structure")
    p.add_argument(
        "--decode", type=parse_decode, default=None, help="BxCTX,... (default 1x2048,4x2048,16x2048,64x2048)"
    )
    p.add_argument("--prefill", type=parse_ints, default=None, help="lengths (default 8192,65536)")
    p.add_argument(
        "--decode-path", type=lambda s: s.split(","), default=None, help="batch,decode (GPU default both)"
    )
    p.add_argument("--quant", type=lambda s: s.split(","), default=["bf16"], help="bf16, mxfp8 or bf16,mxfp8")
    p.add_argument("--fill", choices=["full", "shard"], default="full")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="sharded logits against a single-device run first")
    p.add_argument("--check-layers", type=int, default=2)
    p.add_argument("--golden", nargs="*", default=[], metavar="DIR", help="golden fixtures to check first")
    p.add_argument("--out", default=None, help="write a dated section to this Markdown file (its latest run)")
    ns = p.parse_args(argv)
    ns.argv = list(sys.argv[1:] if argv is None else argv)
    ns.layers = ns.layers or (3 if ns.tiny else 16)
    if ns.decode is None:
        ns.decode = parse_decode("1x32,4x32,16x32,64x32" if ns.tiny else "1x2048,4x2048,16x2048,64x2048")
    ns.prefill = ns.prefill if ns.prefill is not None else ([64, 256] if ns.tiny else [8192, 65536])
    if ns.quant not in (["bf16"], ["mxfp8"], ["bf16", "mxfp8"]):
        p.error("--quant: expected bf16, mxfp8 or bf16,mxfp8")
    if ns.layers < 2:
        p.error("--layers must be at least 2 (the projection needs a MoE + MSA layer)")
    if "decode" in (ns.decode_path or []) and ns.cpu_gloo:
        p.error("--decode-path decode needs GPUs (Triton kernels)")
    return ns


def main(argv: list[str] | None = None) -> None:
    ns = parse(argv)
    require_nvls_off()
    if ns.cpu_gloo:
        port, ctx = free_port(), mp.get_context("spawn")
        procs = [
            ctx.Process(target=rank_main, args=(r, ns.cpu_gloo, port, r, ns)) for r in range(ns.cpu_gloo)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        codes = [proc.exitcode for proc in procs]
        if any(codes):
            raise SystemExit(f"ranks exited with codes {codes}")
        return
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    rank_main(rank, world, None, int(os.environ.get("LOCAL_RANK", rank)), ns)


if __name__ == "__main__":
    main()
