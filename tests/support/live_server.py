"""The app as `m3lm serve` serves it, in this process: uvicorn on a free loopback port with the
served settings, an engine on a small checkpoint, and the engine-side levers the tests pull
(a scripted sampler, a stalled step)."""

import socket
import threading
import time

import torch

import m3lm
from m3lm.config import EngineConfig
from m3lm.engine.engine import LLMEngine
from m3lm.sampler import SampleOutput
from m3lm.server.app import create_server_app, draining_server, server_config
from m3lm.server.engine_client import AsyncEngine
from m3lm.server.protocol import Limits
from tests.support.paths import PATIENCE_S

API_KEY = "sk-test-123"
NAME = "tiny"
MSG = [{"role": "user", "content": "once upon a time"}]


class LiveServer:
    """uvicorn serving the app in a thread, on a free loopback port, with the served settings."""

    def __init__(self, app, limits: Limits | None = None, drain_s: float | None = None):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = server_config(app, limits or Limits(), grace_s=2, log_level="warning")
        # drain_s: SIGTERM (handle_exit) drains for that long, as `m3lm serve` does
        self.server = uvicorn.Server(config) if drain_s is None else draining_server(config, app, drain_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + PATIENCE_S
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def start(checkpoint, api_key=API_KEY, limits=None, grace_s=None, **engine_kwargs):
    """A LiveServer on `checkpoint` with `.engine` (its AsyncEngine)."""
    model, tok = m3lm.load(checkpoint, device="cpu")
    cfg = {"max_model_len": 256, "max_num_seqs": 16, **engine_kwargs}
    limits = limits or Limits()
    engine = AsyncEngine(
        LLMEngine(model, tok, EngineConfig(**cfg)), limits.max_queue, timeout_s=limits.engine_timeout_s
    ).start()
    server = LiveServer(create_server_app(engine, tok, NAME, api_key, limits), limits, grace_s)
    server.engine = engine
    return server


def wait_idle(engine, timeout=PATIENCE_S):
    """Until `engine` (an AsyncEngine) holds no request and no page."""
    blocks = engine.engine.blocks
    deadline = time.time() + timeout
    while blocks.num_free != blocks.num_pages or engine.num_active:
        assert time.time() < deadline, f"{blocks.num_used} pages still in use"
        time.sleep(0.02)


class Script:
    """A sampler that writes a fixed reply, to drive reasoning and tool calls end to end."""

    def __init__(self, ids):
        self.ids, self.pos = ids, {}

    def __call__(self, logits, params, prompt_ids, output_ids, generators):
        out = [self.ids[min(len(o), len(self.ids) - 1)] for o in output_ids]
        return SampleOutput(torch.tensor(out))


def stalled_engine(live, seconds: float):
    """Make the engine's next model step take `seconds` longer (a long prefill, a busy GPU)."""
    runner = live.engine.engine.runner
    real = runner.run
    calls = []

    def slow(*a, **k):
        if not calls:
            calls.append(1)
            time.sleep(seconds)
        return real(*a, **k)

    runner.run = slow
    return lambda: setattr(runner, "run", real)
