"""Plots beside the benchmarks' tables: PNG line plots through matplotlib (the `plot` extra,
imported on use; without it the table is written alone)."""

from __future__ import annotations

import re
from pathlib import Path

Series = dict[str, list[tuple[float, float]]]  # a line's label -> its (x, y) points


def decode_series(cases: list[tuple[str, float]]) -> Series:
    """(case, ms) of `m3lm bench` rows -> decode step time against context, a line per batch
    size that has two contexts or more."""
    lines: Series = {}
    for case, ms in cases:
        m = re.fullmatch(r"decode B=(\d+) ctx=(\d+)", case)
        if m:
            lines.setdefault(f"batch {m[1]}", []).append((int(m[2]), ms))
    return {k: sorted(v) for k, v in lines.items() if len(v) > 1}


def line_plot(
    path: Path, title: str, xlabel: str, ylabel: str, series: Series, logx: bool = False, logy: bool = False
) -> Path | None:
    """Write `series` as a line plot to `path` (PNG); None where there is nothing to draw or no
    matplotlib."""
    if not series:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print(f"no plot {path}: matplotlib is not installed (pip install 'm3lm[plot]')")
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for label, points in series.items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=label)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({x for points in series.values() for x, _ in points}))
    if logy:
        ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")  # 4096, not 2^12
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain if axis is ax.yaxis and logy else matplotlib.ticker.NullFormatter())
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None})  # no version stamp: the same figure, the same file
    plt.close(fig)
    print(f"wrote {path}")
    return path
