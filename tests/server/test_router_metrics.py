"""The metrics routers read, under vLLM's names: two live servers scraped over HTTP with
prometheus_client's parser while their engines are held step by step, so each server's load is
known exactly; a router-style scorer written here picks the less loaded one."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.live_server import API_KEY, NAME, start
from tests.support.paths import PATIENCE_S

LOAD = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


class Gate:
    """Holds an engine's loop at the start of each step (before it schedules) until the test lets
    one step through, so the load a scrape sees is the one the test built."""

    def __init__(self, engine):
        self.engine, self.real = engine, engine.step
        self.cond = threading.Condition()
        self.arrivals = self.permits = 0
        self.opened = False
        engine.step = self._step

    def _step(self):
        with self.cond:
            self.arrivals += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.permits or self.opened)
            if not self.opened:
                self.permits -= 1
        return self.real()

    def held(self, after: int) -> bool:
        """Wait until the loop stands at the gate for the `after`-th time or later."""
        with self.cond:
            return self.cond.wait_for(lambda: self.arrivals > after, PATIENCE_S)

    def let_one(self) -> None:
        with self.cond:
            self.permits += 1
            self.cond.notify_all()

    def open(self) -> None:
        with self.cond:
            self.opened = True
            self.cond.notify_all()
        self.engine.step = self.real


def scrape(url: str) -> dict:
    """/metrics parsed: {name: value} for the gauges, {name: labels} for cache_config_info."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("cache_config_info"):
                out[sample.name] = sample.labels
            elif family.type == "gauge":
                out[sample.name] = sample.value
    return out


def pick(scrapes: dict[str, dict]) -> str:
    """A router's choice in the style of the inference extension's scorers: a queue score (fewer
    waiting than the busiest candidate) plus a KV score (free pages), from vLLM's names only."""
    most = max(s["vllm:num_requests_waiting"] for s in scrapes.values()) or 1

    def score(s):
        return (1 - s["vllm:num_requests_waiting"] / most) + (1 - s["vllm:kv_cache_usage_perc"])

    return max(scrapes, key=lambda url: score(scrapes[url]))


def load_to(server, gate: Gate, n: int) -> list:
    """Send `n` streamed completions and let steps through until the engine holds all of them
    and has scheduled them once (its gauges published); returns the streams' futures."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=PATIENCE_S)

    def one(i):
        stream = client.completions.create(
            model=NAME,
            # prompts apart from their first page: one that waits on a page another prefill
            # promised would join only a step later
            prompt=f"{i} story once upon a time",
            max_tokens=32,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return sum(1 for _ in stream)

    pool = ThreadPoolExecutor(n)
    futures = [pool.submit(one, i) for i in range(n)]
    engine, seen = server.engine.engine, 0
    while True:
        assert gate.held(seen)
        seen = gate.arrivals
        if len(engine.requests) == n:
            break
        gate.let_one()  # the loop takes in the requests that came meanwhile after this step
    gate.let_one()  # one step over all of them: its stats are sent before the next step
    assert gate.held(seen)
    pool.shutdown(wait=False)
    return futures


def settled(url: str, expect: dict[str, float]) -> dict:
    """A scrape once the server's m3lm: gauges read `expect` (the stats cross a thread)."""
    deadline = time.monotonic() + PATIENCE_S
    while True:
        s = scrape(url)
        if all(s[f"m3lm:{k}"] == v for k, v in expect.items()) or time.monotonic() > deadline:
            return s


def same_under_both_names(s: dict) -> None:
    for key in LOAD:
        assert s[f"vllm:{key}"] == s[f"m3lm:{key}"], key
    assert s["vllm:cache_config_info"] == s["m3lm:cache_config_info"]


@pytest.fixture(scope="module")
def pair(served_checkpoint):
    servers = [start(served_checkpoint, max_num_seqs=2) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def test_vllm_gauges_move_with_m3lm_ones_and_a_router_picks_the_idle_server(pair):
    busy, light = pair
    for server in pair:
        s = scrape(server.url)
        same_under_both_names(s)
        assert [s[f"vllm:{k}"] for k in LOAD] == [0, 0, 0]
        blocks = server.engine.engine.blocks
        config = s["vllm:cache_config_info"]
        assert config["block_size"] == str(blocks.page_size)
        assert config["num_gpu_blocks"] == str(blocks.num_pages)
        assert config["enable_prefix_caching"] == "True"

    gates = {id(s): Gate(s.engine.engine) for s in pair}
    try:
        futures = load_to(busy, gates[id(busy)], 4) + load_to(light, gates[id(light)], 1)
        loaded = {
            busy.url: settled(busy.url, {"num_requests_running": 2, "num_requests_waiting": 2}),
            light.url: settled(light.url, {"num_requests_running": 1, "num_requests_waiting": 0}),
        }
        for server in pair:
            s = loaded[server.url]
            same_under_both_names(s)
            blocks = server.engine.engine.blocks
            assert s["vllm:kv_cache_usage_perc"] == blocks.num_used / blocks.num_pages
            assert blocks.num_used > 0
        assert loaded[busy.url]["vllm:num_requests_running"] == 2
        assert loaded[busy.url]["vllm:num_requests_waiting"] == 2
        assert loaded[light.url]["vllm:num_requests_running"] == 1
        assert loaded[light.url]["vllm:num_requests_waiting"] == 0
        assert pick(loaded) == light.url
    finally:
        for gate in gates.values():
            gate.open()
    assert all(f.result(PATIENCE_S) > 0 for f in futures)
    for server in pair:
        s = settled(server.url, {"num_requests_running": 0, "num_requests_waiting": 0})
        same_under_both_names(s)
        assert [s[f"vllm:{k}"] for k in LOAD[:2]] == [0, 0]
