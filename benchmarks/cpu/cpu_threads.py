"""Decode speed on a CPU that other processes keep busy: `m3lm generate` and `m3lm serve`.

Starts `--busy` processes that spin (`while 1: pass`), then, for each setting, runs
`m3lm generate` on the embedded model (greedy, `--max-tokens` tokens, EOS ignored) and reads its
generation tok/s; and starts `m3lm serve` and streams one completion of the same length with
httpx, timing the tokens from the first to the last. Each figure is the median of `--repeats`
runs. The settings: the defaults, `--threads 1`, `--threads 2`, and `--threads 2` with
`OMP_WAIT_POLICY=ACTIVE` (OpenMP's spinning wait, what a process gets when nobody sets it).

    python3 benchmarks/cpu/cpu_threads.py --busy 2 --out benchmarks/results/cpu_threads.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from m3lm.bench.report import machine, write_section

SETTINGS = {  # name: (extra flags, extra environment)
    "default": ([], {}),
    "--threads 1": (["--threads", "1"], {}),
    "--threads 2": (["--threads", "2"], {}),
    "--threads 2, OMP_WAIT_POLICY=ACTIVE": (["--threads", "2"], {"OMP_WAIT_POLICY": "ACTIVE"}),
}


def m3lm(*args: str) -> list[str]:
    return [sys.executable, "-m", "m3lm", *args]


def generate_tps(flags: list[str], env: dict, tokens: int) -> float:
    argv = m3lm("generate", "--prompt", "Once upon a time", "--max-tokens", str(tokens))
    argv += ["--temperature", "0", "--ignore-eos", "--device", "cpu", *flags]
    r = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env}, check=True)
    return float(re.search(r"generation: \d+ tokens, ([\d.]+) tok/s", r.stderr).group(1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_tps(flags: list[str], env: dict, tokens: int, repeats: int) -> list[float]:
    port = free_port()
    argv = m3lm("serve", "--port", str(port), "--device", "cpu", *flags)
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"m3lm serve exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("m3lm serve did not start")
            time.sleep(0.5)
        body = {"model": "story", "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        out = []
        for _ in range(repeats):
            stamps = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        stamps.append(time.perf_counter())
            out.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        return out
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=2, help="processes that spin while it measures")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.busy)]
    try:
        time.sleep(1)
        gen = {name: [] for name in SETTINGS}
        for _ in range(args.repeats):  # interleaved, so that a change in the machine's load hits all
            for name, (flags, env) in SETTINGS.items():
                gen[name].append(generate_tps(flags, env, args.tokens))
                print(f"generate {name}: {gen[name][-1]:.1f} tok/s", flush=True)
        srv = {}
        for name in ("default", "--threads 1"):
            flags, env = SETTINGS[name]
            srv[name] = serve_tps(flags, env, args.tokens, args.repeats)
            print(f"serve {name}: {srv[name]}", flush=True)
    finally:
        for p in busy:
            p.kill()
    one = statistics.median(gen["--threads 1"])
    rows = [
        "| command | setting | tok/s (median) | runs | x `generate --threads 1` |",
        "|---|---|---|---|---|",
    ]
    for name, v in gen.items():
        med = statistics.median(v)
        rows.append(
            f"| generate | {name} | {med:.1f} | {', '.join(f'{x:.1f}' for x in v)} | {med / one:.2f} |"
        )
    for name, v in srv.items():
        med = statistics.median(v)
        rows.append(
            f"| serve (one stream) | {name} | {med:.1f} | {', '.join(f'{x:.1f}' for x in v)} | {med / one:.2f} |"
        )
    table = "\n".join(rows)
    print(table)
    if args.out:
        write_section(
            args.out,
            "Decode on a busy CPU",
            "python3 benchmarks/cpu/cpu_threads.py " + " ".join(sys.argv[1:]),
            [
                f"Device: {machine()}",
                f"{args.busy} spinning processes beside it; the embedded model, greedy, "
                f"{args.tokens} tokens, EOS ignored; OMP_WAIT_POLICY as set by m3lm unless the row says",
            ],
            table,
        )


if __name__ == "__main__":
    main()
