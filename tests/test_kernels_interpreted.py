"""CPU twins of the GPU kernel tests: the Triton kernels run in Triton's interpreter.

Each check runs in a process of its own (TRITON_INTERPRET must be set before Triton is imported);
the processes start together on first use, so the checks run side by side on the machine's cores.
"""

import os
import subprocess
import sys

import pytest
from conftest import REPO

pytest.importorskip("triton")

CHECKS = (
    "decode_kernels",
    "prefill_kernel",
    "prefill_selection",
    "moe_kernel",
    "launch_order",
    "routing_kernels",
    "fp8_kernels",
    "elementwise_kernels",
)


@pytest.fixture(scope="module")
def runs():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    script = str(REPO / "tests" / "kernel_checks.py")
    procs = {
        name: subprocess.Popen(
            [sys.executable, script, name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for name in CHECKS
    }
    yield procs
    for p in procs.values():
        p.kill()
        p.wait()


@pytest.mark.parametrize("name", CHECKS)
def test_triton_kernel_matches_its_reference_in_the_interpreter(runs, name):
    out, _ = runs[name].communicate(timeout=900)
    assert runs[name].returncode == 0, out
    assert f"{name} ok" in out
