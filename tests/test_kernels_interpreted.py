"""CPU twins of the GPU kernel tests: the Triton kernels run in Triton's interpreter.

Each check runs in a process of its own (TRITON_INTERPRET must be set before Triton is imported);
the processes start together when collection ends, so they run beside the rest of the suite.
"""

import ast
import os
import subprocess
import sys

import pytest
from conftest import PATIENCE_S, REPO

pytest.importorskip("triton")


def _check_names() -> tuple[str, ...]:
    """The names in kernel_checks.CHECKS, read from its source: importing it would turn on the
    interpreter in this process."""
    tree = ast.parse((REPO / "tests" / "kernel_checks.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "CHECKS":
            return tuple(e.id for e in node.value.generators[0].iter.elts)
    raise AssertionError("kernel_checks.py has no CHECKS")


CHECKS = _check_names()


PROCS: dict[str, subprocess.Popen] = {}


def start_checks(names=CHECKS) -> None:
    """Start the named checks' processes (conftest does this once collection has picked the tests,
    so the interpreter's work overlaps the rest of the suite)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    script = str(REPO / "tests" / "kernel_checks.py")
    for name in names:
        PROCS[name] = subprocess.Popen(
            [sys.executable, script, name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )


@pytest.fixture(scope="module")
def runs():
    yield PROCS
    for p in PROCS.values():
        p.kill()
        p.wait()


@pytest.mark.parametrize("name", CHECKS)
def test_triton_kernel_matches_its_reference_in_the_interpreter(runs, name):
    if name not in runs:  # collected without conftest's hook
        start_checks((name,))
    out, _ = runs[name].communicate(timeout=PATIENCE_S)
    assert runs[name].returncode == 0, out
    assert f"{name} ok" in out
