"""Stress: more clients than slots, hang-ups and one huge prompt against `m3lm serve`; nothing stalls.

Starts `python -m m3lm serve` (the embedded default model, or `--model DIR`) with `--max-num-seqs`
slots (4) on a free loopback port, warms it with one request, records its RSS, then starts
`--clients` (48) clients at once, each with one request drawn from a seeded stream:

- streamed and whole chat and text completions with `ignore_eos` and a random `max_tokens`
  (so the full token count is known), through the real keep-alive setting;
- `--hangups` of them (8) disconnect: half mid-stream, half while a whole reply is pending;
- one sends a 7 MiB prompt, which must be refused (400) without stalling anyone.

Checks: every request that was not abandoned completes with its full token count and a finish
reason; no stream's gap between two tokens exceeds `--max-gap-s` (2 s); afterwards
`m3lm:num_requests_running` is 0, the KV cache is empty, and RSS is within `--rss-tolerance-mb`
(200) of where it started. Run from the repository root:

    python3 benchmarks/sturdy/server_stress.py --out benchmarks/results/server_stress.md

It prints a Markdown report; `--out` writes it, with the command, date and device. The exit status
is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # serve_bench
from serve_bench import Server, scrape

from m3lm.bench.report import machine, write_section


@dataclass
class Outcome:
    kind: str
    expected: int = 0
    tokens: int = 0
    finish: str | None = None
    status: int = 0
    gaps: list[float] = field(default_factory=list)
    abandoned: bool = False
    error: str = ""
    seconds: float = 0.0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def streamed(client, path: str, body: dict, out: Outcome, hang_after: int | None) -> None:
    last = None
    async with client.stream("POST", path, json=body) as r:
        out.status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]["message"]
                continue
            for c in event.get("choices", []):
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if piece:
                    now = time.monotonic()
                    if last is not None:
                        out.gaps.append(now - last)
                    last = now
                out.finish = c.get("finish_reason") or out.finish
            if event.get("usage"):
                out.tokens = event["usage"]["completion_tokens"]
            if hang_after is not None and len(out.gaps) >= hang_after:
                out.abandoned = True
                return  # leaving the block closes the connection


async def whole(client, path: str, body: dict, out: Outcome, hang_after_s: float | None) -> None:
    try:
        r = await client.post(path, json=body, timeout=hang_after_s or 300)
    except httpx.ReadTimeout:
        if hang_after_s is None:
            raise
        out.abandoned = True
        return
    out.status = r.status_code
    data = r.json()
    if r.status_code != 200:
        out.error = data["error"]["message"]
        return
    out.tokens = data["usage"]["completion_tokens"]
    out.finish = data["choices"][0]["finish_reason"]


async def one(client, rng: random.Random, i: int, a, huge: bool) -> Outcome:
    chat, stream = rng.random() < 0.5, rng.random() < 0.6
    n = rng.randint(16, 96)
    kind = f"{'chat' if chat else 'text'}{'_stream' if stream else ''}"
    if huge:
        kind, n, chat, stream = "huge_prompt", 0, False, False
    out = Outcome(kind, expected=n)
    body: dict = {"max_tokens": max(n, 1), "ignore_eos": True, "temperature": 1.0, "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": f"tell me story number {i}"}]
    else:
        body["prompt"] = ("once upon a time " * (7 << 16)) if huge else f"story {i}: once upon a time"
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    hang = i < a.hangups
    t0 = time.monotonic()
    try:
        if stream:
            await streamed(client, path, body, out, rng.randint(2, 8) if hang else None)
        else:
            await whole(client, path, body, out, rng.uniform(0.3, 2.0) if hang else None)
    except Exception as e:  # a failed request is a failed check, not a crash of the benchmark
        out.error = f"{type(e).__name__}: {e}"
    out.seconds = time.monotonic() - t0
    return out


async def run(a, url: str) -> list[Outcome]:
    rng = random.Random(a.seed)
    limits = httpx.Limits(max_connections=a.clients + 4, max_keepalive_connections=a.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits, trust_env=False) as client:
        seeds = [random.Random(rng.random()) for _ in range(a.clients)]
        huge_at = a.clients // 2  # starts among the others, while streams run
        return await asyncio.gather(*(one(client, seeds[i], i, a, i == huge_at) for i in range(a.clients)))


def check(outcomes: list[Outcome], a) -> list[str]:
    failures = []
    for i, o in enumerate(outcomes):
        if o.kind == "huge_prompt":
            if o.status != 400:
                failures.append(f"client {i}: the 7 MiB prompt got {o.status} {o.error[:80]}")
            continue
        if o.abandoned:
            continue
        if o.error or o.status != 200:
            failures.append(f"client {i} ({o.kind}): {o.status} {o.error[:120]}")
        elif o.tokens != o.expected or o.finish is None:
            failures.append(f"client {i} ({o.kind}): {o.tokens}/{o.expected} tokens, finish {o.finish}")
        if o.gaps and max(o.gaps) > a.max_gap_s:
            failures.append(f"client {i} ({o.kind}): a {max(o.gaps):.2f} s gap between tokens")
    return failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--hangups", type=int, default=8)
    p.add_argument("--max-gap-s", type=float, default=2.0)
    p.add_argument("--rss-tolerance-mb", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    from m3lm import DEFAULT_MODEL

    model = a.model or str(DEFAULT_MODEL)
    server = Server(model, None, ["--max-num-seqs", str(a.slots)])
    try:
        server.wait_healthy(time.monotonic() + 180)
        with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as c:
            c.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 8})
            rss0 = rss_mb(server.proc.pid)
            t0 = time.monotonic()
            outcomes = asyncio.run(run(a, server.url))
            wall = time.monotonic() - t0
            deadline = time.monotonic() + 30
            while (m := scrape(c))["m3lm:num_requests_running"] or m["m3lm:kv_cache_usage_perc"]:
                if time.monotonic() > deadline:
                    break
                c.post("/v1/completions", json={"prompt": "probe", "max_tokens": 1})  # gauges follow steps
                time.sleep(0.5)
            rss1 = rss_mb(server.proc.pid)
    finally:
        server.stop()
    failures = check(outcomes, a)
    if m["m3lm:num_requests_running"] or m["m3lm:kv_cache_usage_perc"]:
        failures.append(f"not idle afterwards: {m}")
    if rss1 - rss0 > a.rss_tolerance_mb:
        failures.append(f"RSS grew {rss1 - rss0:.0f} MiB")
    gaps = sorted(g for o in outcomes for g in o.gaps)
    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    huge = next(o for o in outcomes if o.kind == "huge_prompt")
    rows = [
        "| measure | value |",
        "|---|---|",
        f"| clients / slots / hang-ups | {a.clients} / {a.slots} / {sum(o.abandoned for o in outcomes)} |",
        f"| kinds | {', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))} |",
        f"| completed with full token count | {sum(1 for o in outcomes if o.kind != 'huge_prompt' and not o.abandoned and not o.error and o.tokens == o.expected)} of {sum(1 for o in outcomes if o.kind != 'huge_prompt' and not o.abandoned)} |",
        f"| 7 MiB prompt | {huge.status} in {huge.seconds:.2f} s |",
        f"| gap between tokens: median / p99 / max (s) | {gaps[len(gaps) // 2]:.3f} / {gaps[int(len(gaps) * 0.99)]:.3f} / {gaps[-1]:.3f} |",
        f"| afterwards: running / KV usage | {m['m3lm:num_requests_running']:g} / {m['m3lm:kv_cache_usage_perc']:g} |",
        f"| RSS before / after (MiB) | {rss0:.0f} / {rss1:.0f} ({rss1 - rss0:+.0f}) |",
        f"| wall (s) | {wall:.1f} |",
        f"| checks | {'all passed' if not failures else '; '.join(failures[:6])} |",
    ]
    body = "\n".join(rows)
    print(body)
    if a.out:
        command = "python3 benchmarks/sturdy/server_stress.py " + shlex.join(sys.argv[1:])
        write_section(
            a.out,
            "Server stress: clients over slots, hang-ups, a huge prompt",
            command,
            [f"Device: {machine()}", f"Model: {model}"],
            body,
        )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
