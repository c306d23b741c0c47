"""Speculative decoding through the server: plain decoding against EAGLE-3 and prompt lookup.

For each mode (plain; EAGLE-3 with the embedded story drafter; prompt lookup) a fresh
`m3lm serve --model DIR` serves the same requests at each `--concurrency`, modes alternating
for `--rounds` rounds, so that each ratio compares runs of one round on fresh processes. The
requests are story openings (`--prompts FILE`, one JSON string a line, e.g. written by
`--write-prompts`; their lengths vary) to `/v1/completions`, streamed, greedy, `ignore_eos`, each
asking for a length drawn from `--output-len LO-HI`, with the generated token ids in the
stream. Reported per mode and concurrency: output tok/s (generated tokens over the level's wall
time), median TPOT, the ratio to plain decoding of the same round, the mean acceptance length
(from the server's /metrics); and how many requests' token ids equal plain decoding's at the
same concurrency (in every round).

    python3 benchmarks/spec_serve.py --write-prompts /tmp/story.jsonl --data-dir ../shared/data
    python3 benchmarks/spec_serve.py --prompts /tmp/story.jsonl --concurrency 1 16 --out FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import REPO, Server, commit, percentile, scrape

from m3lm.bench.report import machine, write_section

STORY = REPO / "m3lm" / "assets" / "story"
DRAFTER = REPO / "m3lm" / "assets" / "story-eagle3"


def modes(k: int) -> dict[str, list[str]]:
    eagle = {"method": "eagle3", "model": str(DRAFTER), "num_speculative_tokens": k}
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return {
        "plain": [],
        "eagle3": ["--speculative-config", json.dumps(eagle)],
        "ngram": ["--speculative-config", json.dumps(ngram)],
    }


async def one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """A streamed request: its token ids, time to first token and end-to-end seconds."""
    ids, first, start = [], None, time.perf_counter()
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                new = choice.get("token_ids") or []
                if new and first is None:
                    first = time.perf_counter() - start
                ids.extend(new)
    return {"ids": ids, "ttft": first or 0.0, "e2e": time.perf_counter() - start}


async def level(url: str, bodies: list[dict], concurrency: int, timeout: float) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:

        async def run(body: dict) -> dict:
            async with sem:
                return await one(client, url + "/v1/completions", body)

        await run(bodies[0])  # warm: a first request of this client
        start = time.perf_counter()
        out = await asyncio.gather(*(run(b) for b in bodies))
        return out, time.perf_counter() - start


def serve(model: str, extra: list[str], bodies: list[dict], levels: list[int], timeout: float) -> dict:
    """One fresh server: per concurrency, the requests' results, the wall time, the metrics delta."""
    server = Server(model, None, extra)
    try:
        server.wait_healthy(time.monotonic() + timeout)
        out = {}
        with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as sync:
            name = sync.get("/v1/models").raise_for_status().json()["data"][0]["id"]
            bodies = [{**b, "model": name} for b in bodies]
            for c in levels:
                before = scrape(sync)
                results, seconds = asyncio.run(level(server.url, bodies, c, timeout))
                time.sleep(0.2)  # the engine's last step reaches /metrics
                delta = {k: v - before.get(k, 0.0) for k, v in scrape(sync).items()}
                out[c] = (results, seconds, delta)
        return out
    except Exception:
        print(server.tail(), file=sys.stderr)
        raise
    finally:
        server.stop()


def summary(results: list[dict], seconds: float, delta: dict) -> dict:
    tokens = sum(len(r["ids"]) for r in results)
    tpot = [(r["e2e"] - r["ttft"]) / (len(r["ids"]) - 1) * 1e3 for r in results if len(r["ids"]) > 1]
    drafts = delta.get("m3lm:spec_decode_num_drafts_total", 0.0)
    accepted = delta.get("m3lm:spec_decode_num_accepted_tokens_total", 0.0)
    return {
        "tok/s": tokens / seconds,
        "tpot": percentile(tpot, 50),
        "accept": 1 + accepted / drafts if drafts else None,
    }


def held_back_prompts(data_dir: Path, n: int, seed: int) -> list[str]:
    """Openings of held-back stories (the validation split), 4 to 40 words."""
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu.spec_story import held_back
    from training.prepare_data import BOS

    rng = random.Random(seed)  # the server's tokenizer adds BOS
    return [" ".join(p.removeprefix(BOS).split()[: rng.randint(4, 40)]) for p in held_back(n, 40, data_dir)]


