"""The settings of the KV-cache events, as vLLM's `--kv-events-config` spells them (the events
themselves: `m3lm.cache.events`; their publisher: `m3lm.engine.kv_events`)."""

from __future__ import annotations

from dataclasses import dataclass

from m3lm.errors import ConfigError
from m3lm.json_settings import json_settings

KV_EVENTS_KEYS = (
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
)


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events over ZeroMQ, as vLLM's `--kv-events-config` spells them.

    Published when `enable_kv_cache_events` is true and `publisher` is "zmq" (its default then):
    a PUB socket at `endpoint` (bound when it holds `*`, `::`, or is ipc:// or inproc://, else
    connected) sends each batch as [topic, sequence number, msgpack]; with `replay_endpoint` a
    ROUTER socket answers a subscriber's sequence number with the last `buffer_steps` batches
    from it. `hwm`: batches ZeroMQ holds for a slow subscriber before it drops; `max_queue_size`:
    batches waiting for the publisher's thread before the engine drops them (a gap in the numbers).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError(
                f"kv_events_config: enable_kv_cache_events = {self.enable_kv_cache_events!r} must be true or false"
            )
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        if publisher not in ("zmq", "null"):
            raise ConfigError(f'kv_events_config: publisher = {publisher!r} must be "zmq" or "null"')
        object.__setattr__(self, "publisher", publisher)
        for key in ("endpoint", "topic"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"kv_events_config: {key} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ConfigError("kv_events_config: replay_endpoint must be a string")
        for key, least in (
            ("buffer_steps", 1),
            ("max_queue_size", 1),
            ("hwm", 1),
        ):  # ZeroMQ reads 0 as unbounded
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ConfigError(f"kv_events_config: {key} = {v!r} must be an integer >= {least}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: KVEventsConfig | dict | str | None) -> KVEventsConfig | None:
        """From a KVEventsConfig, a dict or its JSON text (the command line's form); None stays None."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        return cls(**json_settings(value, "kv_events_config", KV_EVENTS_KEYS))
