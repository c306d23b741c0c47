"""Peak host memory of loading a sharded release-layout checkpoint, against its weight bytes.

The benchmark writes a random bf16 checkpoint of a bit over 2 GB in the release VL layout
(`config.json` with `text_config`, `language_model.model.*` keys, one tensor per routed expert,
fp32 router) as several safetensors shards with a `model.safetensors.index.json`, one shard at a
time. It then runs `m3lm.load(dir, device="cpu", dtype=torch.bfloat16)` in a fresh Python process
and reports two measures of its host memory, each against the bytes of the loaded parameters:

- peak RSS (`ru_maxrss`) minus the RSS after `import torch, m3lm`. RSS also counts the
  file-backed pages of the memory-mapped shards being read: page cache, shared, clean and
  reclaimable by the kernel, so this overstates what the process owns by the pages touched of
  the shard being read, which hardly shrink with N (a rank reads a slice of every tensor).
- peak anonymous RSS (`RssAnon` in /proc/self/status) minus its value after the imports: the
  memory the process really owns (parameters, read buffers, allocator slack). A background thread
  samples /proc/self/status every millisecond or so during `m3lm.load` (a sample can be delayed
  while a C call holds the GIL, so a very brief spike may be missed), and records the peak
  `RssFile` (the mapped shard pages) as well.

A loader that streams tensors into preallocated parameters should keep the anonymous peak close
to 1.0 of the weights: the weights, about one tensor (slice) in flight, and a fixed ~0.07 GiB of
Python modules that torch imports the first time it builds the model on the meta device.

Run from the repository root:

    python3 benchmarks/load_memory.py --out benchmarks/results/load_memory.md

`--out` writes a dated section (command, device, torch version, figures) to the file.
`--workdir DIR` keeps the generated checkpoint in DIR instead of a temporary directory.

`--tensor-parallel 1,2,4` (and `--expert-parallel`) measures sharded loading instead: for each
size N it loads every rank's shard in its own fresh process, one after another (loading needs
no process group), and reports the largest rank's figures (for each measure) against the full
weight bytes; a loader that reads only each rank's slices should keep the anonymous peak near 1/N.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from m3lm.bench.report import machine, write_section
from m3lm.config import ModelArgs, release_config
from m3lm.models.minimax_m3 import MiniMaxM3, release_name

LAYERS = 9  # layer 0 dense MLP + full attention, layers 1-8 MoE + MSA


def config() -> dict:
    """Release-style config.json: bf16 weights of about 2.3 GB."""
    return release_config(
        vocab_size=32064, hidden_size=2048, num_hidden_layers=LAYERS, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, rotary_dim=64, rope_theta=5000000,
        max_position_embeddings=1048576, dense_layers=1, dense_intermediate_size=8192,
        intermediate_size=1024, shared_intermediate_size=1024, num_local_experts=16,
        num_experts_per_tok=4, index_head_dim=128, block_size=128, topk_blocks=16, local_blocks=1,
    )  # fmt: skip


def release_tensors(args: ModelArgs) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(release key, shape, dtype) of every language-model tensor, from a model on the meta device."""
    with torch.device("meta"):
        model = MiniMaxM3(args, dtype=torch.bfloat16)
    out = []
    for name, p in model.named_parameters():
        if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            out += [(release_name(name, e), tuple(p.shape[1:]), p.dtype) for e in range(p.shape[0])]
        else:
            out.append((release_name(name), tuple(p.shape), p.dtype))
    return out


