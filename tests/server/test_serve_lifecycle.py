"""`m3lm serve`'s start and stop, as a user meets them: real processes, real signals, real HTTP.

The port is held before the model loads (a port in use is one line at once); Ctrl-C or SIGTERM
during start-up stops the server and its engine process with one line; Ctrl-C while serving
drains as SIGTERM does, and a second one stops at once; a device this machine lacks is refused
before the engine starts. Each test waits on states (a process, a line, a stream's event), with
PATIENCE_S only as an outer bound.
"""

import json
import signal
import socket
import threading
from pathlib import Path

import httpx
import pytest

from tests.support.paths import PATIENCE_S
from tests.support.processes import Serve, alive
from tests.test_imports import ENGINE_SIDE as ENGINE_MODULES

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")


def test_a_port_in_use_is_one_line_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = Serve(port=taken.getsockname()[1])
        try:
            assert server.finish() == 1
        finally:
            server.kill()
    out = server.output
    assert out.splitlines()[-1] == (
        f"m3lm: error: cannot listen on 127.0.0.1:{server.port}: Address already in use: "
        "another server is running there; stop it or choose another --port"
    ), out
    assert "serving story on" not in out and "engine" not in out and "Traceback" not in out, out


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_start_up_stops_both_processes_with_one_line(sig, code):
    server = Serve()
    try:
        server.wait_for(server.engine_pids, "the engine process")  # it is loading now
        engines = server.engine_pids()
        server.proc.send_signal(sig)
        assert server.finish() == code
        server.wait_for(lambda: not any(alive(p) for p in engines), "the engine process to go")
    finally:
        server.kill()
    out = server.output
    assert out.splitlines()[-1] == f"m3lm: stopped by {signal.Signals(sig).name} while starting", out
    assert "engine ready" not in out and "Traceback" not in out, out  # stopped while it loaded
    assert sum("WARNING" in line or "ERROR" in line for line in out.splitlines()) == 0, out


def open_stream(server: Serve, events: list, first: threading.Event) -> threading.Thread:
    """A completion streamed on a thread, its SSE data lines collected in `events`."""

    def run():
        body = {"model": "story", "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=PATIENCE_S) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()
        except httpx.HTTPError as e:
            events.append(f"transport error: {e!r}")
        first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_ctrl_c_while_serving_drains_and_open_streams_end_with_an_error_and_done():
    server = Serve("--drain-timeout", "0")  # the drain ends at its first check: the stream is cut there
    try:
        server.wait_healthy()
        events, first = [], threading.Event()
        reader = open_stream(server, events, first)
        assert first.wait(PATIENCE_S) and not events[0].startswith("transport")
        server.proc.send_signal(signal.SIGINT)
        reader.join(PATIENCE_S)
        assert server.finish() == 0
    finally:
        server.kill()
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])
    assert "error" in error and "shutting down" in error["error"]["message"], events[-3:]
    tokens = sum(1 for e in events[:-2] if json.loads(e)["choices"])
    assert tokens < 2000
    out = server.output
    assert "SIGINT: draining 1 open request(s)" in out and "Traceback" not in out, out


def test_a_second_ctrl_c_stops_at_once():
    server = Serve("--drain-timeout", str(PATIENCE_S))  # the first Ctrl-C alone would wait for the stream
    try:
        server.wait_healthy()
        events, first = [], threading.Event()
        reader = open_stream(server, events, first)
        assert first.wait(PATIENCE_S)
        server.proc.send_signal(signal.SIGINT)
        server.wait_for(lambda: "SIGINT: draining 1 open request(s)" in server.output, "the drain")
        server.proc.send_signal(signal.SIGINT)
        assert server.finish() == 0
        reader.join(PATIENCE_S)
    finally:
        server.kill()
    tokens = sum(1 for e in events if e.startswith("{") and json.loads(e).get("choices"))
    assert tokens < 2000  # stopped, not drained to the end
    out = server.output
    assert "Traceback" not in out and "ERROR" not in out, out


@pytest.mark.parametrize(
    ("device", "says"),
    [
        ("cuda", "sees no CUDA GPU; use --device cpu"),
        ("mps", "m3lm runs on NVIDIA GPUs (cuda) and the CPU; use --device cpu"),
        ("gpu", "is not a device; use cuda, cuda:N (an NVIDIA GPU) or cpu"),
    ],
)
def test_a_device_this_machine_lacks_is_one_line_before_the_engine_starts(device, says):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    server = Serve("--device", device)
    try:
        assert server.finish() == 1
    finally:
        server.kill()
    lines = server.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"m3lm: error: device {device!r}"), lines
    assert lines[0].endswith(says), lines


# What runs the model: the server process imports none of it (the engine process does).
ENGINE_SIDE = tuple(f"m3lm.{m}" for m in ENGINE_MODULES)


def test_the_http_process_holds_no_model_cache_or_engine_step_module(tmp_path):
    """Every API served, streamed and not, a structured output and a tool call: then the server
    process's own modules hold the text layer and the engine's client, and nothing that runs
    the model."""
    import anthropic
    import openai

    modules = tmp_path / "modules.json"
    server = Serve(modules_to=modules)
    try:
        server.wait_healthy()
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        chat = [{"role": "user", "content": "Tell me a story."}]
        assert oa.chat.completions.create(model="story", messages=chat, max_tokens=8).choices[0].message
        assert list(oa.chat.completions.create(model="story", messages=chat, max_tokens=8, stream=True))
        assert oa.completions.create(model="story", prompt="Once", max_tokens=8, logprobs=2).choices[0].text
        assert oa.completions.create(model="story", prompt="Once", max_tokens=0, echo=True, logprobs=1)
        json_reply = oa.chat.completions.create(
            model="story", messages=chat, max_tokens=64, response_format={"type": "json_object"}
        )
        assert json_reply.choices[0].finish_reason in ("stop", "length")
        assert oa.responses.create(model="story", input="Tell me a story.", max_output_tokens=8).output
        ant = anthropic.Anthropic(base_url=server.url, api_key="none")
        assert ant.messages.create(model="story", max_tokens=8, messages=chat).content is not None
        server.proc.send_signal(signal.SIGTERM)
        assert server.finish() in (0, 143), server.output[-3000:]  # drained and stopped
    finally:
        server.kill()
    loaded = json.loads(modules.read_text())
    assert {"m3lm.server.engine_client", "m3lm.text.detokenize", "m3lm.server.app"} <= set(loaded)
    held = [m for m in loaded if m.startswith(ENGINE_SIDE)]
    assert held == [], held
