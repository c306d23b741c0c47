"""Shared by the benchmark scripts: the machine's description and the dated results sections."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from pathlib import Path


def device() -> str:
    """CPU model, core count and RAM of this machine."""
    cpu = platform.processor() or "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
    return f"{cpu}, {os.cpu_count()} cores, {int(mem.split()[1]) * 1024 / 2**30:.1f} GiB RAM"


def append_section(out: Path, title: str, command: str, details: list[str], body: str) -> None:
    """Append `## <date>`, the command, detail lines and the body to `out` (titled when new)."""
    date = datetime.now(timezone.utc).strftime("%a %b %d %H:%M:%S UTC %Y")
    parts = [f"## {date}", f"Command: `{command}`", *details, body]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(
            ("\n" if out.exists() and out.stat().st_size else f"# {title}\n\n") + "\n\n".join(parts) + "\n"
        )
    print(f"appended to {out}")