def write_checkpoint(path: Path, shard_bytes: int) -> int:
    """Write config.json, the shards and the index; return the bytes of tensor data written."""
    cfg = config()
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = total = 0
    for t in release_tensors(ModelArgs.from_dict(cfg)):
        nbytes = torch.Size(t[1]).numel() * t[2].itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
        total += nbytes
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for k, specs in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: torch.empty(s, dtype=dt).normal_(0.0, 0.02, generator=gen) for n, s, dt in specs}
        save_file(tensors, path / fname, metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys((n for n, _, _ in specs), fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def status() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024  # kB
    return out


class Sampler(threading.Thread):
    """Peak RssAnon and RssFile of this process, sampled every `interval` seconds until stop()."""

    def __init__(self, interval: float = 0.001):
        super().__init__(daemon=True)
        self.interval, self.samples, self.halt = interval, 0, threading.Event()
        self.peak = {"RssAnon": 0, "RssFile": 0}

    def sample(self) -> None:
        now = status()
        for k in self.peak:
            self.peak[k] = max(self.peak[k], now[k])
        self.samples += 1

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            self.halt.wait(self.interval)

    def stop(self) -> dict[str, int]:
        self.halt.set()
        self.join()
        self.sample()  # the state at the end counts too
        return self.peak


def child(path: str, world: int = 1, rank: int = 0, ep: bool = False) -> None:
    """Runs in the fresh process: load (rank `rank` of `world`) and print the figures as JSON."""
    import resource

    import m3lm
    from m3lm.distributed.parallel import ParallelConfig

    sys.setswitchinterval(0.001)  # let the sampler in between the loader's Python steps
    base = status()
    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    loaded = m3lm.load(path, device="cpu", dtype=torch.bfloat16, parallel=ParallelConfig(world, rank, ep))
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    after = status()
    r = {
        "baseline": base["VmRSS"],
        "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        "after": after["VmRSS"],
        "anon_baseline": base["RssAnon"],
        "anon_peak": peak["RssAnon"],
        "anon_after": after["RssAnon"],
        "file_peak": peak["RssFile"],
        "samples_per_s": sampler.samples / seconds,
        "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
        "seconds": seconds,
    }
    print(json.dumps(r))


def report(r: dict, n_shards: int, disk: int) -> str:
    gib = 2**30
    extra, anon = r["peak"] - r["baseline"], r["anon_peak"] - r["anon_baseline"]
    rows = [
        ("checkpoint", f"release VL layout, bf16, {n_shards} shards, {disk / gib:.2f} GiB on disk"),
        ("weight bytes (loaded parameters)", f"{r['weights'] / gib:.3f} GiB ({r['weights']:,} B)"),
        ("baseline RSS (after `import torch, m3lm`)", f"{r['baseline'] / gib:.3f} GiB"),
        ("peak RSS (`ru_maxrss`)", f"{r['peak'] / gib:.3f} GiB"),
        ("RSS after load", f"{r['after'] / gib:.3f} GiB"),
        ("peak RSS - baseline", f"{extra / gib:.3f} GiB"),
        ("(peak RSS - baseline) / weight bytes", f"{extra / r['weights']:.3f}"),
        ("baseline anonymous RSS (`RssAnon`)", f"{r['anon_baseline'] / gib:.3f} GiB"),
        ("peak anonymous RSS (sampled)", f"{r['anon_peak'] / gib:.3f} GiB"),
        ("anonymous RSS after load", f"{r['anon_after'] / gib:.3f} GiB"),
        ("peak anonymous - baseline", f"{anon / gib:.3f} GiB"),
        ("**(peak anonymous - baseline) / weight bytes**", f"**{anon / r['weights']:.3f}**"),
        ("peak file-backed RSS (`RssFile`, sampled)", f"{r['file_peak'] / gib:.3f} GiB"),
        ("samples per second", f"{r['samples_per_s']:.0f}"),
        ("load time (shards in the page cache)", f"{r['seconds']:.1f} s"),
    ]
    return "\n".join(["| metric | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def run_child(path: Path, world: int = 1, rank: int = 0, ep: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", str(path), "--world", str(world), "--rank", str(rank)]
    proc = subprocess.run(
        cmd + (["--expert-parallel"] if ep else []), stdout=subprocess.PIPE, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sharded_report(path: Path, sizes: list[int], ep: bool, n_shards: int, disk: int) -> str:
    """One row per tensor-parallel size: the largest rank's weights, peak RSS and peak anonymous
    RSS (each the largest over the ranks) against the full weights."""
    gib, full = 2**30, None
    rows = []
    for n in sizes:
        ranks = [run_child(path, n, r, ep) for r in range(n)]
        full = full or (ranks[0]["weights"] if n == 1 else None)
        extra = max(r["peak"] - r["baseline"] for r in ranks)
        anon = max(r["anon_peak"] - r["anon_baseline"] for r in ranks)
        most = {k: max(r[k] for r in ranks) for k in ("weights", "file_peak", "seconds")}
        rows.append((n, most["weights"], extra, anon, most["file_peak"], most["seconds"]))
        print(f"N={n}: peak RSS - baseline {extra / gib:.3f} GiB, anonymous {anon / gib:.3f} GiB", flush=True)
    full = full or rows[0][1] * sizes[0]
    head = [
        f"Checkpoint: release VL layout, bf16, {n_shards} shards, {disk / gib:.2f} GiB on disk; "
        f"full weights {full / gib:.3f} GiB; expert parallelism {'on' if ep else 'off'}. "
        "Each figure is the largest over the N ranks. Peak RSS (`ru_maxrss`) counts the page-cache "
        "pages of the mapped shards; peak anonymous (`RssAnon`, sampled) is what a rank owns.",
        "",
        "| N | rank weights | peak RSS - baseline | / full | x N "
        "| peak anonymous - baseline | / full | x N | peak RssFile | load s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    body = [
        f"| {n} | {w / gib:.3f} GiB | {x / gib:.3f} GiB | {x / full:.3f} | {x / full * n:.2f} "
        f"| {a / gib:.3f} GiB | {a / full:.3f} | {a / full * n:.2f} | {f / gib:.3f} GiB | {t:.1f} |"
        for n, w, x, a, f, t in rows
    ]
    return "\n".join(head + body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write a dated Markdown section to this file (its latest run)")
    ap.add_argument(
        "--workdir", type=Path, help="write the checkpoint here and keep it (default: a temp dir)"
    )
    ap.add_argument("--shard-mb", type=int, default=400, help="target shard size in MB (default 400)")
    ap.add_argument("--tensor-parallel", default=None, help="comma-separated sizes, e.g. 1,2,4")
    ap.add_argument("--expert-parallel", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.world, a.rank, a.expert_parallel)

    command = shlex.join(["python3", *sys.argv])
    with tempfile.TemporaryDirectory(prefix="m3lm-load-memory-") as tmp:
        path = a.workdir or Path(tmp)
        path.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        write_checkpoint(path, a.shard_mb * 10**6)
        os.sync()  # flush the fresh shards, so writeback does not slow the timed load
        shards = sorted(path.glob("model-*.safetensors"))
        disk = sum(f.stat().st_size for f in shards)
        print(f"wrote {len(shards)} shards, {disk / 2**30:.2f} GiB, in {time.perf_counter() - t0:.0f} s")
        if a.tensor_parallel:
            sizes = [int(x) for x in a.tensor_parallel.split(",")]
            table = sharded_report(path, sizes, a.expert_parallel, len(shards), disk)
            title = "Sharded checkpoint load: peak host memory per rank"
        else:
            table = report(run_child(path), len(shards), disk)
            title = "Checkpoint load: peak host memory"
    print(table)
    if a.out:
        details = [f"Device: {machine()}; Python {platform.python_version()}, torch {torch.__version__}"]
        write_section(a.out, title, command, details, table)


if __name__ == "__main__":
    main()
