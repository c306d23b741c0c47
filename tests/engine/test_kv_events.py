"""KV-cache events: a subscriber written here (plain msgpack and ZeroMQ, none of m3lm's types)
rebuilds the prefix cache from the stream, over a workload with preemption, eviction and a
cache reset, and its view matches the engine's own exactly; pages' hashes are checked against a
SHA-256 chain computed here from the events' token ids."""

import hashlib
import json
import time
from array import array

import msgspec
import openai
import pytest
import zmq

from m3lm.config import EngineConfig
from m3lm.core import SamplingParams
from m3lm.engine.engine import LLMEngine
from tests.support.checkpoints import random_prompt, write_chat_checkpoint
from tests.support.paths import PATIENCE_S
from tests.support.processes import start_serve, stop, wait_healthy

PAGE = 4  # the tiny model's MSA block


class Subscriber:
    """A router's view of one engine's cache: hash -> (parent hash, the page's token ids)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str, topic: str):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)  # many replies to one request: REQ would take one
        self.replay.connect(replay_endpoint)
        self.view: dict[int, tuple[int | None, list[int]]] = {}
        self.seen: dict[int, tuple[int | None, list[int]]] = {}  # every page ever stored
        self.next = 0  # the batch number expected next
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0, "replayed": 0}

    def apply(self, number: int, payload: bytes) -> None:
        assert number == self.next, (number, self.next)
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and rank == 0
        for e in events:
            self.counts[e["type"]] += 1
            if e["type"] == "BlockStored":
                hashes, tokens = e["block_hashes"], e["token_ids"]
                assert e["block_size"] == PAGE and len(tokens) == PAGE * len(hashes)
                assert e["medium"] == "GPU"
                for i, h in enumerate(hashes):
                    parent = e["parent_block_hash"] if i == 0 else hashes[i - 1]
                    assert h not in self.view, "stored twice without a removal"
                    self.view[h] = self.seen[h] = (parent, tokens[i * PAGE : (i + 1) * PAGE])
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    del self.view[h]  # a removal of a page never stored would raise here
            else:
                assert e["type"] == "AllBlocksCleared"
                self.view.clear()
        self.next += 1

    def ask_replay(self) -> None:
        """Every kept batch from the next one expected, as a late subscriber asks for them."""
        self.replay.send_multipart((b"", self.next.to_bytes(8, "big")))
        while True:
            empty, number, payload = self.replay.recv_multipart()
            assert empty == b""
            if not payload:
                assert int.from_bytes(number, "big", signed=True) == -1
                return
            if int.from_bytes(number, "big") >= self.next:
                self.counts["replayed"] += 1
                self.apply(int.from_bytes(number, "big"), payload)

    def catch_up(self, last: int) -> None:
        """Take batches up to number `last` from the stream, replaying what it missed."""
        deadline = time.monotonic() + PATIENCE_S
        while self.next <= last:
            assert time.monotonic() < deadline, f"batch {self.next} never came"
            if self.sub.poll(50):
                _, number, payload = self.sub.recv_multipart()
                number = int.from_bytes(number, "big")
                if number > self.next:
                    self.ask_replay()
                if number == self.next:
                    self.apply(number, payload)
            else:
                self.ask_replay()

    def wait_for(self, hashes: set[int]) -> None:
        """Take batches until the view holds `hashes` (from a process whose batch count is unknown)."""
        deadline = time.monotonic() + PATIENCE_S
        while not hashes <= self.view.keys():
            assert time.monotonic() < deadline, "the pages were never stored"
            self.catch_up(self.next)

    def chain_checks(self) -> None:
        """Each page's hash is the low 64 bits of SHA-256 over its parent's name and its tokens,
        the names computed here from the token ids of the pages before it."""
        names: dict[int, bytes] = {}

        def name(h):
            if h not in names:
                parent, tokens = self.seen[h]
                names[h] = hashlib.sha256(
                    (b"" if parent is None else name(parent)) + array("q", tokens).tobytes()
                ).digest()
            return names[h]

        for h in self.view:
            assert int.from_bytes(name(h)[-8:], "big") == h


def engine_view(engine: LLMEngine) -> set[int]:
    return {int.from_bytes(n[-8:], "big") for n in engine.blocks.cached()}


def run(engine: LLMEngine, prompts: list[list[int]], tag: str, reset_after: int | None = None) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"{tag}{i}")
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == reset_after:
            assert engine.scheduler.running, "the reset falls while requests run"
            engine.reset_prefix_cache()


@pytest.fixture
def engine(tiny, tmp_path):
    config = EngineConfig(
        max_num_seqs=4,
        max_model_len=64,
        kv_cache_tokens=16 * PAGE,
        kv_events_config={
            "enable_kv_cache_events": True,
            "endpoint": f"ipc://{tmp_path}/events",
            "replay_endpoint": f"ipc://{tmp_path}/replay",
            "topic": "kv",
        },
    )
    engine = LLMEngine(tiny, None, config)
    yield engine
    engine.kv_events.close()


def test_a_subscriber_rebuilds_the_prefix_cache_from_the_events(engine, tmp_path):
    shared = random_prompt(12, seed=1)
    # before anyone listens: four prompts on one prefix, more pages than the pool holds
    run(engine, [shared + random_prompt(10, seed=10 + i) for i in range(4)], "a")
    assert engine.scheduler.num_preemptions > 0
    ctx = zmq.Context()
    try:
        sub = Subscriber(ctx, f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay", "kv")
        sub.catch_up(engine.kv_events.batches - 1)
        assert sub.counts["replayed"] == engine.kv_events.batches  # all of it missed, all replayed
        assert set(sub.view) == engine_view(engine) != set()

        # new prompts take the room of cached pages; the cache is reset while they run
        run(engine, [random_prompt(20, seed=20 + i) for i in range(3)], "b", reset_after=2)
        sub.catch_up(engine.kv_events.batches - 1)
        assert sub.counts["BlockRemoved"] > 0 and sub.counts["AllBlocksCleared"] == 1
        assert set(sub.view) == engine_view(engine)

        # the shared prefix again, on a cache that forgot it, beside the pages filled since the reset
        run(engine, [shared + random_prompt(8, seed=30 + i) for i in range(3)], "c")
        sub.catch_up(engine.kv_events.batches - 1)
        assert set(sub.view) == engine_view(engine) != set()
        assert len(sub.view) == len(engine.blocks.cached())
        sub.chain_checks()
        engine.blocks.check()
    finally:
        ctx.destroy(linger=0)


def test_no_events_are_recorded_unless_asked(tiny):
    engine = LLMEngine(tiny, None, EngineConfig(max_num_seqs=2, max_model_len=64, kv_cache_tokens=16 * PAGE))
    run(engine, [random_prompt(12, seed=1)], "x")
    assert engine.kv_events is None and engine.blocks.cached()
    assert engine.blocks.take_events() == [] and engine.blocks._events is None


def test_m3lm_serve_publishes_the_pages_a_request_fills(tmp_path):
    """The flag as users pass it: the engine process publishes, a subscriber that joins first sees
    the prompt's full pages under the names computed here."""
    checkpoint = write_chat_checkpoint(tmp_path / "ckpt", seed=5)
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{tmp_path}/events",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
    }
    proc, url = start_serve(checkpoint, "--served-model-name", "m", "--kv-events-config", json.dumps(events))
    ctx = zmq.Context()
    try:
        wait_healthy(proc, url)
        sub = Subscriber(ctx, events["endpoint"], events["replay_endpoint"], "")
        prompt = random_prompt(9, seed=4)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        client.completions.create(model="m", prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True})
        first = hashlib.sha256(array("q", prompt[:PAGE]).tobytes()).digest()
        second = hashlib.sha256(first + array("q", prompt[PAGE : 2 * PAGE]).tobytes()).digest()
        sub.wait_for({int.from_bytes(n[-8:], "big") for n in (first, second)})
        sub.chain_checks()
    finally:
        ctx.destroy(linger=0)
        stop(proc)
