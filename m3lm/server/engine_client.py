"""The server's handle on the engine: admits requests, streams their outputs, turns ids into text.

The engine loop (`engine_loop.EngineLoop`) runs in its own process (`AsyncEngine.spawn`, what
`m3lm serve` does) or on a thread (`AsyncEngine(llm_engine)`), and the two talk over ZeroMQ
either way. Each engine step arrives as one message; a receiver thread hands it to the event
loop in one call, where each request's new tokens become text (`m3lm.text`, as offline). This
module imports none of the engine's own modules (the model, the caches, the step): the server
process that uses it runs no model.
Requests are validated and admitted synchronously (so the server can answer 400 or 503 before
sending response headers). A consumer that stops listening (a disconnected client) aborts its
request, which frees its pages at once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import multiprocessing
import os
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import zmq

from m3lm import wire as m
from m3lm.core import SamplingParams, StepOutput, validate_request
from m3lm.errors import M3lmError
from m3lm.text.detokenize import TextStream
from m3lm.threads import quiet_waits
from m3lm.wire import EngineSpec

if TYPE_CHECKING:
    from m3lm.engine.engine import LLMEngine

log = logging.getLogger("m3lm.engine")


class QueueFull(Exception):
    """The admission queue is full: the client should retry later (HTTP 503)."""


class EngineDead(Exception):
    """The engine stopped after an internal fault."""


class EngineStartError(M3lmError):
    """The engine could not start: the message says why."""


class Interrupted(Exception):
    """The server ended the request (it is shutting down)."""


class EngineStalled(Interrupted):
    """The engine has not answered (no heartbeat) for longer than the server waits."""


_END = object()  # put by `abort` so that an iterator waiting for the next output wakes and ends


class RequestStream:
    """The outputs of one request, as an async iterator; closing it early aborts the request.

    Outputs that arrive while the consumer is busy come out merged, as one output: a slow
    consumer gets fewer, larger pieces and never falls behind. After `abort` the iterator ends.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, prompt_ids: list[int], params: SamplingParams):
        self.owner, self.request_id, self.prompt_ids = owner, request_id, prompt_ids
        self.loop = asyncio.get_running_loop()
        self.finished = False
        self.arrival = time.perf_counter()
        self.last_token_time: float | None = None
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()
        self._text = TextStream(owner.tokenizer, params) if owner.tokenizer is not None else None
        self._done = False  # the consumer has had the last output

    async def next(self, timeout: float | None = None) -> StepOutput | None:
        """The next output (merged with any others already waiting), None when `timeout` seconds
        pass without one; raises StopAsyncIteration at the end, or the stream's error."""
        if self._done:
            raise StopAsyncIteration
        if not self._items:
            self._ready.clear()
            timer = self.loop.call_later(timeout, self._ready.set) if timeout is not None else None
            await self._ready.wait()
            if timer is not None:
                timer.cancel()
            if not self._items:
                return None
        merged = None
        while self._items:
            item = self._items.popleft()
            if isinstance(item, StepOutput):
                merged = item if merged is None else merged.extend(item)
                continue
            if merged is not None:
                self._items.appendleft(item)
                break
            self._done = self.finished = True
            if item is _END:
                raise StopAsyncIteration
            raise item
        self._done = merged.finished
        self.finished = self.finished or merged.finished  # an aborted stream stays finished
        return merged

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        try:
            while True:
                try:
                    yield await self.next()
                except StopAsyncIteration:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """The consumer has stopped: abort the request unless it has ended."""
        if not self.finished:
            self.abort()

    def abort(self, completed: bool = False) -> None:
        """End the request now; `completed`: its reply is whole (a stop string the server found
        ended it), so it counts in the end-to-end latency as a finished request does."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)
            self._put(_END)
            if completed and self.owner.metrics is not None:
                self.owner.metrics.observe_end(self, time.perf_counter())

    def _put(self, item) -> None:
        self._items.append(item)
        self._ready.set()

    def receive(self, res: StepOutput, now: float) -> StepOutput:
        """Turn the engine's output into text (on the event loop) and queue it."""
        if self._text is not None and self._text.fill(res):
            self.owner.abort(self.request_id)  # the engine may have made more: they are dropped
        if res.new_token_ids:
            self.last_token_time = now
        self._put(res)
        return res


def _engine_process(spec: EngineSpec, in_addr: str, out_addr: str, parent_pid: int) -> None:
    """The engine process's entry (named here, so that the server never imports the engine)."""
    from m3lm.engine.engine_loop import run_engine_process

    run_engine_process(spec, in_addr, out_addr, parent_pid)


