"""`m3lm serve` as users start it: the API process and the engine process it spawns.

Over real HTTP with the official client: a request, the engine process failing to start, the
engine process dying while a stream is open, and the server dying under the engine.
"""

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from m3lm import wire as m
from m3lm.core import SamplingParams, StepOutput, StructuredOutput, ThinkingControl, TokenLogprob
from tests.support.checkpoints import write_chat_checkpoint
from tests.support.paths import PATIENCE_S
from tests.support.processes import alive, children, start_serve, stop, wait_healthy


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("proc"), seed=5)


def test_messages_round_trip():
    params = SamplingParams(max_tokens=5, stop=("x",), logit_bias=((3, 1.5),), seed=2**63 - 1, cache_salt="t")
    add = m.decode_to_engine(m.encode(m.Add("r1", [1, 2, 3], params)))
    assert add == m.Add("r1", [1, 2, 3], params) and add.params == params
    rules = SamplingParams(
        structured=StructuredOutput("structural_tag", '{"a": 1}', (("]<]x[>[", 7),)),
        thinking=ThinkingControl("adaptive", 5, 6, budget=3),
    )
    assert m.decode_to_engine(m.encode(m.Add("r2", [1], rules))).params == rules
    lps = [TokenLogprob(7, -0.5, [(7, -0.5), (9, -1.0)])]
    first = StepOutput("r1", [7], new_logprobs=lps, finished=True, finish_reason="length", queued_s=0.25)
    plps = StepOutput(
        "r2", [], prompt_logprobs=[TokenLogprob(3, -1.5, [(4, -0.5)], 2)], num_prefix_cached=128
    )
    outs = m.Outputs([first, plps], m.Stats(1, 0, 3, 10))
    back = m.decode_from_engine(m.encode(outs))
    assert back == outs and back.outputs[0].new_logprobs[0].top == [(7, -0.5), (9, -1.0)]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_engine_process_serves_and_its_crash_ends_the_server(checkpoint):
    proc, url = start_serve(checkpoint, "--max-model-len", "256", "--served-model-name", "m")
    try:
        wait_healthy(proc, url)
        engines = children(proc.pid)
        assert len(engines) >= 1  # the engine process (and possibly multiprocessing's tracker)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        reply = client.completions.create(
            model="m", prompt=[5, 6, 7], max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert reply.usage.completion_tokens == 4 and reply.choices[0].finish_reason == "length"
        stream = client.completions.create(
            model="m", prompt=[5, 6, 7], max_tokens=200, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        for pid in engines:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine"):
            for _ in stream:
                pass
        assert proc.wait(timeout=PATIENCE_S) == 1
        out = stop(proc)
        assert "m3lm: error: the engine stopped: the engine process exited with code -9" in out
    finally:
        stop(proc)


def test_engine_that_cannot_start_is_a_one_line_error(checkpoint):
    proc, _ = start_serve(checkpoint, "--max-model-len", "256", "--kv-cache-tokens", "64")
    code = proc.wait(timeout=PATIENCE_S)
    out = stop(proc)
    assert code == 1
    last = out.strip().splitlines()[-1]
    assert last.startswith("m3lm: error:") and "max_model_len" in last, out[-2000:]
    assert "Traceback" not in out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_engine_process_leaves_when_the_server_dies(checkpoint):
    proc, url = start_serve(checkpoint, "--max-model-len", "256", "--served-model-name", "m")
    try:
        wait_healthy(proc, url)
        engines = children(proc.pid)
        proc.kill()  # no cleanup runs in the server
        proc.wait(timeout=PATIENCE_S)
        deadline = time.time() + PATIENCE_S
        while any(alive(p) for p in engines) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in engines)
    finally:
        stop(proc)


def test_an_engine_inside_a_long_step_leaves_soon_after_its_server(tmp_path, monkeypatch):
    """The loop looks for its parent between steps; a step that outlasts the parent by more than
    `ORPHAN_GRACE_S` is cut short by the watch thread (`leave`), which removes the socket folder."""
    import threading

    import zmq

    from m3lm.engine import engine_loop

    left, release = threading.Event(), threading.Event()
    monkeypatch.setattr(engine_loop, "leave", lambda addr: left.set())
    folder = tmp_path / "ipc"
    folder.mkdir()

    class Engine:  # one step under way when the parent goes, lasting until it is released
        kv_events = None

        def has_unfinished(self):
            return True

        def step(self):
            loop.parent_pid = -1  # the parent has gone
            assert release.wait(60)
            return []

    ctx = zmq.Context()
    loop = engine_loop.EngineLoop(
        Engine(), ctx, f"ipc://{folder}/in", f"ipc://{folder}/out", parent_pid=os.getppid()
    )
    monkeypatch.setattr(engine_loop, "engine_stats", lambda engine: None)
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    try:
        assert left.wait(PATIENCE_S)
    finally:
        release.set()
        runner.join(PATIENCE_S)
        loop.close()
        ctx.destroy(linger=0)
    assert not runner.is_alive()  # and between steps the loop ends by itself


def test_a_thread_hosted_engine_reports_its_warm_up_failure(checkpoint, monkeypatch):
    """Under torchrun the engine's loop runs on a thread of the server process: a warm-up that
    fails is a start failure with its message, as the engine process reports it."""
    import m3lm.engine.engine_loop as loop
    import m3lm.server.engine_client as ae
    from m3lm.config import EngineConfig
    from m3lm.engine.engine import LLMEngine
    from m3lm.loader import load

    def broken(engine):
        raise RuntimeError("no room for the decode graphs")

    monkeypatch.setattr(loop, "warm_up_if_on", broken)
    model, tok = load(checkpoint, device="cpu")
    engine = ae.AsyncEngine(LLMEngine(model, tok, EngineConfig(max_model_len=256)))
    with pytest.raises(ae.EngineStartError, match="^no room for the decode graphs$"):
        engine.start()


