"""Soak test: a bounded run of mixed, partly aborted traffic against `m3lm serve`; no leaks, no bad replies.

Starts `python -m m3lm serve` (the embedded default model, or `--model DIR`) on a free 127.0.0.1
port, waits for /health, then runs `--concurrency` client loops (32) for `--minutes` (3). Each
loop draws, from its own seeded random stream, one request at a time of these kinds:

- `chat_stream`, `chat`, `text_stream`, `text`: chat and text completions, streamed or whole,
  with random max_tokens, temperature, ignore_eos, logprobs and include_usage;
- `abort_stream`: a streamed request closed by the client after a random number of chunks;
- `abort_prefill`: a long prompt (1,200 to 1,900 tokens), closed within 1 s, before any chunk;
- `bad`: an invalid request that must get its 4xx and an OpenAI error object.

Every reply is checked: ids, object, model, choices, finish_reason, usage (prompt tokens as
/tokenize counts them, total = prompt + completion, completion = max_tokens where ignore_eos or
finish_reason "length", one logprob per completion token), SSE chunks (role first, usage null
but in the final usage chunk, one finishing chunk, `data: [DONE]` last). Any 5xx, error event,
malformed reply or request timeout counts as an error.

Every `--sample-every` seconds it records the server's RSS (VmRSS of /proc/PID/status) and the
`/metrics` gauges (KV-cache usage, running, waiting) and the prefix cache's counters (prompt
tokens found cached, prompt tokens admitted). At the end it waits for the server to go
idle, sends one small probe request (the gauges are published after engine steps), and checks
that KV usage is back to 0; that the median RSS of the last minute exceeds the median of the
first minute after `--warmup` by at most `--rss-tolerance-mb`; then stops the server with
SIGTERM and checks that it exits cleanly with no traceback in its log. Loopback only, bounded
(fixed duration, per-request timeouts). Run from the repository root:

    python3 benchmarks/sturdy/soak.py --minutes 3 --out benchmarks/results/soak.md

It prints a Markdown report; `--out` writes it, with the command, date, device and versions.
The exit status is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shlex
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # serve_bench
from serve_bench import REPO, Server, percentile, scrape

from m3lm.bench.report import machine, write_section

MIX = {
    "chat_stream": 20,
    "chat": 14,
    "text_stream": 18,
    "text": 12,
    "abort_stream": 16,
    "abort_prefill": 10,
    "bad": 10,
}
WORDS = ["little", "cat", "dog", "bird", "tree", "garden", "ball", "sun", "rain", "friend", "happy"]
WORDS += ["big", "small", "red", "blue", "mom", "dad", "park", "toy", "cake", "river", "hill", "house"]
NAMES = ["Lily", "Tim", "Sue", "Ben", "Mia", "Max", "Anna", "Tom"]
GAUGES = {"kv": "m3lm:kv_cache_usage_perc", "running": "m3lm:num_requests_running"}
GAUGES["waiting"] = "m3lm:num_requests_waiting"
GAUGES["cache_hits"] = "m3lm:prefix_cache_hits_total"  # prompt tokens found in the prefix cache
GAUGES["cache_queries"] = "m3lm:prefix_cache_queries_total"


class Malformed(Exception):
    pass


def need(cond: object, what: str) -> None:
    if not cond:
        raise Malformed(what)


@dataclass
class Outcome:
    kind: str
    error: str
    seconds: float


class Soak:
    def __init__(self, a: argparse.Namespace, url: str, pid: int):
        self.a, self.url, self.pid = a, url, pid
        self.sync = httpx.Client(base_url=url, timeout=30, trust_env=False)
        card = self.sync.get("/v1/models").raise_for_status().json()["data"][0]
        self.model, self.max_len = card["id"], card["max_model_len"]
        rng = random.Random(a.seed)
        self.chat_prompts, self.text_prompts, self.long_prompts = [], [], []
        for i in range(16):
            who, w1, w2 = NAMES[i % len(NAMES)], rng.choice(WORDS), rng.choice(WORDS)
            msgs = [{"role": "user", "content": f"Tell me a story about {who}, a {w1} and a {w2}."}]
            n = self.sync.post("/tokenize", json={"messages": msgs}).raise_for_status().json()["count"]
            self.chat_prompts.append((msgs, n))
            text = f"Once upon a time, {who} saw a {w1} {w2}."
            n = self.sync.post("/tokenize", json={"prompt": text}).raise_for_status().json()["count"]
            self.text_prompts.append((text, n))
        text = " ".join(rng.choice(WORDS) for _ in range(3000))
        pool = sorted(set(self.sync.post("/tokenize", json={"prompt": text}).json()["tokens"]))
        for _ in range(8):
            self.long_prompts.append([rng.choice(pool) for _ in range(rng.randint(1200, 1900))])
        self.outcomes: list[Outcome] = []
        self.samples: list[dict] = []  # t (s since the load started), rss (MB), kv, running, waiting

    # --- requests ------------------------------------------------------------------------------

    def body(self, rng: random.Random, chat: bool, stream: bool) -> tuple[dict, int]:
        prompt, n = rng.choice(self.chat_prompts if chat else self.text_prompts)
        b: dict = {"model": self.model, "max_tokens": rng.randint(1, 96), "stream": stream}
        b["messages" if chat else "prompt"] = prompt
        b["temperature"] = rng.choice([0.0, 0.7, 1.0])
        if rng.random() < 0.5:
            b["ignore_eos"] = True
        if rng.random() < 0.3:
            b.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
        if stream and rng.random() < 0.8:
            b["stream_options"] = {"include_usage": True}
        return b, n

    def check_usage(self, u: dict, b: dict, n: int, finish: str, logprobs: int, pieces: int) -> None:
        c = u["completion_tokens"]
        need(u["prompt_tokens"] == n, f"prompt_tokens {u['prompt_tokens']}, /tokenize counts {n}")
        need(u["total_tokens"] == n + c, f"total_tokens {u['total_tokens']} != {n} + {c}")
        need(0 < c <= b["max_tokens"], f"completion_tokens {c} for max_tokens {b['max_tokens']}")
        if finish == "length" or b.get("ignore_eos"):
            need(c == b["max_tokens"] and finish == "length", f"{c} tokens, {finish!r}, ignore_eos")
        if b.get("logprobs"):
            need(logprobs == c, f"{logprobs} logprob entries for {c} completion tokens")
        need(pieces <= c, f"{pieces} text chunks for {c} completion tokens")

    def check_head(self, r: dict, obj: str, chat: bool) -> None:
        need(r["id"].startswith("chatcmpl-" if chat else "cmpl-"), f"id {r['id']!r}")
        need(r["object"] == obj and r["model"] == self.model, f"object/model {r['object']}/{r['model']}")
        need(isinstance(r["created"], int), "created is not an integer")

    async def whole(self, c: httpx.AsyncClient, rng: random.Random, chat: bool) -> None:
        b, n = self.body(rng, chat, False)
        resp = await c.post("/v1/chat/completions" if chat else "/v1/completions", json=b)
        need(resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text[:160]}")
        r = resp.json()
        self.check_head(r, "chat.completion" if chat else "text_completion", chat)
        need(len(r["choices"]) == 1 and r["choices"][0]["index"] == 0, "choices")
        ch = r["choices"][0]
        need(ch["finish_reason"] in ("stop", "length"), f"finish_reason {ch['finish_reason']!r}")
        if chat:
            msg = ch["message"]
            need(msg["role"] == "assistant" and isinstance(msg["content"], str), f"message {msg}")
            lps = len((ch["logprobs"] or {}).get("content") or [])
        else:
            need(isinstance(ch["text"], str), "text is not a string")
            lps = len((ch["logprobs"] or {}).get("tokens") or [])
        self.check_usage(r["usage"], b, n, ch["finish_reason"], lps, 0)

    async def stream(self, c, rng: random.Random, chat: bool, stop_after: int | None = None) -> None:
        """A streamed request, read to `[DONE]` or closed after `stop_after` chunks."""
        b, n = self.body(rng, chat, True)
        url = "/v1/chat/completions" if chat else "/v1/completions"
        chunks, done = [], False
        async with c.stream("POST", url, json=b) as resp:
            need(resp.status_code == 200, f"HTTP {resp.status_code}: {(await resp.aread())[:160]!r}")
            async for line in resp.aiter_lines():
                if not line or line.startswith(":"):
                    continue  # separators and keep-alive comments
                need(not done, f"data after [DONE]: {line[:80]!r}")
                need(line.startswith("data: "), f"not an SSE data line: {line[:80]!r}")
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                need("error" not in chunk, f"error event: {chunk.get('error')}")
                chunks.append(chunk)
                if stop_after is not None and len(chunks) >= stop_after:
                    break  # leaving the block closes the connection mid-stream
        need(chunks, "no chunk")
        kind = "chat.completion.chunk" if chat else "text_completion"
        rid = chunks[0]["id"]
        for k in chunks:
            self.check_head(k, kind, chat)
            need(k["id"] == rid, "the chunk ids differ")
        if chat:
            need(chunks[0]["choices"][0]["delta"].get("role") == "assistant", "no role chunk first")
        include_usage = bool(b.get("stream_options"))
        body = chunks[:-1] if include_usage and done else chunks
        finish, pieces, lps = None, 0, 0
        for k in body:
            need(k["usage"] is None, "usage before the final chunk")
            need(len(k["choices"]) == 1 and k["choices"][0]["index"] == 0, "choices")
            need(finish is None, "a chunk after the finishing chunk")
            ch = k["choices"][0]
            finish = ch["finish_reason"]
            text = ch["delta"].get("content") if chat else ch["text"]
            need(isinstance(text, str) or (chat and text is None), f"text {text!r}")
            pieces += bool(text)
            lp = ch["logprobs"] or {}
            lps += len(lp.get("content") or []) if chat else len(lp.get("tokens") or [])
        if not done:
            need(stop_after is not None, "the stream ended without [DONE]")
            return
        need(finish in ("stop", "length"), f"finish_reason {finish!r}")
        if include_usage:
            need(chunks[-1]["choices"] == [], "the usage chunk has choices")
            self.check_usage(chunks[-1]["usage"], b, n, finish, lps, pieces)
        elif b.get("logprobs"):
            need(lps <= b["max_tokens"], f"{lps} logprob entries for max_tokens {b['max_tokens']}")

    async def abort_prefill(self, c: httpx.AsyncClient, rng: random.Random) -> None:
        ids = rng.choice(self.long_prompts)
        b = {"model": self.model, "prompt": ids, "max_tokens": 64, "stream": rng.random() < 0.5}
        wait = rng.uniform(0.0, 1.0)  # a 1,900-token prefill takes about 1 s on an idle 2-core CPU
        if b["stream"]:
            async with c.stream("POST", "/v1/completions", json=b) as resp:
                need(resp.status_code == 200, f"HTTP {resp.status_code}")
                await asyncio.sleep(wait)
            return  # closed without reading a chunk
        try:
            resp = await asyncio.wait_for(c.post("/v1/completions", json=b), wait)
        except TimeoutError:
            return  # the cancelled request closed its connection
        need(resp.status_code == 200, f"HTTP {resp.status_code}")

    async def bad(self, c: httpx.AsyncClient, rng: random.Random) -> None:
        m, long = self.model, [1] * (self.max_len + 8)
        path, body, status = rng.choice(
            [
                ("/v1/chat/completions", {"model": m, "messages": []}, 400),
                ("/v1/completions", {"model": m, "prompt": "a", "max_tokens": -5}, 400),
                ("/v1/completions", {"model": "no-such-model", "prompt": "a"}, 404),
                ("/v1/completions", {"model": m, "prompt": "a", "temperature": "hot"}, 400),
                ("/v1/completions", {"model": m, "prompt": "a", "n": 1000}, 400),
                ("/v1/completions", {"model": m, "prompt": long}, 400),
                ("/v1/chat/completions", b'{"messages": [', 400),
                ("/v1/no-such-route", {}, 404),
            ]
        )
        kw = {"content": body, "headers": {"content-type": "application/json"}}
        resp = await c.post(path, **(kw if isinstance(body, bytes) else {"json": body}))
        need(resp.status_code == status, f"{path}: HTTP {resp.status_code}, expected {status}")
        err = resp.json()["error"]
        need(isinstance(err["message"], str) and err["type"] and err["code"] == status, f"error {err}")

    # --- the run -------------------------------------------------------------------------------

    async def client_loop(self, c: httpx.AsyncClient, i: int, stop_at: float) -> None:
        rng = random.Random(self.a.seed * 1000 + i)
        kinds, weights = list(MIX), list(MIX.values())
        while time.monotonic() < stop_at:
            kind = rng.choices(kinds, weights)[0]
            run = {
                "chat_stream": lambda: self.stream(c, rng, True),
                "chat": lambda: self.whole(c, rng, True),
                "text_stream": lambda: self.stream(c, rng, False),
                "text": lambda: self.whole(c, rng, False),
                "abort_stream": lambda: self.stream(c, rng, rng.random() < 0.5, rng.randint(1, 24)),
                "abort_prefill": lambda: self.abort_prefill(c, rng),
                "bad": lambda: self.bad(c, rng),
            }[kind]
            t0, error = time.perf_counter(), ""
            try:
                await asyncio.wait_for(run(), self.a.request_timeout)
            except TimeoutError:
                error = f"no reply within {self.a.request_timeout} s"
            except (Malformed, httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as e:
                error = f"{type(e).__name__}: {e}"
            self.outcomes.append(Outcome(kind, error, time.perf_counter() - t0))

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def sample(self, t: float) -> dict:
        m = scrape(self.sync)
        s = {"t": t, "rss": self.rss_mb(), **{k: m.get(v, float("nan")) for k, v in GAUGES.items()}}
        self.samples.append(s)
        return s

    async def sampler(self, start: float, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            await asyncio.to_thread(self.sample, time.monotonic() - start)
            await asyncio.sleep(self.a.sample_every)

    async def load(self) -> float:
        start = time.monotonic()
        stop_at = start + 60 * self.a.minutes
        limits = httpx.Limits(max_connections=2 * self.a.concurrency)
        timeout = httpx.Timeout(self.a.request_timeout, connect=10)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=timeout, trust_env=False) as c:
            loops = [self.client_loop(c, i, stop_at) for i in range(self.a.concurrency)]
            await asyncio.gather(self.sampler(start, stop_at), *loops)
        return time.monotonic() - start

    def wait_idle(self, seconds: float) -> dict:
        deadline = time.monotonic() + seconds
        while True:
            s = self.sample(float("nan"))
            if (s["running"] == s["waiting"] == s["kv"] == 0) or time.monotonic() > deadline:
                return s
            time.sleep(0.5)


def median_in(samples: list[dict], lo: float, hi: float) -> float:
    xs = [s["rss"] for s in samples if lo <= s["t"] < hi]
    return statistics.median(xs) if xs else float("nan")


def peak(samples: list[dict], key: str) -> float:
    return max((s[key] for s in samples if s[key] == s[key]), default=float("nan"))


def slope_mb_per_min(samples: list[dict]) -> float:
    if len(samples) < 2:
        return float("nan")
    ts, ys = [s["t"] / 60 for s in samples], [s["rss"] for s in samples]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var if var else float("nan")


def report(soak: Soak, a, duration, rss0, idle, probe, exit_info, log) -> tuple[str, bool]:
    rows = ["| kind | requests | errors | p50 (ms) | p99 (ms) |", "|---|---:|---:|---:|---:|"]
    for kind in [*MIX, "all"]:
        outs = [o for o in soak.outcomes if kind in (o.kind, "all")]
        ms = [o.seconds * 1000 for o in outs]
        errs = sum(bool(o.error) for o in outs)
        p50, p99 = percentile(ms, 50), percentile(ms, 99)
        rows.append(f"| {kind} | {len(outs)} | {errs} | {p50:.0f} | {p99:.0f} |")
    errors: dict[str, list[str]] = {}
    for o in soak.outcomes:
        if o.error:
            errors.setdefault(o.kind, []).append(o.error)
    err_lines = [f"- {k}: {len(v)}, e.g. `{v[0][:200]}`" for k, v in errors.items()] or ["- none"]

    during = [s for s in soak.samples if s["t"] == s["t"]]  # the load phase (t is not NaN)
    after = [s for s in during if s["t"] >= a.warmup]
    end = duration
    window = min(60.0, (end - a.warmup) / 2)
    first, last = median_in(after, a.warmup, a.warmup + window), median_in(after, end - window, end + 1)
    growth = last - first
    rss_end = soak.samples[-1]["rss"]
    warm = after[0]["rss"] if after else float("nan")
    mem = [
        f"| RSS at start (healthy, no load) | {rss0:.1f} MB |",
        f"| RSS after warm-up ({a.warmup:.0f} s) | {warm:.1f} MB |",
        f"| RSS at the end (idle) | {rss_end:.1f} MB |",
        f"| RSS max | {max(s['rss'] for s in soak.samples):.1f} MB |",
        f"| RSS median, first / last {window:.0f} s after warm-up | {first:.1f} / {last:.1f} MB "
        f"({growth:+.1f} MB) |",
        f"| RSS slope after warm-up (least squares) | {slope_mb_per_min(after):+.2f} MB/min |",
        f"| KV-cache usage max during the load | {peak(during, 'kv'):.4f} |",
        f"| running / waiting max during the load | {peak(during, 'running'):.0f} / "
        f"{peak(during, 'waiting'):.0f} |",
        f"| gauges at idle, as published (kv / running / waiting) | {idle['kv']:.6f} / "
        f"{idle['running']:.0f} / {idle['waiting']:.0f} |",
        f"| gauges after one probe request (kv / running / waiting) | {probe['kv']:.6f} / "
        f"{probe['running']:.0f} / {probe['waiting']:.0f} |",
        f"| prompt tokens found in the prefix cache / admitted | {probe['cache_hits']:.0f} / "
        f"{probe['cache_queries']:.0f} |",
    ]
    n_bad = [o for o in soak.outcomes if o.kind != "bad"]
    five = [o for o in soak.outcomes if re.search(r"HTTP 5\d\d|'code': 5\d\d", o.error)]
    checks = [
        ("every reply well formed, no error, no timeout", not errors, f"{len(soak.outcomes)} requests"),
        ("no 5xx", not five, f"{len(five)} 5xx"),
        ("bad requests got their 4xx", "bad" not in errors, f"{len(soak.outcomes) - len(n_bad)} sent"),
        ("KV usage back to 0 at idle", probe["kv"] == 0, f"{probe['kv']:.6f} after the probe"),
        (
            f"RSS growth, first to last window, <= {a.rss_tolerance_mb:g} MB",
            growth <= a.rss_tolerance_mb,
            f"{growth:+.1f} MB",
        ),
        ("server exited cleanly on SIGTERM", exit_info[0], exit_info[1]),
        ("no traceback in the server log", "Traceback" not in log, f"{log.count('Traceback')} found"),
    ]
    ok = all(c[1] for c in checks)
    stale = idle["running"] or idle["waiting"] or idle["kv"]
    note = (
        "\nNote: at idle, before the probe, /metrics still showed the gauges of the last engine step "
        "(they are only published after a step; a request aborted when no other request runs leaves "
        "them stale until the next request).\n"
        if stale
        else ""
    )
    text = "\n".join(
        [
            f"{len(soak.outcomes)} requests in {duration:.0f} s ({len(soak.outcomes) / duration:.1f} req/s), "
            f"{a.concurrency} client loops, seed {a.seed}; mix (weights): "
            + ", ".join(f"{k} {v}" for k, v in MIX.items()),
            "",
            *rows,
            "",
            "Errors by kind:",
            "",
            *err_lines,
            "",
            "| memory and pages | |",
            "|---|---:|",
            *mem,
            note,
            "| check | result | |",
            "|---|---|---|",
            *[f"| {name} | {'PASS' if good else '**FAIL**'} | {detail} |" for name, good, detail in checks],
            "",
            f"Verdict: {'PASS' if ok else '**FAIL**'}",
        ]
    )
    return text, ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint directory (default: the embedded default model)")
    ap.add_argument("--server-args", default="", help="extra `m3lm serve` arguments")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds left out of the RSS comparison")
    ap.add_argument("--sample-every", type=float, default=2.0, help="seconds between RSS/metrics samples")
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--rss-tolerance-mb", type=float, default=32.0)
    ap.add_argument("--out", type=Path, help="write the Markdown report to this file (its latest run)")
    a = ap.parse_args()
    if a.minutes * 60 <= a.warmup or a.concurrency < 1:
        ap.error("--minutes must be longer than --warmup and --concurrency positive")

    command = shlex.join(["python3", *sys.argv])
    if a.model:
        server = Server(a.model, None, shlex.split(a.server_args))
    else:
        from m3lm import DEFAULT_MODEL

        server = Server(str(DEFAULT_MODEL), None, shlex.split(a.server_args))
        server.argv[server.argv.index("--model") + 1] = os.path.relpath(DEFAULT_MODEL, REPO)
    load_avg = os.getloadavg()[0]
    try:
        t0 = time.monotonic()
        server.wait_healthy(t0 + 300)
        print(f"server healthy after {time.monotonic() - t0:.1f} s at {server.url}", flush=True)
        soak = Soak(a, server.url, server.proc.pid)
        rss0 = soak.rss_mb()
        duration = asyncio.run(soak.load())
        idle = soak.wait_idle(10)
        soak.sync.post("/v1/completions", json={"prompt": "Once", "max_tokens": 1}).raise_for_status()
        probe = soak.wait_idle(10)
        soak.sync.close()
    finally:
        t1 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(60)
        except Exception:
            code = None
        stopped = time.monotonic() - t1
        log = server.tail(1 << 26)
        server.stop()
    clean = code in (0, -signal.SIGTERM)
    exit_info = (clean, f"exit status {code} after {stopped:.1f} s")
    body, ok = report(soak, a, duration, rss0, idle, probe, exit_info, log)
    print(body)
    if a.out:
        details = [
            f"Server: `{shlex.join(server.argv)}`{'' if a.model else ' (the embedded default model)'}",
            f"Device: {machine()}; Python {platform.python_version()}, torch {version('torch')} "
            f"(client and server on the same machine; load average {load_avg:.2f} at the start)",
        ]
        write_section(a.out, "Soak test: mixed and aborted traffic", command, details, body)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
