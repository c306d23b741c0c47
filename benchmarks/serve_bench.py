"""Online serving benchmark: throughput and latency of an m3lm server under concurrent streaming load.

For each `--concurrency` value C, the benchmark sends `--num-requests` streaming requests to
`/v1/completions` (token-id prompts; `--endpoint chat` sends the same prompts as text to
`/v1/chat/completions`) with at most C in flight, and reports:

- request throughput, output token throughput and total (prompt + output) token throughput;
- TTFT: time from sending a request to its first chunk carrying generated text;
- TPOT: (E2E - TTFT) / (output tokens - 1) per request, the decode time per token;
- ITL: the gaps between successive streamed chunks that carry generated text (a token that
  decodes to no text yet, such as part of a multi-byte character, comes with the next one, so
  there can be fewer chunks than tokens);
- E2E request latency, and the number of failed requests.

Prompts are `--input-len` token ids drawn at random (`--seed`) from the ids that the server's
`/tokenize` returns for random ASCII text, so they are valid for any tokenizer. Every request asks
for exactly `--output-len` tokens (`max_tokens`, `ignore_eos: true`, greedy by default), with
`stream_options.include_usage` so the token counts come from the response. Before and after each
concurrency level the benchmark reads `/metrics` and checks that the growth of
`m3lm:generation_tokens_total` and `m3lm:prompt_tokens_total` equals the token counts the clients
received, and shows the server's own mean TTFT, ITL and E2E from its histograms. A request fails
on an HTTP error, an error event in the stream, or a token count other than `--output-len`. One
unmeasured request warms the server up first.

Either point it at a running server (`--url http://127.0.0.1:8000`) or give `--model DIR`: it
then starts `python -m m3lm serve --model DIR --port <free port>` on 127.0.0.1, waits for
/health, and stops it at the end. Only loopback addresses are accepted, and `--timeout` bounds
the whole run. Run from the repository root:

    python3 benchmarks/serve_bench.py --model ../shared/fixtures/minimax-m3-tiny \\
        --concurrency 1 4 16 --num-requests 32 --input-len 64 --output-len 32 \\
        --out benchmarks/results/serve_tiny.md

`--response-format SPEC` measures what structured output costs: each concurrency level runs
`--rounds` times without and then with that `response_format` (`json_object`, `json_schema` for a
built-in nested schema, or a response_format object as JSON), and a table gives the median TPOT
of each run and the ratios of the best rounds (on a shared machine, the runs least disturbed by
other work) and of the rounds' medians. A constrained request may end when its grammar does (its token count is
then below `--output-len`, and counts as it is); TPOT is per token either way.

`--baseline DIR` compares this build with another source tree, `--with-server-args ARGS` this
build without and with some `m3lm serve` arguments (what a setting costs, e.g. KV events):
`--rounds` fresh servers of each, alternated, and the ratios of their throughput and median
latencies, per round's median and per best round.

`--out` writes a dated section (command, device, versions, figures) to the file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import socket
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlparse

import httpx

from m3lm.bench.plot import line_plot
from m3lm.bench.report import machine, write_section

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


class Server:
    """`python -m m3lm serve` as a child process on a free loopback port."""

    def __init__(self, model: str, api_key: str | None, extra: list[str], repo: Path | None = None):
        """`model` as given (for the record); the child gets its absolute path. `repo`: the
        source tree whose m3lm serves (default: this one)."""
        repo = Path(repo or REPO).resolve()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.argv = ["python", "-m", "m3lm", "serve", "--model", model, "--port", str(port), *extra]
        argv = [sys.executable, *self.argv[1:], *(["--api-key", api_key] if api_key else [])]
        argv[argv.index("--model") + 1] = str(Path(model).resolve())
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
        }
        self.log, path = tempfile.mkstemp(prefix="m3lm-serve-", suffix=".log")
        os.unlink(path)  # the open descriptor keeps the log until we close it
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=repo)

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server did not become healthy in time:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        size = os.fstat(self.log).st_size
        return os.pread(self.log, n, max(size - n, 0)).decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.close(self.log)


SCHEMA = {  # --response-format json_schema: nested, with strings the model ends when it likes
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "count": {"type": "integer"},
                    "done": {"type": "boolean"},
                },
                "required": ["name", "count", "done"],
            },
        },
    },
    "required": ["title", "items"],
}


def response_format(spec: str) -> dict:
    if spec == "json_object":
        return {"type": "json_object"}
    if spec == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "bench", "schema": SCHEMA}}
    return json.loads(spec)


async def request(client: httpx.AsyncClient, url: str, body: dict, chat: bool) -> Result:
    """One streamed request, timed from sending it to `[DONE]`."""
    r = Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue  # blank separators and keep-alive comments
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = f"stream error: {chunk['error'].get('message')}"
                    return r
                if chunk.get("usage"):
                    r.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    r.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                delta = (
                    choice.get("delta", {})
                    if chat
                    else {"text": choice.get("text"), "ids": choice.get("token_ids")}
                )
                if not any(v for k, v in delta.items() if k != "role"):
                    continue  # the chat role chunk and the empty finishing chunk carry no token
                now = time.perf_counter()
                if r.ttft:
                    r.itl.append(now - last)
                else:
                    r.ttft = now - start
                last = now
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        r.error = f"{type(e).__name__}: {e}"
        return r
    r.e2e = time.perf_counter() - start
    want = body["max_tokens"]
    ended = "response_format" in body and 2 <= r.output_tokens <= want  # its grammar may end first
    r.ok = (r.output_tokens == want or ended) and r.ttft > 0
    r.error = "" if r.ok else f"{r.output_tokens} output tokens in the usage chunk, asked for {want}"
    return r


async def run_level(client, url, bodies, chat, concurrency, deadline) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(concurrency)

    async def one(body: dict) -> Result:
        async with sem:
            return await request(client, url, body, chat)

    tasks = [asyncio.ensure_future(one(b)) for b in bodies]
    start = time.perf_counter()
    done, pending = await asyncio.wait(tasks, timeout=max(deadline - time.monotonic(), 0))
    duration = time.perf_counter() - start
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    results = [t.result() if t in done else Result(error="cut by --timeout") for t in tasks]
    return results, duration


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[Result], duration: float, metrics_delta: dict[str, float]) -> dict[str, str]:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    row = {
        "successful requests": f"{len(ok)}",
        "failed requests": f"{len(results) - len(ok)}",
        "duration (s)": f"{duration:.2f}",
        "prompt / output tokens": f"{in_tok} / {out_tok}",
        "request throughput (req/s)": f"{len(ok) / duration:.2f}",
        "output token throughput (tok/s)": f"{out_tok / duration:.1f}",
        "total token throughput (tok/s)": f"{(in_tok + out_tok) / duration:.1f}",
    }
    for name, xs in (
        ("TTFT", [r.ttft for r in ok]),
        ("TPOT", tpot),
        ("ITL", itl),
        ("E2E", [r.e2e for r in ok]),
    ):
        ms = [x * 1000 for x in xs]
        mean = sum(ms) / len(ms) if ms else float("nan")
        row[f"{name} mean / median / p99 (ms)"] = (
            f"{mean:.1f} / {percentile(ms, 50):.1f} / {percentile(ms, 99):.1f}"
        )
    d = metrics_delta
    gen, prompt = d.get("m3lm:generation_tokens_total", 0), d.get("m3lm:prompt_tokens_total", 0)
    agree = "agree" if gen == out_tok and prompt == in_tok else "**DISAGREE**"
    row["/metrics delta: generation / prompt tokens"] = f"{gen:.0f} / {prompt:.0f} ({agree})"
    means = [
        1000 * d.get(f"m3lm:{h}_sum", 0) / max(d.get(f"m3lm:{h}_count", 0), 1)
        for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds")
    ]
    row["/metrics delta: server TTFT / ITL / E2E mean (ms)"] = " / ".join(f"{m:.1f}" for m in means)
    return row


def scrape(client: httpx.Client) -> dict[str, float]:
    """The server's m3lm: samples, summed over label sets (histogram buckets are left out)."""
    totals: dict[str, float] = {}
    for line in client.get("/metrics").raise_for_status().text.splitlines():
        if line.startswith("m3lm:") and "_bucket{" not in line:
            name = line.split("{", 1)[0].split(" ", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def length(spec: str, rng: random.Random) -> int:
    """A length from "N" or a range "LO-HI" (uniform)."""
    lo, _, hi = spec.partition("-")
    return rng.randint(int(lo), int(hi or lo))


def make_prompts(client: httpx.Client, a: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """Token-id prompts and output lengths, from the ids /tokenize gives for random ASCII text, or
    uniform in [0, --vocab) when the server has no tokenizer."""
    rng = random.Random(a.seed)
    if a.vocab:
        pool = range(a.vocab)
    else:
        text = "".join(rng.choice(string.ascii_letters + string.digits + " .,") for _ in range(1000))
        pool = sorted(
            set(client.post("/tokenize", json={"prompt": text}).raise_for_status().json()["tokens"])
        )
    prompts, outputs = [], []
    for _ in range(a.num_requests):
        prompts.append([rng.choice(pool) for _ in range(length(a.input_len, rng))])
        outputs.append(length(a.output_len, rng))
    return prompts, outputs


def make_bodies(client: httpx.Client, model: str, a: argparse.Namespace, prompts, outputs) -> list[dict]:
    common = {
        "model": model,
        "ignore_eos": True,
        "temperature": a.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if a.endpoint == "completions":
        return [{"prompt": p, "max_tokens": n, **common} for p, n in zip(prompts, outputs, strict=True)]
    texts = [
        client.post("/detokenize", json={"tokens": p}).raise_for_status().json()["prompt"] for p in prompts
    ]
    return [
        {"messages": [{"role": "user", "content": t}], "max_tokens": n, **common}
        for t, n in zip(texts, outputs, strict=True)
    ]


OFFLINE = """
import json, sys, time
from m3lm.core import SamplingParams
from m3lm.llm import LLM
spec = json.load(sys.stdin)
llm = LLM(spec["model"], **spec["load"], **spec["engine"])
params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=spec["temperature"]) for n in spec["outputs"]]
llm.generate(spec["prompts"], params)  # compiles what the timed run needs
t = time.perf_counter()
outs = llm.generate(spec["prompts"], params)
seconds = time.perf_counter() - t
tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
print(json.dumps({"seconds": seconds, "tokens": tokens}))
"""

KERNEL = """
import json, sys
from m3lm.bench.run import bench_decode
from m3lm.bench.slice import build_slice
spec = json.load(sys.stdin)
model = build_slice(spec["layers"])
print(json.dumps({c: bench_decode(model, b, ctx, 50).ms for c, (b, ctx) in spec["cases"].items()}))
"""


def child_json(code: str, spec: dict, timeout: float) -> dict:
    """Run `code` in a fresh Python process with `spec` on stdin; its last stdout line as JSON."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(spec), capture_output=True, text=True, env=env,
        timeout=timeout, cwd=REPO, check=False,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"the comparison run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def server_options(args: list[str]) -> tuple[dict, dict]:
    """(load options, engine options) of the `m3lm serve` arguments that the offline run shares."""
    load, engine = {}, {}
    it = iter(args)
    for x in it:
        key = x.lstrip("-").replace("-", "_")
        if x == "--skip-tokenizer-init":
            load["skip_tokenizer_init"] = True
        elif key in ("load_format", "dtype", "device"):
            load[key] = next(it)
        elif key in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            engine[key] = int(next(it))
    return load, engine


def median_tpot(row: dict[str, str]) -> float:
    return float(row["TPOT mean / median / p99 (ms)"].split(" / ")[1])


def structured_cost(a: argparse.Namespace, rows: list[dict[str, str]]) -> list[str]:
    """Median TPOT with and without the response_format, per concurrency level and round; the
    ratio of the best rounds (the least disturbed by other work on the machine) and of the
    rounds' medians."""
    lines = ["", "", "| concurrency | TPOT median per round, plain (ms) | the same, structured (ms) | "
             "structured / plain, best rounds | the same, median rounds |", "|---|---|---|---:|---:|"]  # fmt: skip
    for c in a.concurrency:
        runs = list(zip(a.columns, rows, strict=True))
        plain = [median_tpot(r) for n, r in runs if n.startswith(f"{c} plain")]
        structured = [median_tpot(r) for n, r in runs if n.startswith(f"{c} structured")]
        if plain and structured:
            best = min(structured) / min(plain)
            middle = percentile(structured, 50) / percentile(plain, 50)
            fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
            lines.append(f"| {c} | {fmt(plain)} | {fmt(structured)} | {best:.3f}x | {middle:.3f}x |")
    return lines


def comparisons(a: argparse.Namespace, levels: list[int], rows: list[dict[str, str]]) -> str:
    """The offline engine and the kernel decode step, each against the HTTP figures."""
    lines = structured_cost(a, rows) if a.response_format else []
    first = {n: r for n, r in zip(a.columns, rows, strict=True)}  # each level's (first plain) run
    rows = [first[f"{c} plain 1" if a.response_format else str(c)] for c in levels]
    if a.offline and a.model:
        load, engine = server_options(shlex.split(a.server_args))
        engine.setdefault("max_num_seqs", 64)
        spec = {"model": str(Path(a.model).resolve()), "load": load, "engine": engine,
                "prompts": a.prompts, "outputs": a.outputs, "temperature": a.temperature}  # fmt: skip
        off = child_json(OFFLINE, spec, a.timeout)
        rate = off["tokens"] / off["seconds"]
        lines += [
            "",
            "| offline LLM.generate (same prompts, second run) | tok/s | HTTP / offline |",
            "|---|---:|---:|",
        ]
        for c, r in zip(levels, rows, strict=True):
            http = float(r["output token throughput (tok/s)"])
            lines.append(f"| HTTP concurrency {c}: {http:.1f} tok/s | {rate:.1f} | {http / rate:.2f}x |")
    if a.kernel_decode:
        cases = {}
        for case in a.kernel_decode.split(","):
            b, ctx = (int(x) for x in case.lower().split("x"))
            cases[case] = (b, ctx)
        ms = child_json(KERNEL, {"layers": a.layers, "cases": cases}, a.timeout)
        lines += ["", "", "| kernel decode step (m3lm bench) | ms | HTTP median TPOT (concurrency = B) | ratio |",
                  "|---|---:|---:|---:|"]  # fmt: skip
        for case, (b, _) in cases.items():
            if b in levels:
                tpot = float(rows[levels.index(b)]["TPOT mean / median / p99 (ms)"].split(" / ")[1])
                lines.append(f"| {case} | {ms[case]:.3f} | {tpot:.3f} | {tpot / ms[case]:.2f}x |")
    return "\n".join(lines)


def commit(tree: Path) -> str:
    """The tree's git commit (with "+ changes" when its files differ from it), if it is a checkout."""
    try:
        top = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--show-toplevel"], capture_output=True, text=True
        )
        if Path(top.stdout.strip() or "/nonexistent").resolve() != Path(tree).resolve():
            return "not a git checkout"  # a folder inside another checkout is not that checkout
        head = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return "not a git checkout"
    if head.returncode:
        return "not a git checkout"
    return f"commit {head.stdout.strip()}" + (" + changes" if dirty.stdout.strip() else "")


def ab_variants(a: argparse.Namespace) -> list[tuple[str, Path, list[str]]]:
    """The two servers an A/B run compares, the reference first: (name, source tree, serve args)."""
    args = shlex.split(a.server_args)
    if a.baseline:
        return [("baseline", a.baseline, args), ("this build", REPO, args)]
    return [("without", REPO, args), ("with", REPO, [*args, *shlex.split(a.with_server_args)])]


def builds_ab(a: argparse.Namespace, deadline: float) -> str:
    """Each round, a fresh server of each variant (the baseline tree and this one, or this one
    without and with `--with-server-args`; the order alternating from round to round), every
    concurrency level on each; the ratios of the second to the first."""
    variants = ab_variants(a)
    (ref, _, _), (new, _, _) = variants
    runs: dict[str, list[list[dict[str, str]]]] = {ref: [], new: []}
    for i in range(a.rounds):
        for name, repo, args in variants if i % 2 == 0 else variants[::-1]:
            server = Server(a.model, a.api_key, args, repo=repo)
            try:
                server.wait_healthy(deadline)
                print(f"round {i + 1}: {name} ({repo}, {shlex.join(args)})", flush=True)
                runs[name].append(asyncio.run(bench(a, server.url, deadline)))
            finally:
                server.stop()

    def figure(row: dict[str, str], key: str) -> float:
        if key == "tok/s":
            return float(row["output token throughput (tok/s)"])
        return float(row[f"{key} mean / median / p99 (ms)"].split(" / ")[1])

    lines = [
        f"| concurrency | figure | {ref} (each round) | {new} (each round) | {new} / {ref}, medians | best rounds |",
        "|---|---|---|---|---:|---:|",
    ]
    for j, c in enumerate(a.concurrency):
        for key, higher in (("tok/s", True), ("TTFT", False), ("TPOT", False)):
            base = [figure(r[j], key) for r in runs[ref]]
            this = [figure(r[j], key) for r in runs[new]]
            best = (max if higher else min)(this) / (max if higher else min)(base)
            mid = percentile(this, 50) / percentile(base, 50)
            label = "output tok/s" if key == "tok/s" else f"median {key} (ms)"
            lines.append(
                f"| {c} | {label} | {', '.join(f'{x:.1f}' for x in base)} | "
                f"{', '.join(f'{x:.1f}' for x in this)} | {mid:.3f}x | {best:.3f}x |"
            )
    failed = sum(int(r[j]["failed requests"]) for v in runs.values() for r in v for j in range(len(r)))
    lines.append(f"\nFailed requests over all runs: {failed}.")
    return "\n".join(lines)


def latency_series(levels: list[int], rows: list[dict[str, str]]) -> dict[str, list[tuple[float, float]]]:
    """Median TTFT and TPOT against concurrency, from the table's rows (two levels or more)."""
    if len(levels) < 2:
        return {}
    return {
        name: [
            (c, float(r[f"{name} mean / median / p99 (ms)"].split(" / ")[1]))
            for c, r in zip(levels, rows, strict=True)
        ]
        for name in ("TTFT", "TPOT")
    }


def table(levels: list, rows: list[dict[str, str]]) -> str:
    head = "| concurrency | " + " | ".join(str(c) for c in levels) + " |"
    lines = [head, "|---|" + "---:|" * len(levels)]
    lines += [f"| {k} | " + " | ".join(r[k] for r in rows) + " |" for k in rows[0]]
    return "\n".join(lines)


async def bench(a: argparse.Namespace, url: str, deadline: float) -> list[dict[str, str]]:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    sync = httpx.Client(base_url=url, headers=headers, timeout=60, trust_env=False)
    model = sync.get("/v1/models").raise_for_status().json()["data"][0]["id"]
    prompts, outputs = make_prompts(sync, a)
    a.prompts, a.outputs = prompts, outputs  # for the offline comparison
    bodies = make_bodies(sync, model, a, prompts, outputs)
    chat = a.endpoint == "chat"
    a.columns = []
    path = url + ("/v1/chat/completions" if chat else "/v1/completions")
    limits = httpx.Limits(max_connections=max(a.concurrency), max_keepalive_connections=max(a.concurrency))
    timeout = httpx.Timeout(a.timeout, connect=10)
    rows = []
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout, trust_env=False) as client:
        warm = await request(client, path, bodies[0], chat)
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        if a.response_format:
            rf = response_format(a.response_format)
            constrained = [{**b, "response_format": rf} for b in bodies]
            warm = await request(client, path, constrained[0], chat)  # the grammar compiles here
            if not warm.ok:
                raise RuntimeError(f"the structured warm-up request failed: {warm.error}")
        variants = (
            [("", bodies)] if not a.response_format else [("plain", bodies), ("structured", constrained)]
        )
        for c in a.concurrency:
            for i in range(a.rounds if a.response_format else 1):
                for label, level_bodies in variants:
                    before = scrape(sync)
                    results, duration = await run_level(client, path, level_bodies, chat, c, deadline)
                    await asyncio.sleep(0.2)  # let the engine thread publish the last step's metrics
                    after = scrape(sync)
                    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
                    rows.append(summarize(results, duration, delta))
                    name = f"{c} {label} {i + 1}" if label else str(c)
                    a.columns.append(name)
                    errors = sorted({r.error for r in results if not r.ok})
                    print(f"concurrency {name}: {json.dumps(rows[-1], indent=1)}", flush=True)
                    for e in errors[:5]:
                        print(f"  error: {e}", flush=True)
                    if time.monotonic() > deadline:
                        print("stopped: --timeout reached", flush=True)
                        return rows
    sync.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running server on loopback, e.g. http://127.0.0.1:8000")
    src.add_argument("--model", help="checkpoint directory: start `m3lm serve` on a free loopback port")
    ap.add_argument("--server-args", default="", help="extra `m3lm serve` arguments, e.g. '--max-num-seqs 8'")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1], help="one run per value")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", default="64", help="prompt tokens: N, or LO-HI drawn per request")
    ap.add_argument("--output-len", default="32", help="generated tokens: N, or LO-HI drawn per request")
    ap.add_argument("--vocab", type=int, default=None, help="random prompt ids below this (no /tokenize)")
    ap.add_argument(
        "--offline",
        action="store_true",
        help="then, with the server stopped, the offline LLM.generate on the same prompts (--model only)",
    )
    ap.add_argument(
        "--kernel-decode",
        default="",
        metavar="BxCTX,...",
        help="then, with the server stopped, the kernel decode step (m3lm bench) of the release slice",
    )
    ap.add_argument("--layers", type=int, default=4, help="the slice's layers for --kernel-decode")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--api-key", default=os.environ.get("M3LM_API_KEY"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--timeout", type=float, default=600, help="seconds for the whole run, server start included"
    )
    ap.add_argument(
        "--response-format",
        default="",
        metavar="SPEC",
        help="also run each level with this response_format: json_object, json_schema or a JSON object",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="with --response-format, --baseline or --with-server-args: runs of each per level",
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="another source tree (an earlier build checked out): --rounds fresh servers of each, "
        "alternated, and the ratios of this build to it (--model only)",
    )
    ap.add_argument(
        "--with-server-args",
        metavar="ARGS",
        help="this build without and with these extra `m3lm serve` arguments: --rounds fresh servers "
        "of each, alternated, and the ratios of with to without (--model only)",
    )
    ap.add_argument("--out", type=Path, help="write a dated Markdown section to this file (its latest run)")
    a = ap.parse_args()
    try:
        lengths = [length(x, random.Random(0)) for x in (a.input_len, a.output_len)]
    except ValueError:
        ap.error("--input-len and --output-len: N or LO-HI")
    if min(a.concurrency) < 1 or a.num_requests < 1 or min(lengths) < 1:
        ap.error("--concurrency, --num-requests, --input-len and --output-len must be positive")

    env = [f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ]
    argv = ["***" if i and sys.argv[i - 1] == "--api-key" else x for i, x in enumerate(sys.argv)]
    argv = ["--api-key=***" if x.startswith("--api-key=") else x for x in argv]
    command = shlex.join([*env, "python3", *argv])  # the API key is not written down
    deadline = time.monotonic() + a.timeout
    load = os.getloadavg()[0]
    if a.baseline or a.with_server_args:
        if (
            not a.model
            or a.response_format
            or a.offline
            or a.kernel_decode
            or (a.baseline and a.with_server_args)
        ):
            ap.error(
                "--baseline or --with-server-args (one of them) needs --model, without --response-format, "
                "--offline or --kernel-decode"
            )
        result = builds_ab(a, deadline)
        print(result)
        if a.out:
            serve = ["python", "-m", "m3lm", "serve", "--model", a.model]
            servers = (
                f"`{shlex.join([*serve, *shlex.split(a.server_args)])}` from the baseline tree {a.baseline} "
                f"({commit(a.baseline)}) and from this one ({commit(REPO)})"
                if a.baseline
                else f"`{shlex.join([*serve, *shlex.split(a.server_args)])}` without and with "
                f"`{a.with_server_args}`, from this tree ({commit(REPO)})"
            )
            details = [
                f"Servers: {servers}, {a.rounds} fresh processes each, alternated; endpoint "
                f"/v1/{a.endpoint.replace('chat', 'chat/completions')}, {a.num_requests} requests of "
                f"{a.input_len} prompt tokens -> {a.output_len} output tokens (ignore_eos, temperature "
                f"{a.temperature}), streamed",
                f"Device: {machine()}; Python {platform.python_version()}, torch {version('torch')} "
                f"(client and server on the same machine; load average {load:.2f} at the start)",
            ]
            title = (
                "this build against a baseline build" if a.baseline else "without and with server arguments"
            )
            write_section(a.out, f"Online serving: {title}", command, details, result)
        return
    server = None
    if a.model:
        server = Server(a.model, a.api_key, shlex.split(a.server_args))
        url = server.url
    else:
        url = a.url.rstrip("/")
        if urlparse(url).hostname not in LOOPBACK:
            ap.error(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))})")
    try:
        if server is not None:
            t0 = time.perf_counter()
            server.wait_healthy(deadline)
            print(f"server healthy after {time.perf_counter() - t0:.1f} s at {url}", flush=True)
        rows = asyncio.run(bench(a, url, deadline))
    finally:
        if server is not None:
            server.stop()
    if not rows:
        sys.exit("no concurrency level finished within --timeout")
    result = table(a.columns[: len(rows)], rows)
    done = [c for c in a.concurrency if (f"{c} plain 1" if a.response_format else str(c)) in a.columns]
    result += comparisons(a, done, rows)
    print(result)
    if a.out:
        shape = " (the user message, before the chat template)" if a.endpoint == "chat" else ""
        served = f"`{shlex.join(server.argv)}`" if server else f"already running at {url}"
        details = [
            f"Server: {served}; endpoint /v1/{a.endpoint.replace('chat', 'chat/completions')}, "
            f"{a.num_requests} requests of {a.input_len} prompt tokens{shape} -> {a.output_len} output tokens "
            f"(ignore_eos, temperature {a.temperature}), streamed"
            + (
                f"; each level without and with response_format {a.response_format}"
                if a.response_format
                else ""
            ),
            f"Device: {machine()}; Python {platform.python_version()}, torch {version('torch')} "
            f"(client and server on the same machine; load average {load:.2f} at the start)",
        ]
        write_section(a.out, "Online serving: throughput and latency", command, details, result)
        if not a.response_format:
            line_plot(
                a.out.with_suffix(".png"), "Serving latency against concurrency", "concurrent requests",
                "ms (median)", latency_series(done, rows), logx=True, logy=True,
            )  # fmt: skip


if __name__ == "__main__":
    main()
