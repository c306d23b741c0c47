"""KV-cache events on ZeroMQ in vLLM's wire format, for routers that place requests where their
prefix is cached (llm-d's precise prefix scorer, NVIDIA Dynamo's KV router).

Each engine step that changed the prefix cache sends one batch: the frames [topic, sequence
number (8 bytes, big-endian), msgpack of `KVEventBatch`]. A batch is an array [ts, events,
data_parallel_rank]; an event is a map tagged by `type`: `BlockStored`, `BlockRemoved`,
`AllBlocksCleared`. A block is one page: 128 positions of K, V and the MSA index keys of every
layer. Its hash is the low 64 bits of the page's name (`cache.block_manager.page_key`: SHA-256
of the parent page's name and the page's token ids), as an unsigned integer, vLLM's default form;
the parent of a chain's first page is none, or the cache salt's root when the request has one.

The engine thread only queues what its step recorded (`publish`); a thread of the publisher's
own encodes, sends, keeps the last `buffer_steps` batches and answers replay requests on a
ROUTER socket: frames [identity, "", first sequence number] get [identity, "", number, batch]
for each kept batch from there, then [identity, "", -1, ""].
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from m3lm.cache.events import CacheCleared, PageEvent, PagesRemoved, PagesStored
from m3lm.errors import ConfigError
from m3lm.kv_events_config import KVEventsConfig

log = logging.getLogger("m3lm.kv_events")
MEDIUM = "GPU"  # vLLM's name for the engine's own page pool (what routers score), whatever the device
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def block_hash(name: bytes) -> int:
    """A page's name as the events carry it: its low 64 bits, unsigned."""
    return int.from_bytes(name[-8:], "big")


def to_wire(events: list[PageEvent], page_size: int) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The block manager's events as vLLM's (pure). One cache group, every position kept: M3's
    sparse attention selects among pages but never drops one."""
    out = []
    for e in events:
        if isinstance(e, PagesStored):
            parent = None if e.parent is None else block_hash(e.parent)
            hashes = [block_hash(n) for n in e.names]
            out.append(
                BlockStored(hashes, parent, e.token_ids, page_size, None, MEDIUM, None, 0, "full_attention")
            )
        elif isinstance(e, PagesRemoved):
            out.append(BlockRemoved([block_hash(n) for n in e.names], MEDIUM, 0))
        else:
            assert isinstance(e, CacheCleared)
            out.append(AllBlocksCleared())
    return out


def binds(endpoint: str) -> bool:
    """Whether the publisher binds `endpoint` (an address of its own) or connects to it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """One engine's publisher: its sockets, its thread, the batches kept for replay (all bounded
    by the settings)."""

    def __init__(self, config: KVEventsConfig, page_size: int):
        self.page_size, self.config = page_size, config
        self.dropped = 0  # batches the engine could not queue (a gap in the numbers)
        self.batches = 0  # batches numbered so far: the next one's number
        self._queue: queue.Queue = queue.Queue(config.max_queue_size)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(0)
            raise ConfigError(f"kv_events_config: {e}") from None
        self._topic = config.topic.encode()
        self._thread = threading.Thread(target=self._run, name="m3lm-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[PageEvent]) -> None:
        """Queue one step's events as the next batch (on the engine's thread; never blocks)."""
        if not events:
            return
        number, self.batches = self.batches, self.batches + 1
        try:
            self._queue.put_nowait((number, time.time(), events))
        except queue.Full:
            if not self.dropped:
                log.warning("KV events: the publisher is behind; batches are dropped (max_queue_size)")
            self.dropped += 1

    def close(self) -> None:
        """Send what is queued, then stop (the sockets close with the thread); again: nothing."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._ctx.term()

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._answer_replay()
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    return
                number, ts, events = item
                payload = encode(KVEventBatch(ts, to_wire(events, self.page_size), 0))
                # past the high-water mark a PUB socket drops for that subscriber, never blocks
                self._pub.send_multipart((self._topic, number.to_bytes(8, "big"), payload))
                self._kept.append((number, payload))
        finally:
            self._pub.close(0)
            if self._replay is not None:
                self._replay.close(0)

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames was ignored", len(frames))
            return
        who, start = frames[0], int.from_bytes(frames[2], "big")
        for number, payload in self._kept:
            if number >= start:
                self._replay.send_multipart((who, b"", number.to_bytes(8, "big"), payload))
        self._replay.send_multipart((who, b"", END_OF_REPLAY, b""))
