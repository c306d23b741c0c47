"""The child pytest process that runs the interpreter's kernel cases (`targets`), and its results."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.paths import PATIENCE_S, REPO

_run: dict = {}


def start(nodeids: list[str]) -> None:
    """Run `nodeids` in a child pytest process with TRITON_INTERPRET=1, in the background."""
    out = Path(tempfile.mkdtemp(prefix="m3lm-interpreter-"))
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "M3LM_INTERPRETER_REPORT": str(out / "report.json"),
    }
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "tests.support.interpreter_report",
    ]
    log = open(out / "log.txt", "w")  # noqa: SIM115 (closed in `result`)
    _run.update(
        out=out,
        log=log,
        proc=subprocess.Popen([*argv, *nodeids], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT),
    )


def result(nodeid: str) -> dict:
    """{"outcome": "passed" | "failed" | "skipped", "text": ...} of `nodeid` in the child's run."""
    if not _run:
        start([nodeid])  # a case run without the suite's collection hook
    proc = _run["proc"]
    proc.wait(timeout=PATIENCE_S)
    _run["log"].close()
    report = _run["out"] / "report.json"
    results = json.loads(report.read_text()) if report.is_file() else {}
    if nodeid not in results:
        log = (_run["out"] / "log.txt").read_text()
        return {
            "outcome": "failed",
            "text": f"the interpreter's run (exit {proc.returncode}) has no result:\n{log[-4000:]}",
        }
    return results[nodeid]


def stop() -> None:
    """End the child if it still runs (a run stopped early, `-x`), and close its log."""
    if _run and _run["proc"].poll() is None:
        _run["proc"].kill()
        _run["proc"].wait()
    if _run and not _run["log"].closed:
        _run["log"].close()
