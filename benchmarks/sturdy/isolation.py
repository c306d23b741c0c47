"""No client harms another: a plain client's latency while others abuse the shared resources.

One `m3lm serve` (the embedded story model unless `--model`, with two API keys: the probe's,
and the abusive traffic's) is probed by a
client sending a plain chat completion (`--probe-tokens` greedy tokens) and `/health`, first on
the idle server, then while each class of abusive traffic runs, one class at a time:

- `schemas`: requests whose JSON schemas each hold a pattern near the repetition bound (each
  check costs milliseconds), every one different, sent and abandoned;
- `compiles`: requests with regexes whose compile against the vocabulary is costly, every one
  different, sent and abandoned;
- `logprobs`: completions asking for a reply as large as the bound on prompt logprobs allows
  (echo with 20 logprobs and prompt_logprobs 20, n 4), sent and abandoned;
- `bodies`: key-less connections announcing a body to /health and trickling it;
- `headers`: key-less connections sending unfinished headers.

The first three send `--requests` requests at once, each abandoned after `--abandon-s`; the key-less
floods open `--connections` sockets. Reported per class: the probe's median completion time and
its ratio to the idle one, the slowest `/health`, and for the floods the HTTP process's resident
memory before and after (the sockets closed). Targets (issue "No client harms another"): ratio at
most 2, /health within 1 s, memory back within 100 MiB.

    python3 benchmarks/sturdy/isolation.py --out benchmarks/results/isolation.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # serve_bench
from serve_bench import REPO, Server, commit

from m3lm.bench.report import machine, write_section

KEY, OTHER = "sk-isolation", "sk-isolation-abuser"  # the probe's key; the abusive traffic's
AUTH = {"Authorization": f"Bearer {KEY}"}
STORY = REPO / "m3lm" / "assets" / "story"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Probe:
    """The well-behaved client: plain chat completions in turn, and /health every 100 ms."""

    def __init__(self, url: str, tokens: int):
        self.url, self.tokens = url, tokens
        self.health: list[float] = []
        self.refused: list[int] = []  # the probe's statuses other than 200
        self._stop = threading.Event()

    def chat_s(self) -> float:
        body = {
            "model": "story", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": self.tokens, "temperature": 0, "ignore_eos": True,
        }  # fmt: skip
        t = time.perf_counter()
        r = httpx.post(self.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=600)
        if r.status_code != 200:
            self.refused.append(r.status_code)
            return float("inf")
        return time.perf_counter() - t

    def _ping(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                httpx.get(self.url + "/health", timeout=30).raise_for_status()
                self.health.append(time.perf_counter() - t)
            except httpx.HTTPError:
                self.health.append(float("inf"))
            self._stop.wait(0.1)

    def during(self, load, rounds: int) -> tuple[float, float]:
        """(median probe seconds, slowest /health seconds) while `load()` runs in a thread (a
        refused probe counts as infinitely slow, its status kept in `refused`)."""
        self.health, self.refused, self._stop = [], [], threading.Event()
        pinger = threading.Thread(target=self._ping, daemon=True)
        worker = threading.Thread(target=load, daemon=True)
        pinger.start()
        worker.start()
        time.sleep(0.2)  # the load under way
        times = [self.chat_s() for _ in range(rounds)]
        worker.join(600)
        self._stop.set()
        pinger.join(30)
        return statistics.median(times), max(self.health, default=float("nan"))


async def abandoned(url: str, path: str, bodies: list[dict], abandon_s: float) -> None:
    """Send every body at once, each given up after `abandon_s` (the connection closed)."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
    abuser = {"Authorization": f"Bearer {OTHER}"}
    async with httpx.AsyncClient(headers=abuser, limits=limits, timeout=abandon_s) as client:

        async def one(body):
            with contextlib.suppress(httpx.HTTPError):  # given up, as a client that goes away
                await client.post(url + path, json=body)

        await asyncio.gather(*(one(b) for b in bodies))


def schema_bodies(n: int) -> list[dict]:
    out = []
    for i in range(n):
        pattern = f"({chr(97 + i % 26)}[a-z]{{15}}){{{240 + i % 16}}}"  # near the product bound
        schema = {
            "type": "object",
            "properties": {"s": {"type": "string", "pattern": pattern}, f"k{i}": {"type": "integer"}},
        }
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        out.append(
            {
                "model": "story",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "response_format": rf,
            }
        )
    return out


