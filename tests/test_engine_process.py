"""`m3lm serve` as users start it: the API process and the engine process it spawns.

Over real HTTP with the official client: a request, the engine process failing to start, the
engine process dying while a stream is open, and the server dying under the engine.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from checkpoints import Spec, hf_model, release_config, to_release, write_checkpoint, write_m3_tokenizer

from m3lm.core import SamplingParams, StructuredOutput, ThinkingControl
from m3lm.engine import messages as m


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("proc")
    s = Spec(vocab=write_m3_tokenizer(path))
    write_checkpoint(path, to_release(hf_model(s, seed=5).state_dict(), s), release_config(s))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(checkpoint: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "m3lm", "serve", "--model", str(checkpoint), "--port", str(port), *extra]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, limit: float = 120) -> None:
    deadline = time.time() + limit
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "the server did not start"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out


def test_messages_round_trip():
    params = SamplingParams(max_tokens=5, stop=("x",), logit_bias=((3, 1.5),), seed=2**63 - 1, cache_salt="t")
    add = m.decode_to_engine(m.encode(m.Add("r1", [1, 2, 3], params)))
    assert add == m.Add("r1", [1, 2, 3], params) and add.params == params
    rules = SamplingParams(
        structured=StructuredOutput("structural_tag", '{"a": 1}', (("]<]x[>[", 7),)),
        thinking=ThinkingControl("adaptive", 5, 6, budget=3),
    )
    assert m.decode_to_engine(m.encode(m.Add("r2", [1], rules))).params == rules
    outs = m.Outputs(
        [m.Output("r1", [7], [(7, -0.5, [(7, -0.5), (9, -1.0)])], "length")], m.Stats(1, 0, 3, 10)
    )
    assert m.decode_from_engine(m.encode(outs)) == outs


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_engine_process_serves_and_its_crash_ends_the_server(checkpoint):
    proc, url = start(checkpoint, "--max-model-len", "256", "--served-model-name", "m")
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
        assert proc.wait(timeout=30) == 1
        out = stop(proc)
        assert "m3lm: error: the engine stopped: the engine process exited with code -9" in out
    finally:
        stop(proc)


def test_engine_that_cannot_start_is_a_one_line_error(checkpoint):
    proc, _ = start(checkpoint, "--max-model-len", "256", "--kv-cache-tokens", "64")
    code = proc.wait(timeout=120)
    out = stop(proc)
    assert code == 1
    last = out.strip().splitlines()[-1]
    assert last.startswith("m3lm: error:") and "max_model_len" in last, out[-2000:]
    assert "Traceback" not in out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_engine_process_leaves_when_the_server_dies(checkpoint):
    proc, url = start(checkpoint, "--max-model-len", "256", "--served-model-name", "m")
    try:
        wait_healthy(proc, url)
        engines = children(proc.pid)
        proc.kill()  # no cleanup runs in the server
        proc.wait(timeout=10)
        deadline = time.time() + 15
        while any(alive(p) for p in engines) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in engines)
    finally:
        stop(proc)