class AsyncEngine:
    """`AsyncEngine(llm_engine)` runs the loop on a thread; `AsyncEngine.spawn(spec, tokenizer)`
    in a process of its own. Call `start()` (it returns once the engine is ready), then `add`."""

    def __init__(
        self,
        engine: LLMEngine | None,
        max_queue: int = 256,
        tokenizer=None,
        cpu_threads: int | None = 1,
        timeout_s: float | None = 5.0,
    ):
        self.engine = engine  # the in-process engine, when the loop runs on a thread
        self.tokenizer = tokenizer if engine is None else engine.tokenizer
        self.max_queue, self.cpu_threads = max_queue, cpu_threads
        # Without a message for `timeout_s` the engine counts as stalled; it beats 5 times as often.
        self.timeout_s = timeout_s
        self.heartbeat_s = None if timeout_s is None else timeout_s / 5
        self._last_heard = time.monotonic()
        self._stalled = False
        self.metrics = None  # server.metrics.Metrics, set by the server
        self.on_dead: Callable[[str], None] | None = None
        self.info: m.ReadyInfo | None = None
        self.error: str | None = None
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._prefix = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._ctx = zmq.Context()
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._proc = None
        self._spec: EngineSpec | None = None
        self._worker: threading.Thread | None = None
        self._receiver = threading.Thread(target=self._receive, name="m3lm-engine-out", daemon=True)
        self._tmp = None
        if engine is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="m3lm-")
            base = f"ipc://{self._tmp.name}/"
        else:
            base = f"inproc://m3lm-{self._prefix}-"
        self._in_addr, self._out_addr = base + "in", base + "out"
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._from_engine = self._ctx.socket(zmq.PULL)
        for s in (self._to_engine, self._from_engine):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
        self._to_engine.bind(self._in_addr)
        self._from_engine.bind(self._out_addr)

    @classmethod
    def spawn(
        cls, spec: EngineSpec, tokenizer=None, max_queue: int = 256, timeout_s: float | None = 5.0
    ) -> AsyncEngine:
        self = cls(None, max_queue, tokenizer, timeout_s=timeout_s)
        self._spec = dataclasses.replace(spec, heartbeat_s=self.heartbeat_s)
        return self

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.error is None and self.info is not None and not self._stop.is_set()

    @property
    def health_error(self) -> str | None:
        """Why the engine cannot serve now (stopped, or not answering), or None."""
        if self.error is not None:
            return self.error
        if self.info is None or self._stop.is_set():
            return "the engine is not running"
        if self._stalled:
            return self._stall_message()
        return None

    def _stall_message(self) -> str:
        return f"the engine has not answered for {time.monotonic() - self._last_heard:.1f} s"

    @property
    def num_active(self) -> int:
        return len(self._streams)

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def start(self, timeout: float | None = None) -> AsyncEngine:
        """Start the engine and wait until it is ready; raises EngineStartError if it cannot start."""
        if self._spec is not None:
            quiet_waits()  # the engine process inherits it before it imports torch
            ctx = multiprocessing.get_context("spawn")
            self._proc = ctx.Process(
                target=_engine_process,
                args=(self._spec, self._in_addr, self._out_addr, os.getpid()),
                name="m3lm-engine",
            )
            self._proc.start()
        else:
            self._worker = threading.Thread(target=self._run_loop, name="m3lm-engine", daemon=True)
            self._worker.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._from_engine.poll(200):
                msg = m.decode_from_engine(self._from_engine.recv())
                if isinstance(msg, m.Heartbeat):
                    continue
                if isinstance(msg, m.Ready):
                    self.info = msg.info
                    self._last_heard = time.monotonic()
                    break
                self.stop()
                raise EngineStartError(msg.error)
            if not self._engine_running():
                code = self._proc.exitcode if self._proc is not None else None
                self.stop()
                raise EngineStartError(f"the engine exited while starting (exit code {code})")
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                raise EngineStartError(f"the engine did not start within {timeout} s")
        self._receiver.start()
        return self

    def _run_loop(self) -> None:
        from m3lm.engine.engine_loop import EngineLoop, engine_info, warm_up_if_on
        from m3lm.threads import use_threads

        engine = self.engine
        use_threads(engine.model, self.cpu_threads)
        loop = EngineLoop(engine, self._ctx, self._in_addr, self._out_addr, heartbeat_s=self.heartbeat_s)
        try:
            try:
                warm = warm_up_if_on(engine)
            except Exception as e:  # a start failure, reported as the engine process reports it
                log.debug("the engine could not start", exc_info=True)
                loop.send(m.Failed(str(e) or type(e).__name__))
                return
            loop.send(m.Ready(engine_info(engine, warm)))
            loop.run()
        except Exception:
            log.exception("the engine stopped on a fault")
        finally:
            loop.close()

    def _engine_running(self) -> bool:
        if self._proc is not None:
            return self._proc.exitcode is None
        return self._worker is not None and self._worker.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self.info is not None:  # an engine still starting reads no messages: it is killed below
            self._send(m.Shutdown())
        if self._worker is not None:
            self._worker.join(timeout)
        if self._proc is not None:
            self._proc.join(timeout)
            if self._proc.exitcode is None:
                self._proc.kill()
                self._proc.join(5)
        if self._receiver.is_alive() and threading.current_thread() is not self._receiver:
            self._receiver.join(2)
        with self._send_lock:
            self._to_engine.close(0)
        self._from_engine.close(0)
        self._ctx.term()
        if self._tmp is not None:
            self._tmp.cleanup()

    # -- requests ----------------------------------------------------------------------------

    def default_params(self, **overrides) -> SamplingParams:
        return SamplingParams.from_generation_config(self.info.generation_config, **overrides)

    def validate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        validate_request(prompt_ids, params, self.info.max_model_len, self.info.vocab_size)

    def add(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Admit a request or raise: ValueError (bad prompt or settings), QueueFull, EngineDead,
        EngineStalled.

        Everything that can fail is done before the request is registered: once it holds a place
        in the queue it is on its way to the engine, and only its stream's end or abort frees it.
        """
        if self.error is not None:
            raise EngineDead(self.error)
        if self._stalled:
            raise EngineStalled(self._stall_message())
        request_id = request_id or f"req-{next(self._ids)}"
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, params)
        if len(self._streams) >= self.info.max_num_seqs + self.max_queue:
            raise QueueFull("the server is at capacity; retry later")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        wire = m.encode_checked(m.Add(request_id, prompt_ids, params))
        stream = RequestStream(self, request_id, prompt_ids, params)
        self._streams[request_id] = stream
        self._send_bytes(wire)
        return stream

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._send(m.Abort([request_id]))

    def interrupt_all(self, reason: str) -> None:
        """End every open request: each is aborted and its stream raises Interrupted(reason)."""
        self._end_all(Interrupted(reason), abort=True)

    def _end_all(self, error: Exception, abort: bool) -> None:
        """End every open request with `error` (from any thread); `abort` tells the engine to
        drop them too, for when it can still hear."""
        streams, self._streams = list(self._streams.values()), {}
        if abort and streams:
            self._send(m.Abort([s.request_id for s in streams]))
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream._put, error)

    def _send(self, msg) -> None:
        self._send_bytes(m.encode(msg))

    def _send_bytes(self, data: bytes) -> None:
        with self._send_lock:
            if self._to_engine.closed:
                return
            try:  # never blocks: with no engine connected a PUSH socket would wait forever
                self._to_engine.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                log.warning("the engine is not connected: a message was dropped")

    # -- outputs -----------------------------------------------------------------------------

    def _receive(self) -> None:
        """The receiver thread: one decoded message per engine step, handed to the event loops."""
        while not self._stop.is_set():
            try:
                ready = self._from_engine.poll(100)
            except zmq.ZMQError:
                return
            if not ready:
                if not self._engine_running() and not self._stop.is_set():
                    code = self._proc.exitcode if self._proc is not None else None
                    self._die(f"the engine process exited with code {code}")
                    return
                self._check_heartbeat()
                continue
            msg = m.decode_from_engine(self._from_engine.recv())
            self._last_heard = time.monotonic()
            if self._stalled:
                self._stalled = False
                log.warning("the engine answers again")
            if isinstance(msg, m.Outputs):
                self._hand_out(msg)
            elif isinstance(msg, (m.Dead, m.Failed)):
                self._die(msg.error)
                return

    def _hand_out(self, msg: m.Outputs) -> None:
        """On the receiver thread: the step's stats to the metrics, each output to its stream's loop."""
        if self.metrics is not None:
            self.metrics.observe_stats(msg.stats)
        by_loop: dict = {}
        for out in msg.outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, pairs in by_loop.items():
            loop.call_soon_threadsafe(self._dispatch, pairs)

    def _dispatch(self, pairs: list[tuple[RequestStream, StepOutput]]) -> None:
        """On the event loop: each request's new text, then its stream's queue."""
        now = time.perf_counter()
        for stream, out in pairs:
            if stream.finished or self._streams.get(stream.request_id) is not stream:
                continue  # aborted meanwhile
            previous = stream.last_token_time
            try:
                res = stream.receive(out, now)
            except Exception as e:  # a fault in one request's text ends that request only
                log.exception("detokenizing %s failed", stream.request_id)
                self.abort(stream.request_id)
                err = f"{type(e).__name__}: {e}"
                res = StepOutput(stream.request_id, finished=True, finish_reason="error", error=err)
                stream._put(res)
            if res.finished:
                self._streams.pop(stream.request_id, None)
            if self.metrics is not None:
                self.metrics.observe_output(stream, res, previous, out.queued_s, now)

    def _check_heartbeat(self) -> None:
        """On the receiver thread: past `timeout_s` without a message, the engine is stalled; its
        open requests end with EngineStalled (and are aborted, for when it resumes), new ones are
        refused until it answers again."""
        if self.timeout_s is None or self._stalled:
            return
        if time.monotonic() - self._last_heard > self.timeout_s:
            self._stalled = True
            message = self._stall_message()
            log.error("%s: ending %d open request(s) until it answers", message, len(self._streams))
            self._end_all(EngineStalled(message), abort=True)

    def _die(self, error: str) -> None:
        self.error = error
        log.error("the engine stopped: %s", error)
        self._end_all(EngineDead(error), abort=False)
        if self.on_dead is not None:
            self.on_dead(error)
