"""CPU twins of the GPU kernel tests: the Triton kernels run in Triton's interpreter.

Each check runs in a process of its own (TRITON_INTERPRET must be set before Triton is imported);
the processes start together when collection ends, so they run beside the rest of the suite.
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


PROCS: dict[str, subprocess.Popen] = {}


def start_checks() -> None:
    """Start every check's process (conftest calls this once collection has picked these tests, so
    the interpreter's work overlaps the rest of the suite)."""
    if PROCS:
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    script = str(REPO / "tests" / "kernel_checks.py")
    for name in CHECKS:
        PROCS[name] = subprocess.Popen(
            [sys.executable, script, name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )


@pytest.fixture(scope="module")
def runs():
    start_checks()
    yield PROCS
    for p in PROCS.values():
        p.kill()
        p.wait()


@pytest.mark.parametrize("name", CHECKS)
def test_triton_kernel_matches_its_reference_in_the_interpreter(runs, name):
    out, _ = runs[name].communicate(timeout=900)
    assert runs[name].returncode == 0, out
    assert f"{name} ok" in out
