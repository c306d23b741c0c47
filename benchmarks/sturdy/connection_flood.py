"""Connection flood: sockets trickling bytes after a 401, and idle sockets, do not lock out a client
that has the key.

Starts `python -m m3lm serve --api-key KEY` (the embedded default model, or `--model DIR`) on a
free loopback port, then keeps open, for the whole run:

- `--tricklers` (1000) connections that send a request without the key announcing a large body,
  read the 401, then send a byte every second for as long as the server keeps the connection; a
  second after the server has closed one, it is opened again and begins again;
- `--idle` (1000) connections that send nothing, opened again whenever the server closes one.

Once they are all open, an authenticated client sends a request every `--every-s` (0.5 s) for
`--seconds` (30 s), each on a new connection: alternately a two-token completion and /health.
Each is timed from connecting to the last byte of the answer. The same client runs for
`--seconds` before the flood too, so that what the machine itself costs (other load on shared
cores) is on record beside it. Check: every request during the flood is answered 200 within
`--max-s` (2 s). Also reported: how long the server kept a trickling connection after its 401,
how long it kept an idle one, and how often the flood had to reconnect. Run from the repository root:

    python3 benchmarks/sturdy/connection_flood.py --out benchmarks/results/connection_flood.md

It prints a Markdown report; `--out` writes it, with the command, date and device. The exit status
is 1 when the check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import resource
import shlex
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # serve_bench
from serve_bench import Server

from m3lm.bench.report import machine, write_section

KEY = "sk-flood-bench"
DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "m3lm" / "assets" / "story")


@dataclass
class Flood:
    opened: Counter = field(default_factory=Counter)  # connections opened, by kind
    refused: Counter = field(default_factory=Counter)  # connect() errors, by kind
    statuses: Counter = field(default_factory=Counter)  # what the tricklers' requests got
    held_after_refusal: list[float] = field(default_factory=list)  # s from the 401 to the close
    idle_lifetime: list[float] = field(default_factory=list)  # s from opening to the server's close
    live: Counter = field(default_factory=Counter)  # connections open now, by kind


async def trickler(port: int, flood: Flood, stop: asyncio.Event) -> None:
    """One step a second: connect and send headers, then a byte of body a step, until the server
    has closed the connection; then connect again."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000\r\n\r\n"
    )
    await asyncio.sleep(random.random())  # each socket its own phase within the second
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            flood.refused["trickle"] += 1
            await asyncio.sleep(1.0)
            continue
        flood.opened["trickle"] += 1
        flood.live["trickle"] += 1
        answered = None
        try:
            writer.write(head)
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), 60)
            flood.statuses[status_line.split(b" ")[1].decode()] += 1
            answered = time.monotonic()
            while not stop.is_set() and not writer.is_closing():
                await asyncio.sleep(1.0)
                writer.write(b"x")  # whether or not the server still reads
                await writer.drain()
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            flood.live["trickle"] -= 1
            if answered is not None and not stop.is_set():
                flood.held_after_refusal.append(time.monotonic() - answered)
            writer.close()
        await asyncio.sleep(1.0)


async def idler(port: int, flood: Flood, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            flood.refused["idle"] += 1
            await asyncio.sleep(0.2)
            continue
        flood.opened["idle"] += 1
        flood.live["idle"] += 1
        opened = time.monotonic()
        try:
            reading = asyncio.ensure_future(reader.read())  # returns when the server closes it
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if reading.done() and not stop.is_set():
                flood.idle_lifetime.append(time.monotonic() - opened)
            reading.cancel()
            stopping.cancel()
        except OSError:
            pass
        finally:
            flood.live["idle"] -= 1
            writer.close()


def run_flood(port: int, a: argparse.Namespace, ready, done, results) -> None:
    """The flood, in a process of its own (so that it takes nothing from the measuring client's
    interpreter), until `done` is set; then its figures go into `results`."""
    flood = Flood()

    async def main() -> None:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(trickler(port, flood, stop)) for _ in range(a.tricklers)]
        tasks += [asyncio.create_task(idler(port, flood, stop)) for _ in range(a.idle)]
        while flood.opened["trickle"] < a.tricklers or flood.opened["idle"] < a.idle:
            await asyncio.sleep(0.05)
        ready.set()
        while not done.is_set():
            await asyncio.sleep(0.1)
        live = dict(flood.live)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        flood.live = Counter(live)  # as it was when the measuring ended

    asyncio.run(main())
    results.put(flood)