def compile_bodies(n: int) -> list[dict]:
    return [
        {
            "model": "story",
            "prompt": "Once",
            "max_tokens": 4,
            "structured_outputs": {"regex": f"[a-z ]{{0,{200 + i % 56}}}x{i}"},
        }
        for i in range(n)
    ]


def logprob_bodies(n: int, prompt: list[int]) -> list[dict]:
    return [
        {
            "model": "story",
            "prompt": prompt,
            "max_tokens": 1,
            "echo": True,
            "logprobs": 20,
            "n": 4,
            "prompt_logprobs": 20,
        }
        for _ in range(n)
    ]


def flood(url: str, count: int, payload: bytes, hold_s: float) -> None:
    """`count` key-less sockets each sending `payload` then a byte a second for `hold_s`."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(count):
        try:
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(payload)
            socks.append(s)
        except OSError:
            pass
    end = time.monotonic() + hold_s
    while time.monotonic() < end:
        for s in socks:
            with contextlib.suppress(OSError):
                s.send(b"x")
        time.sleep(1)
    for s in socks:
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(STORY))
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--abandon-s", type=float, default=0.5)
    ap.add_argument("--probe-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="probe requests during each class")
    ap.add_argument("--classes", nargs="+", default=["schemas", "compiles", "logprobs", "bodies", "headers"])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    server = Server(a.model, f"{KEY},{OTHER}", ["--max-model-len", "2048"])
    rows = []
    try:
        server.wait_healthy(time.monotonic() + 300)
        url, pid = server.url, server.proc.pid
        probe = Probe(url, a.probe_tokens)
        probe.chat_s()  # warm
        idle, idle_health = probe.during(lambda: None, a.rounds)
        rows.append(("idle", idle, idle_health, None))
        prompt = httpx.post(
            url + "/tokenize", json={"prompt": "Once upon a time " * 200}, headers=AUTH
        ).json()["tokens"]
        prompt = prompt[: 262_144 // (42 * 4)]  # within the bound on prompt logprobs
        loads = {
            "schemas": lambda: asyncio.run(
                abandoned(url, "/v1/chat/completions", schema_bodies(a.requests), a.abandon_s)
            ),
            "compiles": lambda: asyncio.run(
                abandoned(url, "/v1/completions", compile_bodies(a.requests), a.abandon_s)
            ),
            "logprobs": lambda: asyncio.run(
                abandoned(url, "/v1/completions", logprob_bodies(a.requests, prompt), a.abandon_s)
            ),
            "bodies": lambda: flood(
                url, a.connections, b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n", 5
            ),
            "headers": lambda: flood(
                url, a.connections, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"y" * 30_000, 5
            ),
        }
        for name in a.classes:
            before = rss_mib(pid)
            median, health = probe.during(loads[name], a.rounds)
            time.sleep(3)  # the closed sockets' buffers go back
            memory = (before, rss_mib(pid)) if name in ("bodies", "headers") else None
            rows.append(
                (
                    name + (f" (probe refused: {probe.refused})" if probe.refused else ""),
                    median,
                    health,
                    memory,
                )
            )
            print(
                name,
                f"{median * 1e3:.0f} ms ({median / idle:.2f}x), /health max {health * 1e3:.0f} ms",
                memory,
                flush=True,
            )
    finally:
        server.stop()
    lines = [
        "| traffic | probe chat median (ms) | x idle | slowest /health (ms) | HTTP process RSS before -> after (MiB) |",
        "|---|---:|---:|---:|---|",
    ]
    for name, median, health, memory in rows:
        mem = f"{memory[0]:.0f} -> {memory[1]:.0f} ({memory[1] - memory[0]:+.0f})" if memory else "-"
        lines.append(f"| {name} | {median * 1e3:.0f} | {median / idle:.2f} | {health * 1e3:.0f} | {mem} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        setup = (
            f"Server: `m3lm serve --model {a.model} --api-key PROBE,ABUSER --max-model-len 2048`; probe: a chat completion "
            f"of {a.probe_tokens} greedy tokens, {a.rounds} in turn per class, and /health every 100 ms; "
            f"{a.requests} requests a class, each abandoned after {a.abandon_s:g} s; floods of {a.connections} "
            "key-less sockets held 5 s."
        )
        device = f"Device: {machine()}; at {commit(REPO)}"
        write_section(a.out, "No client harms another", " ".join(sys.argv), [setup, device], text)


if __name__ == "__main__":
    main()
