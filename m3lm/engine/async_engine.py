"""Runs an `LLMEngine` on its own thread so the server's event loop never waits on model compute.

Requests are validated and admitted synchronously (so the server can answer 400 or 503 before
sending response headers), then their outputs arrive on an asyncio queue. A consumer that stops
listening (a disconnected client) aborts its request, which frees its pages at once.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from m3lm.core import SamplingParams
from m3lm.engine.engine import LLMEngine, StepOutput


class QueueFull(Exception):
    """The admission queue is full: the client should retry later (HTTP 503)."""


class EngineDead(Exception):
    """The engine thread stopped after an internal fault."""


class Interrupted(Exception):
    """The server ended the request (it is shutting down)."""


_END = object()  # put by `abort` so that an iterator waiting for the next output wakes and ends


class RequestStream:
    """The outputs of one request, as an async iterator; closing it early aborts the request.

    After `abort` the iterator ends at once: the engine sends nothing more for an aborted request.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, prompt_ids: list[int]):
        self.owner, self.request_id, self.prompt_ids = owner, request_id, prompt_ids
        self.queue: asyncio.Queue[StepOutput | BaseException | object] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        try:
            while True:
                item = await self.queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
                if item.finished:
                    return
        finally:
            if not self.finished:
                self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)
            self.queue.put_nowait(_END)

    def _put(self, item: StepOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_queue: int = 256,
        observer: Callable[[list[StepOutput], LLMEngine], None] | None = None,
        cpu_threads: int | None = 1,
    ):
        self.engine, self.max_queue, self.observer = engine, max_queue, observer
        # On the CPU, intra-op parallelism driven from a thread other than the main one ran 2-4x
        # slower per step than one thread (measured on 2 cores), so the engine thread uses one.
        self.cpu_threads = cpu_threads
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="m3lm-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._streams)

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def add(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Admit a request or raise: ValueError (bad prompt), QueueFull, EngineDead."""
        if self.error is not None:
            raise EngineDead(self.error)
        request_id = request_id or f"req-{next(self._ids)}"
        self.engine.validate(prompt_ids, params)
        with self._lock:
            if len(self._streams) >= self.engine.config.max_num_seqs + self.max_queue:
                raise QueueFull("the server is at capacity; retry later")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            stream = RequestStream(self, request_id, list(prompt_ids))
            self._streams[request_id] = stream
        self._inbox.put(("add", request_id, stream.prompt_ids, params, time.perf_counter()))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def interrupt_all(self, reason: str) -> None:
        """End every open request: each is aborted and its stream raises Interrupted(reason)."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            self.abort(stream.request_id)
            stream._put(Interrupted(reason))

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                _, rid, ids, params, arrival = item
                with self._lock:
                    stream = self._streams.get(rid)
                if stream is None or stream.finished:  # aborted before it started
                    self._forget(rid)
                    continue
                try:
                    self.engine.add_request(ids, params, rid).arrival = arrival
                except ValueError as e:
                    self._forget(rid)
                    stream._put(e)
            else:
                self.engine.abort(item[1])
                self._forget(item[1])

    def _forget(self, request_id: str) -> RequestStream | None:
        with self._lock:
            return self._streams.pop(request_id, None)

    def _run(self) -> None:
        if self.engine.device.type == "cpu" and self.cpu_threads:
            import torch

            torch.set_num_threads(self.cpu_threads)
        try:
            while not self._stop:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    if self.observer is not None:
                        self.observer([], self.engine)  # gauges follow aborts even when idle
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if self.observer is not None:
                    self.observer(outputs, self.engine)
                for out in outputs:
                    with self._lock:
                        stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream._put(out)
                        if out.finished:
                            self._forget(out.request_id)
        except Exception as e:  # an engine fault: fail every open request, report unhealthy
            self.error = f"{type(e).__name__}: {e}"
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream._put(EngineDead(self.error))
