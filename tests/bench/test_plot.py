"""The plots beside the benchmarks' tables: which points they draw, and the PNG they write."""

import pytest

from m3lm.bench.plot import decode_series, line_plot


def test_decode_series_is_step_time_against_context_per_batch():
    cases = [
        ("decode B=1 ctx=131072", 1.9),
        ("decode B=1 ctx=4096", 1.8),
        ("decode B=64 ctx=1024", 9.7),  # one context only: no line
        ("prefill B=1 T=8192", 65.0),
        ("decode B=1 ctx=1048576", 2.4),
    ]
    assert decode_series(cases) == {"batch 1": [(4096, 1.8), (131072, 1.9), (1048576, 2.4)]}


def test_nothing_to_draw_writes_nothing(tmp_path):
    assert line_plot(tmp_path / "p.png", "t", "x", "y", {}) is None
    assert not (tmp_path / "p.png").exists()


def test_a_line_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")  # the `plot` extra
    out = line_plot(tmp_path / "p.png", "t", "x", "y", {"a": [(1, 2.0), (4, 3.0)]}, logx=True)
    assert out == tmp_path / "p.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
