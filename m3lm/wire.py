"""The messages between the API server and the engine loop, and their msgpack encoding.

The server sends `Add` and `Abort`; the engine answers once with `Ready` (or `Failed`), then
sends one `Outputs` per step holding every request's new tokens, a `Heartbeat` at a fixed
interval, and `Dead` if it stops on a fault. Token text is not in them: the server makes it
(`m3lm.text`). `EngineSpec` is what the engine process is started with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgspec

from m3lm.config import LoadSpec
from m3lm.core import SamplingParams, StepOutput


@dataclass
class EngineSpec:
    """How the engine process builds its engine (pickled into the new process)."""

    load: LoadSpec
    engine_kwargs: dict = field(default_factory=dict)
    eos_ids: tuple[int, ...] = ()  # the tokenizer's, which the engine process does not load
    log_level: int = logging.INFO
    threads: int | None = None  # torch's CPU threads (`m3lm.threads.use_threads`)
    heartbeat_s: float | None = None  # the heartbeat's interval (None: no heartbeat)


class ReadyInfo(msgspec.Struct, frozen=True):
    """What the server needs to know of the engine to validate and admit requests."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    generation_config: dict
    eos_ids: list[int]
    kv_tokens: int  # the KV pool's capacity in positions
    page_size: int  # positions a page holds (the MSA block size)
    kv_dtype: str  # K and V as stored
    index_dtype: str  # the MSA index keys as stored
    prefix_caching: bool
    device: str = "cpu"
    warmup_s: float = 0.0
    summary: str = ""  # the engine's startup line: device, dtype, weights, pool


class Add(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: ReadyInfo


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The engine could not start (a bad checkpoint, no memory for the cache, ...)."""

    error: str


class Dead(msgspec.Struct, tag=True, array_like=True):
    """The engine stopped on a fault; every open request is lost."""

    error: str


class Stats(msgspec.Struct, array_like=True):
    """The scheduler's gauges and counters after a step."""

    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    kv_pages: int = 1
    prompt_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    # speculative decoding since start: verifications with drafts, drafted and accepted tokens,
    # accepted ones by draft position
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)


class Outputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[StepOutput]
    stats: Stats


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    """The engine process is running (sent at a fixed interval, whatever the loop is doing)."""


ToEngine = Add | Abort | Shutdown
FromEngine = Ready | Failed | Dead | Outputs | Heartbeat

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(msg)


def encode_checked(msg: ToEngine) -> bytes:
    """`msg` encoded, once it is known to decode as the engine will decode it; ValueError when
    it cannot make the trip (an integer past 64 bits, a value the engine's types refuse)."""
    try:
        data = _encoder.encode(msg)
        _to_engine.decode(data)
    except (OverflowError, TypeError, ValueError, msgspec.MsgspecError) as e:
        raise ValueError(f"the request cannot be passed to the engine: {e}") from None
    return data


def decode_to_engine(data: bytes) -> ToEngine:
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)
