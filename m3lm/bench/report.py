"""The bench's rows against their floors (the bytes a step must read at the measured copy
bandwidth, its FLOPs at the measured matrix rate) and its markdown report; for every benchmark
script, the machine's description and the dated sections of its results file."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from m3lm.bench.gpu_meter import GpuMeter, GpuState
from m3lm.bench.slice import RELEASE_DENSE, RELEASE_SPARSE
from m3lm.models.minimax_m3 import MiniMaxM3

COPY_BW = 4.3e12  # bytes/s, device-to-device copy measured on the H200
MATMUL_RATE = 790e12  # bf16 FLOP/s, large matrix product measured on the H200


@dataclass
class Row:
    case: str
    ms: float
    tokens: int
    floor_bytes: float
    flops: float
    ref_ms: float | None = None
    parts: dict | None = None  # decode: ms of the head and of one layer of each kind
    rested_ms: float | None = None  # prefill: one step after the GPU idled (`rested_ms`)
    gpu: GpuState | None = None  # over the case's calls (warm-up and timed), where NVML answers

    @property
    def floor_ms(self) -> float:
        """The larger of the byte floor and the arithmetic floor."""
        return max(self.floor_bytes / COPY_BW, self.flops / MATMUL_RATE) * 1e3

    def cells(self) -> list[str]:
        tps = self.tokens / self.ms * 1e3
        gbs = self.floor_bytes / self.ms / 1e6
        frac = self.floor_ms / self.ms
        tf = self.flops / self.ms / 1e9
        ref = f"{self.ref_ms:.2f}" if self.ref_ms else "-"
        speed = f"{self.ref_ms / self.ms:.1f}x" if self.ref_ms else "-"
        return [
            self.case,
            f"{self.ms:.3f}",
            f"{tps:,.0f}",
            f"{gbs:,.0f}",
            f"{tf:,.1f}",
            f"{frac:.2f}",
            ref,
            speed,
        ]


def weights_bytes(model: MiniMaxM3, batch: int) -> float:
    """Bytes of weights one decode step of `batch` tokens must read (experts: those expected to be hit)."""
    a = model.args
    total = 0.0
    for name, p in model.named_parameters():
        b = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight"):
            b = batch * a.hidden_size * p.element_size()
        elif ".experts." in name:
            hit = a.num_local_experts * (1 - (1 - a.num_experts_per_tok / a.num_local_experts) ** batch)
            b = b * hit / a.num_local_experts
        total += b
    return total


def active_params(model: MiniMaxM3, with_lm_head: bool = True) -> float:
    a = model.args
    n = 0.0
    for name, p in model.named_parameters():
        skip = name.endswith(("embed_tokens.weight", "_scale")) or (
            name == "lm_head.weight" and not with_lm_head
        )
        if skip:
            continue
        n += p.numel() * (a.num_experts_per_tok / a.num_local_experts if ".experts." in name else 1)
    return n


def kv_bytes(model: MiniMaxM3, batch: int, ctx: int) -> float:
    a = model.args
    per_tok = 2 * a.num_key_value_heads * a.head_dim * 2
    dense = sum(1 for s in a.sparse_layers if not s) * ctx
    sparse = sum(a.sparse_layers) * min(ctx, a.dense_window)
    index = sum(a.sparse_layers) * ctx * a.index_head_dim * 2
    return batch * ((dense + sparse) * per_tok + index)


def projection_ms(parts: dict) -> float:
    """The 60-layer model's step from a step's parts: head + 3 dense + 57 MoE/MSA layers."""
    return parts["head"] + RELEASE_DENSE * parts["dense"] + RELEASE_SPARSE * parts.get("sparse", 0.0)


def parts_line(case: str, step_ms: float, parts: dict, n_layers: int) -> str:
    """The decoder-layers-only time and the 60-layer projection of one decode case."""
    sparse = parts.get("sparse", 0.0)
    proj = projection_ms(parts)
    summed = parts["head"] + parts["dense"] + (n_layers - 1) * sparse
    return (
        f"{case}: step {step_ms:.3f} ms; embedding+norm+lm_head {parts['head']:.3f} ms; "
        f"decoder layers {step_ms - parts['head']:.3f} ms (dense layer {parts['dense']:.3f}, "
        f"MoE+MSA layer {sparse:.3f}; parts sum to {summed:.3f}); 60-layer projection "
        f"{parts['head']:.3f} + {RELEASE_DENSE} x {parts['dense']:.3f} + {RELEASE_SPARSE} x {sparse:.3f} = {proj:.2f} ms"
    )


def rested_line(row: Row) -> str:
    return (
        f"{row.case}: {row.rested_ms:.3f} ms ({row.tokens / row.rested_ms * 1e3:,.0f} tok/s) a step "
        f"after 0.5 s with the GPU idle (median of 3); the table's {row.ms:.3f} ms is the step back "
        "to back, at the power limit"
    )


def gb_text(sizes: dict[str, int]) -> str:
    return (
        f"{sum(sizes.values()) / 1e9:.2f} GB ("
        + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in sizes.items())
        + ")"
    )


def markdown(rows: list[Row], command: str, notes: list[str] = ()) -> str:
    head = [
        "case",
        "ms",
        "tok/s",
        "GB/s (floor bytes)",
        "TFLOP/s",
        "fraction of floor",
        "transformers ms",
        "speed-up",
    ]
    meter = GpuMeter.open()
    limit = f" (power limit {meter.power_limit_w():.0f} W)" if meter else ""
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"Command: `{command}`",
        "",
        f"Device: {torch.cuda.get_device_name()}{limit}, torch {torch.__version__}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    return "\n".join(lines) + "\n"


def machine() -> str:
    """CPU model, core count and RAM of this machine."""
    cpu = platform.processor() or "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
    return f"{cpu}, {os.cpu_count()} cores, {int(mem.split()[1]) * 1024 / 2**30:.1f} GiB RAM"


_WRITTEN: set[Path] = set()  # results files this process has written: its later sections follow


def write_section(out: Path, title: str, command: str, details: list[str], body: str) -> None:
    """`# title`, then `## <date>`, the command, detail lines and the body, to `out`.

    A results file holds its latest run: the first section a process writes replaces the file
    (earlier runs stay in the repository's history); its later sections follow that one."""
    date = datetime.now(UTC).strftime("%a %b %d %H:%M:%S UTC %Y")
    parts = [f"## {date}", f"Command: `{command}`", *details, body]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fresh = out.resolve() not in _WRITTEN
    _WRITTEN.add(out.resolve())
    with out.open("w" if fresh else "a") as f:
        f.write((f"# {title}\n\n" if fresh else "\n") + "\n\n".join(parts) + "\n")
    print(f"wrote {out}")