def _same(n: int, total: int) -> str:
    return f"all {total}" if n == total else f"**{n} of {total}**"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(STORY))
    ap.add_argument("--prompts", type=Path, help="one JSON string a line")
    ap.add_argument("--write-prompts", type=Path, help="write held-back story openings there and stop")
    ap.add_argument("--data-dir", type=Path, help="the story data (with --write-prompts)")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--output-len", default="64-192", help="generated tokens: N or LO-HI drawn per request")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--modes", nargs="+", default=["plain", "eagle3", "ngram"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--server-args", default="", help="extra `m3lm serve` arguments for every mode")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.write_prompts:
        texts = held_back_prompts(a.data_dir, a.num_requests, a.seed)
        a.write_prompts.parent.mkdir(parents=True, exist_ok=True)
        a.write_prompts.write_text("".join(json.dumps(t) + "\n" for t in texts))
        print(f"wrote {len(texts)} prompts to {a.write_prompts}")
        return
    if a.modes[0] != "plain":
        ap.error("--modes: plain first (the other modes are compared with it)")
    texts = [json.loads(line) for line in a.prompts.read_text().splitlines() if line.strip()]
    rng = random.Random(a.seed)
    lo, _, hi = a.output_len.partition("-")
    bodies = [
        {
            "prompt": texts[i % len(texts)],
            "max_tokens": rng.randint(int(lo), int(hi or lo)),
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        for i in range(a.num_requests)
    ]
    extra = a.server_args.split()
    table = {}  # (mode, concurrency) -> list of per-round summaries
    plain_ids = {}  # concurrency -> plain decoding's token ids of each request (its first round)
    differ = {}  # (mode, concurrency) -> requests whose tokens differ from plain decoding's, any round
    for r in range(a.rounds):
        for m in a.modes:
            runs = serve(a.model, extra + modes(a.k)[m], bodies, a.concurrency, a.timeout)
            for c, (results, seconds, delta) in runs.items():
                s = summary(results, seconds, delta)
                table.setdefault((m, c), []).append(s)
                print(f"round {r + 1} {m} c={c}: {json.dumps(s)}", flush=True)
                ids = plain_ids.setdefault(c, [x["ids"] for x in results])
                bad = differ.setdefault((m, c), set())
                bad.update(i for i, x in enumerate(results) if x["ids"] != ids[i])
    lines = [
        "| mode | concurrency | output tok/s (per round) | x plain (per round) | median TPOT ms | mean acceptance length | requests whose tokens = plain's |",
        "|---|---:|---|---|---:|---:|---|",
    ]
    for m in a.modes:
        for c in a.concurrency:
            rows, plain = table[(m, c)], table[("plain", c)]
            ratios = [x["tok/s"] / p["tok/s"] for x, p in zip(rows, plain, strict=True)]
            acc = [x["accept"] for x in rows if x["accept"]]
            rates = ", ".join(f"{x['tok/s']:,.0f}" for x in rows)
            lines.append(
                f"| {m} | {c} | {rates} | "
                f"{', '.join(f'{q:.2f}x' for q in ratios)} (median {statistics.median(ratios):.2f}x) | "
                f"{statistics.median(x['tpot'] for x in rows):.2f} | "
                f"{f'{statistics.median(acc):.2f}' if acc else '-'} | "
                f"{_same(a.num_requests - len(differ[(m, c)]), a.num_requests)} |"
            )
    text = "\n".join(lines)
    print(text)
    if a.out:
        lens = [len(t.split()) for t in texts]
        setup = (
            f"Server: `m3lm serve --model {a.model} {a.server_args}` started afresh for each mode and "
            f"round; {a.num_requests} requests of story openings ({min(lens)}-{max(lens)} words) -> "
            f"{a.output_len} tokens (greedy, ignore_eos), streamed from /v1/completions; k = {a.k}; "
            f"prompt lookup with n-grams of 2-4 tokens."
        )
        device = f"Device: {machine()}; GPU: {gpu_name()}; at commit {commit(REPO)}"
        write_section(
            a.out, "Speculative decoding through the server", " ".join(sys.argv), [setup, device], text
        )


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "none"
    except (OSError, subprocess.TimeoutExpired):
        return "none"


if __name__ == "__main__":
    main()