def engine_pid(server_pid: int) -> int:
    """The engine process among the server's children (not multiprocessing's resource tracker)."""
    for pid in children(server_pid):
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError("no engine process")


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_stopped_engine_is_noticed_and_its_recovery_restores_service(checkpoint):
    """SIGSTOP on the engine: /health says so, waiting requests end with a clear error, new ones
    get 503; after SIGCONT the server serves again. (A 1 s engine timeout keeps this short.)"""
    proc, url = start_serve(
        checkpoint, "--max-model-len", "256", "--served-model-name", "m", "--engine-timeout", "1"
    )
    long = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}
    try:
        wait_healthy(proc, url)
        engine = engine_pid(proc.pid)
        with (
            httpx.Client(base_url=url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json={**long, "stream": True}) as stream,
        ):
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(engine, signal.SIGSTOP)
            try:
                whole = c.post("/v1/completions", json=long)  # waits on the stopped engine
                assert whole.status_code == 503, whole.text
                assert "has not answered" in whole.json()["error"]["message"]
                events = [line for line in lines if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]"
                assert "has not answered" in events[-2] and '"code":"service_unavailable"' in events[-2], (
                    events[-2:]
                )
                health = c.get("/health")
                assert health.status_code == 503 and "has not answered" in health.json()["error"]
                late = c.post("/v1/completions", json=long)
                assert late.status_code == 503 and late.headers["retry-after"] == "5"
            finally:
                os.kill(engine, signal.SIGCONT)
        deadline = time.time() + 30
        while httpx.get(url + "/health").status_code != 200:
            assert time.time() < deadline, "the server did not recover"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = client.completions.create(
            model="m", prompt=[5, 6, 7], max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert reply.usage.completion_tokens == 4
        while metric(url, "m3lm:num_requests_running") or metric(url, "m3lm:kv_cache_usage_perc"):
            assert time.time() < deadline, "the ended requests still hold the engine"
            time.sleep(0.1)
        assert metric(url, "m3lm:num_requests_waiting") == 0
    finally:
        stop(proc)


def test_a_cpu_pool_past_the_memory_available_is_refused_before_it_is_allocated(checkpoint):
    from m3lm.engine.engine import available_ram

    free = available_ram()
    if free is None:
        pytest.skip("the available memory is not known here")
    too_much = f"{2 * free // (1 << 30) + 1}GiB"
    proc, _ = start_serve(checkpoint, "--device", "cpu", "--kv-cache-memory", too_much)
    code = proc.wait(timeout=120)
    out = stop(proc)
    last = out.strip().splitlines()[-1]
    assert code == 1 and last.startswith("m3lm: error: the KV cache needs"), out[-2000:]
    assert "of memory available" in last and "Traceback" not in out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_the_socket_folder_goes_when_the_server_does(checkpoint, tmp_path, how):
    proc, url = start_serve(checkpoint, "--max-model-len", "256", env={"TMPDIR": str(tmp_path)})
    try:
        wait_healthy(proc, url)
        assert len(list(tmp_path.glob("m3lm-*"))) == 1
        engine = engine_pid(proc.pid)
        proc.send_signal(how)  # SIGKILL: the server cleans nothing up; its engine does
        proc.wait(timeout=60)
        deadline = time.time() + 30
        while alive(engine) or list(tmp_path.glob("m3lm-*")):
            assert time.time() < deadline, list(tmp_path.iterdir())
            time.sleep(0.1)
    finally:
        stop(proc)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_second_sigterm_ends_open_requests_with_their_errors(checkpoint):
    proc, url = start_serve(checkpoint, "--max-model-len", "1024", "--served-model-name", "m")
    long = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}
    try:
        wait_healthy(proc, url)

        async def requests():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                whole = asyncio.create_task(c.post("/v1/completions", json=long))
                async with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                    lines = r.aiter_lines()
                    async for line in lines:
                        if line.startswith("data: "):
                            break
                    proc.send_signal(signal.SIGTERM)  # a drain: requests go on
                    while (await c.get("/health")).status_code != 503:
                        await asyncio.sleep(0.05)
                    proc.send_signal(signal.SIGTERM)  # now: they end, each with its error
                    events = [line async for line in lines if line.startswith("data: ")]
                return events, await whole

        events, whole = asyncio.run(requests())
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
        assert whole.status_code == 503 and "shutting down" in whole.json()["error"]["message"]
        assert proc.wait(timeout=30) == 0
        out = stop(proc)
        assert "Traceback" not in out, out[-3000:]
    finally:
        stop(proc)


def test_a_weight_file_leading_outside_the_model_folder_is_refused(checkpoint, tmp_path):
    import shutil

    model, outside = tmp_path / "model", tmp_path / "elsewhere"
    model.mkdir()
    outside.mkdir()
    for f in checkpoint.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, model / f.name)
    shutil.copy(checkpoint / "model.safetensors", outside / "weights.safetensors")
    (model / "model.safetensors").symlink_to(outside / "weights.safetensors")
    proc, _ = start_serve(model, "--max-model-len", "256")
    code = proc.wait(timeout=120)
    out = stop(proc)
    last = out.strip().splitlines()[-1]
    assert code == 1 and "leads outside the model folder" in last, out[-2000:]
