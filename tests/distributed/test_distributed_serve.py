"""`m3lm serve --tensor-parallel-size 2` end to end: rank 0 serves HTTP, rank 1 follows its steps.

The served greedy completions must equal a single-process engine's on the same checkpoint, over
real HTTP with the official client, and SIGTERM must stop both ranks.
"""

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

import m3lm
from m3lm.engine.launch import free_port
from tests.support.checkpoints import (
    Spec,
    hf_model,
    release_config,
    to_release,
    write_checkpoint,
    write_m3_tokenizer,
)
from tests.support.paths import PATIENCE_S, REPO

PROMPTS = ["once upon a time", "the little fox"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-serve")
    assert write_m3_tokenizer(path) <= 384
    spec = Spec(vocab=384, heads=8, kv_heads=2, experts=8)  # model rows divisible by the group size
    write_checkpoint(path, to_release(hf_model(spec, seed=7).state_dict(), spec), release_config(spec))
    return path


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = PATIENCE_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("the server did not become healthy")


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_server_matches_one_process(checkpoint, expert_parallel):
    model, tok = m3lm.load(checkpoint, device="cpu")
    want = [m3lm.generate(model, tok, p, max_tokens=8, temperature=0.0).text for p in PROMPTS]
    port = free_port()
    cmd = [sys.executable, "-m", "m3lm", "serve", "--model", str(checkpoint), "--port", str(port)]
    cmd += ["--tensor-parallel-size", "2", "--max-model-len", "128"] + (
        ["--expert-parallel"] if expert_parallel else []
    )
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        for prompt, text in zip(PROMPTS, want, strict=True):
            out = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0.0)
            assert out.choices[0].text == text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=PATIENCE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, proc.stderr.read()
