"""`m3lm serve` in a subprocess, as users start it, and what the tests read of it from /proc."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from m3lm.engine.launch import free_port
from tests.support.paths import PATIENCE_S

# `python -c MODULES_ON_EXIT OUT serve ...`: the CLI, writing the modules it imported to OUT on exit
MODULES_ON_EXIT = """
import atexit, json, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
from m3lm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def serve_env(extra: dict | None = None) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(extra or {})}


def start_serve(checkpoint: Path, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`m3lm serve --model checkpoint` on a free port: (the process, its URL)."""
    port = free_port()
    argv = [sys.executable, "-m", "m3lm", "serve", "--model", str(checkpoint), "--port", str(port), *extra]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=serve_env(env)
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, limit: float = PATIENCE_S) -> None:
    deadline = time.time() + limit
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "the server did not start"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)


def stop(proc: subprocess.Popen) -> str:
    """Kill `proc` if it still runs; its whole output."""
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=PATIENCE_S)
    return out


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Serve:
    """`m3lm serve` on the embedded model, its output collected line by line as it comes."""

    def __init__(self, *args: str, port: int | None = None, modules_to: Path | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # modules_to: on its way out, the server process writes the modules it imported there
        head = ["-m", "m3lm"] if modules_to is None else ["-c", MODULES_ON_EXIT, str(modules_to)]
        argv = [sys.executable, *head, "serve", "--port", str(self.port), "--device", "cpu", *args]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=serve_env()
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, check, what: str) -> None:
        deadline = time.monotonic() + PATIENCE_S
        while not check():
            assert time.monotonic() < deadline, f"waited for {what}: {self.output[-3000:]}"
            time.sleep(0.01)

    def wait_healthy(self) -> None:
        def healthy():
            assert self.proc.poll() is None, self.output[-3000:]
            try:
                return httpx.get(self.url + "/health").status_code == 200
            except httpx.HTTPError:
                return False

        self.wait_for(healthy, "/health")

    def engine_pids(self) -> list[int]:
        return children(self.proc.pid)

    def finish(self) -> int:
        code = self.proc.wait(timeout=PATIENCE_S)
        self._reader.join(PATIENCE_S)
        return code

    def kill(self) -> None:
        """Whatever is still running (a failed test's leftovers)."""
        engines = self.engine_pids()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=PATIENCE_S)
        for pid in engines:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
