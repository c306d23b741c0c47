"""The engine side of the server: requests in, one batch of outputs per step out, over ZeroMQ.

`EngineLoop` drives an `LLMEngine` (no tokenizer: the server makes the text) from `Add`/`Abort`
messages and sends one `Outputs` per step. It runs in its own process for `m3lm serve`
(`run_engine_process`, which also loads the model), or on a thread of the server (tests,
torchrun's rank 0). The server binds both sockets; the loop connects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import sys
import threading
import time

import zmq

from m3lm import wire as m
from m3lm.core import StepOutput
from m3lm.engine.engine import LLMEngine
from m3lm.threads import use_threads
from m3lm.wire import EngineSpec

log = logging.getLogger("m3lm.engine")
IDLE_POLL_MS = 100  # how long an idle loop sleeps before checking on its parent
WATCH_S = 0.1  # how often the watch thread looks for its parent (and beats, when a beat is due)
ORPHAN_GRACE_S = 0.5  # the parent gone, how long the loop may take to notice before the watch ends it


def engine_info(engine: LLMEngine, warmup_s: float = 0.0) -> m.ReadyInfo:
    return m.ReadyInfo(
        max_model_len=engine.max_model_len,
        vocab_size=engine.model.args.vocab_size,
        max_num_seqs=engine.config.max_num_seqs,
        generation_config=dict(engine.generation_config or {}),
        eos_ids=sorted(engine.eos_ids),
        kv_tokens=engine.info.pool_tokens,
        page_size=engine.blocks.page_size,
        kv_dtype=_dtype(engine.cache.k[0]),
        index_dtype=next((_dtype(ik) for ik in engine.cache.ik.values()), "none"),  # none: no MSA layer
        prefix_caching=engine.config.prefix_caching,
        device=str(engine.device),
        warmup_s=warmup_s,
        summary=engine.info.summary(),
    )


def _dtype(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def engine_stats(engine: LLMEngine) -> m.Stats:
    s = engine.scheduler
    spec = engine.speculator.stats if engine.speculator is not None else None
    return m.Stats(
        len(s.running),
        len(s.waiting),
        engine.blocks.num_used,
        engine.blocks.num_pages,
        s.prompt_tokens,
        s.prefix_cached_tokens,
        s.num_preemptions,
        *(
            (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, list(spec.accepted_per_pos))
            if spec is not None
            else ()
        ),
    )


class EngineLoop:
    """With `heartbeat_s`, a thread sends a `Heartbeat` that often while the loop runs: it beats
    whatever the loop is doing (a long step is not a stall), and stops only when the process
    does (stopped, frozen, starved of its interpreter) or the loop ends.

    With `parent_pid` (its own process), the loop stops once the parent has gone; the same
    thread ends the process (`leave`) if the loop is inside a step that long after it has."""

    def __init__(
        self,
        engine: LLMEngine,
        ctx: zmq.Context,
        in_addr: str,
        out_addr: str,
        parent_pid: int | None = None,
        heartbeat_s: float | None = None,
    ):
        self.engine, self.parent_pid = engine, parent_pid
        self.ctx, self.in_addr, self.out_addr, self.heartbeat_s = ctx, in_addr, out_addr, heartbeat_s
        self._stopped = threading.Event()
        self._heart: threading.Thread | None = None
        self.inbox = ctx.socket(zmq.PULL)
        self.outbox = ctx.socket(zmq.PUSH)
        for s in (self.inbox, self.outbox):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
        self.inbox.connect(in_addr)
        self.outbox.connect(out_addr)
        self._stats: m.Stats | None = None

    def send(self, msg) -> None:
        self.outbox.send(m.encode(msg), copy=False)

    def close(self) -> None:
        self._stopped.set()
        if self._heart is not None:
            self._heart.join()
        try:
            if self.engine.kv_events is not None:
                self.engine.kv_events.close()
        finally:  # sockets left open would hang their context's end
            self.inbox.close(0)
            self.outbox.close(0)

    def _watch(self) -> None:
        """The watch thread: heartbeats on a socket of its own (ZeroMQ sockets are not shared by
        threads), and the parent looked for."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.out_addr)
        beat = m.encode(m.Heartbeat())
        due = orphaned = None
        try:
            while not self._stopped.wait(min(WATCH_S, self.heartbeat_s or WATCH_S)):
                now = time.monotonic()
                if self.heartbeat_s and (due is None or now >= due):
                    with contextlib.suppress(zmq.Again):
                        sock.send(beat, zmq.NOBLOCK)
                    due = now + self.heartbeat_s
                if self._orphaned():
                    orphaned = orphaned or now
                    if now - orphaned > ORPHAN_GRACE_S:
                        leave(self.in_addr)
        finally:
            sock.close(0)

    def _orphaned(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def _receive(self, timeout_ms: int) -> bool:
        """Apply every waiting message; False once told to stop."""
        if not self.inbox.poll(timeout_ms):
            return True
        while True:
            try:
                msg = m.decode_to_engine(self.inbox.recv(zmq.NOBLOCK, copy=False).buffer)
            except zmq.Again:
                return True
            if isinstance(msg, m.Add):
                try:
                    self.engine.add_request(msg.prompt_ids, msg.params, msg.request_id)
                except ValueError as e:
                    self._publish(
                        [StepOutput(msg.request_id, finished=True, finish_reason="error", error=str(e))]
                    )
            elif isinstance(msg, m.Abort):
                for rid in msg.request_ids:
                    self.engine.abort(rid)
            else:
                return False

    def _publish(self, outputs: list[StepOutput]) -> None:
        """Send the step's outputs with the scheduler's stats; nothing when both are unchanged."""
        stats = engine_stats(self.engine)
        if outputs or stats != self._stats:
            self._stats = stats
            self.send(m.Outputs(outputs, stats))

    def run(self) -> None:
        """Serve until `Shutdown` or the parent's exit; a fault is reported as `Dead`, then raised."""
        engine = self.engine
        if self.heartbeat_s or self.parent_pid is not None:
            self._heart = threading.Thread(target=self._watch, name="m3lm-heartbeat", daemon=True)
            self._heart.start()
        try:
            while self._receive(0 if engine.has_unfinished() else IDLE_POLL_MS):
                if self._orphaned():
                    log.warning("the server process has gone: the engine stops")
                    return
                if engine.has_unfinished():
                    self._publish(engine.step())
                else:
                    self._publish([])  # aborts may have changed the gauges
        except Exception as e:
            self.send(m.Dead(f"{type(e).__name__}: {e}"))
            raise
        finally:
            self._stopped.set()


def build_engine(spec: EngineSpec):
    """Load the model (rank 0 of a group under tensor parallelism) -> (LLMEngine, group or None)."""
    from m3lm.config import EngineConfig
    from m3lm.engine.launch import load_for_engine

    load = spec.load
    if load.tensor_parallel_size == 1:  # this process needs no tokenizer (the server has one)
        load = dataclasses.replace(load, skip_tokenizer_init=True)
    model, _, group = load_for_engine(load)
    use_threads(model, spec.threads)

    def tokenizer():  # for structured output's grammars, loaded when the first one compiles
        from m3lm.tokenizer import load_tokenizer

        return load_tokenizer(spec.load.model_dir)

    try:
        engine = LLMEngine(
            model, None, EngineConfig(**spec.engine_kwargs), eos_ids=spec.eos_ids, grammar_tokenizer=tokenizer
        )
    except BaseException:
        if group is not None:
            group.shutdown(timeout=5.0)
        raise
    return engine, group


def run_engine_process(spec: EngineSpec, in_addr: str, out_addr: str, parent_pid: int) -> None:
    """Entry point of the engine process: build, answer `Ready` or `Failed`, then serve."""
    # Ctrl-C reaches the whole process group; the server decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    loop = None
    group = None
    code = 0
    try:
        start = time.perf_counter()
        try:
            engine, group = build_engine(spec)
            warm = warm_up_if_on(engine)
        except Exception as e:
            log.debug("the engine could not start", exc_info=True)
            out = ctx.socket(zmq.PUSH)
            out.setsockopt(zmq.LINGER, 2000)
            out.setsockopt(zmq.SNDTIMEO, 5000)  # the server may be gone too
            out.connect(out_addr)
            with contextlib.suppress(zmq.Again):
                out.send(m.encode(m.Failed(str(e) or type(e).__name__)))
            out.close()
            code = 1
            return
        loop = EngineLoop(engine, ctx, in_addr, out_addr, parent_pid, spec.heartbeat_s)
        log.info("engine ready in %.1f s", time.perf_counter() - start)
        loop.send(m.Ready(engine_info(engine, warm)))
        loop.run()
    except Exception:
        log.exception("the engine stopped on a fault")
        code = 1
    finally:
        if loop is not None:
            loop.close()
        ctx.destroy(linger=0)
        if group is not None:
            group.shutdown(timeout=10.0)
        if os.getppid() != parent_pid:  # the server has gone without removing its socket folder
            remove_ipc_folder(in_addr)
        sys.stdout.flush()
        sys.stderr.flush()
        if code:
            os._exit(code)


def leave(in_addr: str) -> None:
    """End the engine process now: its server has gone while a step was under way."""
    log.warning("the server process has gone during a step: the engine stops")
    remove_ipc_folder(in_addr)
    logging.shutdown()
    os._exit(0)


def remove_ipc_folder(addr: str) -> None:
    """Remove the folder of an `ipc://FOLDER/NAME` address (the server makes one per engine)."""
    if addr.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(addr.removeprefix("ipc://")), ignore_errors=True)


def warm_up_if_on(engine: LLMEngine) -> float:
    """Compile every kernel variant and capture every graph serving can need (GPU only, and
    unless `EngineConfig.warmup` is off); returns its seconds."""
    if not engine.config.warmup:
        return 0.0
    from m3lm.engine.warmup import warm_up as run

    return run(engine, progress=True).seconds
