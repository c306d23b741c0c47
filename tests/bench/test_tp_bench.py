"""The tensor-parallel slice benchmark on CPU ranks over gloo: the parity check passes and the
table comes out; the projection arithmetic and the NCCL setting it insists on."""

import os
import subprocess
import sys

import pytest

from m3lm.bench.tp_slice import RELEASE_DENSE, RELEASE_SPARSE, per_layer, require_nvls_off
from tests.support.paths import PATIENCE_S, REPO


def test_two_gloo_ranks_pass_the_check_and_print_the_table():
    cmd = [sys.executable, "benchmarks/tp_bench.py", "--cpu-gloo", "2", "--tiny", "--check"]
    cmd += ["--iters", "1", "--decode", "1x16,4x16", "--prefill", "32"]
    env = {k: v for k, v in os.environ.items() if k != "NCCL_NVLS_ENABLE"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=PATIENCE_S, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "- check passed: 2-layer slice, TP 2, float32" in r.stdout, r.stdout
    assert "| case | weights | path | 3-layer ms |" in r.stdout
    assert "60-layer projection ms" in r.stdout and "8.4 ms/token (concurrency 4)" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith(("| decode", "| prefill"))]
    assert [row.split(" | ")[0] for row in rows] == [
        "| decode B=1 ctx=16",
        "| decode B=4 ctx=16",
        "| prefill T=32",
    ]
    assert "NCCL_NVLS_ENABLE=0" in r.stdout


def test_per_layer_parts_and_the_60_layer_projection():
    # depth 0 = head 2 ms, depth 1 adds a 1 ms dense layer, depth 4 adds three 3 ms MoE layers
    parts = per_layer(2.0, 3.0, 12.0, 4)
    assert parts == {"head": 2.0, "dense": 1.0, "sparse": 3.0, "release": 2.0 + 3 * 1.0 + 57 * 3.0}
    assert (RELEASE_DENSE, RELEASE_SPARSE) == (3, 57)


def test_nvls_must_stay_off(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    require_nvls_off()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with pytest.raises(SystemExit, match="needs NCCL_NVLS_ENABLE=0"):
        require_nvls_off()
