"""`m3lm generate` on the embedded model as a user runs it, with no flag: its first run on a machine
(no compiled decode step on disk yet), its later runs, and the op-by-op path (`--compile off`).

Each run is a fresh process: `m3lm generate --prompt ... --max-tokens N --temperature 0
--ignore-eos`, timed from its start to its first generated character on stdout (time to first
token, loading included) and to its exit; its decode rate is the one it prints. The first run
has an empty programs folder ($M3LM_CACHE_DIR of its own); the benchmark then waits for the
build that run started, and runs `--rounds` rounds of a later run and an op-by-op run, their
order alternating.

    python3 benchmarks/cpu/first_runs.py --rounds 5 --out benchmarks/results/first_runs.md
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Once upon a time"


def run(cache: Path, new: int, extra: list[str]) -> dict:
    env = {**os.environ, "M3LM_CACHE_DIR": str(cache)}
    env.pop("M3LM_CPU_COMPILE", None)
    argv = [sys.executable, "-m", "m3lm", "generate", "--prompt", PROMPT, "--max-tokens", str(new)]
    argv += ["--temperature", "0", "--ignore-eos", *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    seen, first = b"", None
    while chunk := proc.stdout.read1(4096):
        seen += chunk
        if first is None and len(seen) > len(PROMPT):
            first = time.perf_counter() - start
    err = proc.stderr.read().decode()
    if proc.wait() != 0:
        raise RuntimeError(f"{argv} failed:\n{err}")
    rate = re.search(r"generation: \d+ tokens, ([\d.]+) tok/s", err)
    return {
        "ttft": first,
        "wall": time.perf_counter() - start,
        "tps": float(rate.group(1)),
        "announced": "compiling the CPU decode step" in err,
        "text": seen.decode(),
    }


def wait_for_programs(cache: Path) -> float:
    """Seconds until the build a run started has left its program (or a failure's note)."""
    start = time.perf_counter()
    root = cache / "cpu-steps"
    while not any(root.glob("*.pt2")):
        if any(root.glob("*.failed")):
            raise RuntimeError("the build failed: " + next(root.glob("*.failed")).read_text())
        time.sleep(0.5)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="m3lm-first-runs-"))
    try:
        load = os.getloadavg()
        eager0 = run(cache / "unused", a.max_tokens, ["--compile", "off"])  # a warm file cache for both
        first = run(cache, a.max_tokens, [])
        built = wait_for_programs(cache)
        later, eager = [], []
        for r in range(a.rounds):
            pair = [("later", []), ("eager", ["--compile", "off"])]
            for name, extra in pair if r % 2 == 0 else pair[::-1]:
                (later if name == "later" else eager).append(run(cache, a.max_tokens, extra))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    texts = {x["text"] for x in [eager0, first, *later, *eager]}
    med = {k: {f: statistics.median(x[f] for x in runs) for f in ("ttft", "wall", "tps")}
           for k, runs in (("later", later), ("eager", eager))}  # fmt: skip
    lines = [
        f"## {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}",
        "",
        f"Command: `python3 benchmarks/cpu/first_runs.py --rounds {a.rounds} --max-tokens {a.max_tokens}`",
        "",
        f"Device: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"Python {platform.python_version()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start",
        "",
        "| run | time to first token s | wall s | decode tok/s |",
        "|---|---|---|---|",
        f"| first run (empty programs folder) | {first['ttft']:.2f} | {first['wall']:.2f} | {first['tps']:.1f} |",
        *(
            f"| {k} (median of {a.rounds}) | {m['ttft']:.2f} | {m['wall']:.2f} | {m['tps']:.1f} |"
            for k, m in (("later runs", med["later"]), ("`--compile off`", med["eager"]))
        ),
        "",
        f"- First run announced its build: {first['announced']}; its extra wait over op by op: "
        f"{first['wall'] - med['eager']['wall']:+.2f} s (wall); the build landed {built:.0f} s after it exited.",
        f"- Later runs: decode {med['later']['tps'] / med['eager']['tps']:.2f}x op by op; time to first token "
        f"{med['later']['ttft'] / med['eager']['ttft']:.2f}x op by op's.",
        f"- Every run's text identical: {len(texts) == 1}.",
        "- Each round's later / op-by-op time to first token: "
        + " ".join(f"{x['ttft']:.2f}/{y['ttft']:.2f}" for x, y in zip(later, eager, strict=True)),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        head = "# `m3lm generate` on the CPU: first run, later runs, op by op\n\n"
        a.out.write_text(head + text)


if __name__ == "__main__":
    main()
