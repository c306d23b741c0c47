"""CPU twins of the GPU kernel tests: the Triton kernels run in Triton's interpreter."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

pytest.importorskip("triton")


def test_triton_kernels_match_references_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, str(REPO / "tests" / "kernel_checks.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for name in (
        "decode_kernels",
        "prefill_kernel",
        "prefill_selection",
        "moe_kernel",
        "launch_order",
        "routing_kernels",
        "fp8_kernels",
        "elementwise_kernels",
    ):
        assert f"{name} ok" in r.stdout