def measure(url: str, a: argparse.Namespace) -> list[tuple[str, int | str, float]]:
    """The authenticated client: (route, status or error, seconds) per request."""
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "Once upon a time", "max_tokens": 2}
    out = []
    end = time.monotonic() + a.seconds
    i = 0
    while time.monotonic() < end:
        route = "/v1/completions" if i % 2 == 0 else "/health"
        t0 = time.monotonic()
        try:
            with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:  # a new connection
                r = c.post(route, json=body, headers=auth) if i % 2 == 0 else c.get(route)
                status: int | str = r.status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        out.append((route, status, time.monotonic() - t0))
        i += 1
        time.sleep(max(0.0, a.every_s - (time.monotonic() - t0)))
    return out


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) >= 2 else (xs[0] if xs else float("nan"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tricklers", type=int, default=1000)
    p.add_argument("--idle", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--every-s", type=float, default=0.5)
    p.add_argument("--max-s", type=float, default=2.0)
    p.add_argument("--server-args", default="", help="more `m3lm serve` arguments")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    need = a.tricklers + a.idle + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))

    server = Server(a.model, KEY, shlex.split(a.server_args))
    ctx = multiprocessing.get_context("spawn")
    ready, done, out = ctx.Event(), ctx.Event(), ctx.Queue()
    try:
        server.wait_healthy(time.monotonic() + 300)
        port = int(server.url.rsplit(":", 1)[1])
        quiet = measure(server.url, a)
        flooding = ctx.Process(target=run_flood, args=(port, a, ready, done, out), daemon=True)
        flooding.start()
        if not ready.wait(120):
            raise RuntimeError("the flood could not open its connections")
        t0 = time.monotonic()
        results = measure(server.url, a)
        wall = time.monotonic() - t0
        done.set()
        flood: Flood = out.get(timeout=120)
        flooding.join(60)
    finally:
        server.stop()
    live = dict(flood.live)

    ok = [s for _, st, s in results if st == 200]
    slow_or_failed = [(r, st, round(s, 2)) for r, st, s in results if st != 200 or s > a.max_s]
    passed = not slow_or_failed and bool(results)
    times = [s for _, _, s in results]
    statuses = Counter(str(st) for _, st, _ in results)
    held = flood.held_after_refusal
    calm = [s for _, _, s in quiet]
    rows = [
        (
            "before the flood: requests, statuses, median / max time (s)",
            f"{len(quiet)}, "
            + ", ".join(f"{k}: {v}" for k, v in sorted(Counter(str(st) for _, st, _ in quiet).items()))
            + f", {pct(calm, 50):.3f} / {max(calm):.3f}",
        ),
        *(
            (f"  {route} before the flood: median / max (s)", f"{pct(ts, 50):.3f} / {max(ts):.3f}")
            for route in ("/v1/completions", "/health")
            if (ts := [s for r, _, s in quiet if r == route])
        ),
        ("flood: trickling after a refusal / idle", f"{a.tricklers} / {a.idle}"),
        (
            "flood connections open at the end (trickling / idle)",
            f"{live.get('trickle', 0)} / {live.get('idle', 0)}",
        ),
        (
            "flood connections opened in all (trickling / idle)",
            f"{flood.opened['trickle']} / {flood.opened['idle']}",
        ),
        ("flood connect errors", f"{sum(flood.refused.values())}"),
        (
            "what the trickling requests got",
            ", ".join(f"{k}: {v}" for k, v in sorted(flood.statuses.items())),
        ),
        (
            "a trickling connection kept after its refusal: median / max (s)",
            f"{pct(held, 50):.2f} / {max(held, default=float('nan')):.2f}" if held else "never closed",
        ),
        (
            "an idle connection kept: median / max (s)",
            f"{pct(flood.idle_lifetime, 50):.2f} / {max(flood.idle_lifetime):.2f}"
            if flood.idle_lifetime
            else "never closed",
        ),
        ("authenticated requests (completion, /health alternately)", f"{len(results)} in {wall:.1f} s"),
        ("their statuses", ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))),
        (
            "their time, connect to answer: median / p99 / max (s)",
            f"{pct(times, 50):.3f} / {pct(times, 99):.3f} / {max(times):.3f}",
        ),
        *(
            (f"  {route}: median / max (s)", f"{pct(ts, 50):.3f} / {max(ts):.3f}")
            for route in ("/v1/completions", "/health")
            if (ts := [s for r, _, s in results if r == route])
        ),
        ("answered 200 within the bound", f"{len(ok) - sum(1 for s in ok if s > a.max_s)} of {len(results)}"),
        (
            "check: all answered 200 within " + f"{a.max_s:g} s",
            "passed" if passed else f"FAILED {slow_or_failed[:10]}",
        ),
    ]
    body = "| measure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    print(body)
    if a.out:
        command = "python3 " + " ".join(shlex.quote(x) for x in sys.argv)
        write_section(
            a.out,
            "Connection flood: tricklers after a 401 and idle sockets against an authenticated client",
            command,
            [f"Device: {machine()}", f"Model: {a.model}"],
            body,
        )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
