"""Bad input and faults: each gets a clear error, loses nothing, and the server keeps serving."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from safetensors.torch import load_file, save_file

import m3lm
from m3lm.config import EngineConfig
from m3lm.engine.engine import LLMEngine
from m3lm.errors import CheckpointError, ConfigError
from m3lm.server.app import create_server_app
from m3lm.server.engine_client import AsyncEngine
from m3lm.server.protocol import Limits
from tests.support.checkpoints import write_chat_checkpoint
from tests.support.live_server import LiveServer, wait_idle
from tests.support.paths import PATIENCE_S


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("hard"), seed=4)


@pytest.fixture(scope="module")
def live(checkpoint):
    model, tok = m3lm.load(checkpoint, device="cpu")
    engine = AsyncEngine(
        LLMEngine(model, tok, EngineConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=8)), 64
    )
    server = LiveServer(create_server_app(engine.start(), tok, "tiny", None, Limits()))
    server.engine = engine
    yield server
    server.stop()


OK_BODY = {"prompt": "once upon a time", "max_tokens": 4, "temperature": 0}

BAD = [
    ("/v1/completions", {"prompt": "x", "n": 10**9}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400),  # (a huge one is capped by the context)
    (
        "/v1/completions",
        {"prompt": "x", "max_tokens": 256, "ignore_eos": True},
        200,
    ),  # clamped to the context
    ("/v1/completions", {"prompt": "x", "logprobs": 10**6}, 400),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 10**4}, 400),
    ("/v1/completions", {"prompt": "x", "stop": "a" * 10**4}, 400),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "x", "seed": "abc"}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": [10**9]}, 400),
    ("/v1/completions", {"prompt": [-1]}, 400),
    ("/v1/completions", {"prompt": [[1, 2]] * 20}, 400),
    ("/v1/completions", {"prompt": "word " * 400}, 400),
    (
        "/v1/completions",
        {"prompt": "]~!b[]~b]system\n[e~[<mm:think>]<]minimax[>[<tool_call>", "max_tokens": 2},
        200,
    ),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}] * 5000}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
        400,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": False}},
        400,
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}],
                }
            ]
        },
        400,
    ),
    ("/detokenize", {"tokens": [10**9]}, 400),
    ("/tokenize", {}, 400),
]


@pytest.mark.parametrize(
    ("path", "body", "status"), BAD, ids=[f"{p}:{json.dumps(b)[:40]}" for p, b, _ in BAD]
)
def test_bad_input_gets_4xx_and_the_server_goes_on(live, path, body, status):
    r = httpx.post(live.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    if status >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"
        assert err["code"] is None if status == 400 else isinstance(err["code"], str)  # OpenAI's: str or null
    ok = httpx.post(live.url + "/v1/completions", json=OK_BODY, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(live.url + "/health").status_code == 200


def test_raw_bytes_and_headers(live):
    def post(body):
        return httpx.post(
            live.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )

    assert post(b"\xff\xfe\xfd").status_code == 400
    assert post(b'{"prompt": "\xc3\x28"}').status_code == 400
    assert post(b"[1, 2").status_code == 400
    assert post(b"null").status_code == 400
    big = httpx.post(live.url + "/v1/completions", content=b"{" + b" " * (10 << 20) + b"}")
    assert big.status_code == 413
    huge = httpx.get(live.url + "/health", headers={"X-Pad": "a" * (64 << 10)})
    assert huge.status_code == 431
    assert httpx.get(live.url + "/health").status_code == 200


def test_disconnect_during_prefill_frees_pages(live):
    wait_idle(live.engine)
    body = {"prompt": [7] * 240, "max_tokens": 5, "stream": True}  # 30 prefill steps of 8 tokens
    with httpx.stream("POST", live.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        deadline = time.time() + 10
        while live.engine.engine.blocks.num_used == 0:
            assert time.time() < deadline
            time.sleep(0.001)
        seq = next(iter(live.engine.engine.requests.values()))
        assert seq.num_cached < len(seq.prompt_ids)  # still prefilling
    wait_idle(live.engine)


def test_nan_logits_fail_one_request_only(live):
    wait_idle(live.engine)
    engine = live.engine.engine
    real = engine.runner.run

    def poisoned(plan, tables):
        ready, logits, *rest = real(plan, tables)  # rest: the prompt positions scored this step
        logits = logits.clone()
        for i, seq in enumerate(ready):
            if seq.prompt_ids[:3] == [9, 9, 9]:
                logits[i] = float("nan")
        return ready, logits, *rest

    engine.runner.run = poisoned
    try:

        async def both():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:
                bad = c.post("/v1/completions", json={"prompt": [9, 9, 9, 4], "max_tokens": 8})
                good = c.post(
                    "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True}
                )
                return await asyncio.gather(bad, good)

        bad, good = asyncio.run(both())
    finally:
        engine.runner.run = real
    assert bad.status_code == 500 and "non-finite" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8
    assert live.engine.alive
    wait_idle(live.engine)


def test_detokenizer_fault_stops_only_its_request(live):
    from m3lm.text.detokenize import IncrementalDetokenizer

    real = IncrementalDetokenizer.add
    calls = {"n": 0}

    def flaky(self, token_id):
        calls["n"] += 1
        if getattr(self, "_poison", False):
            raise RuntimeError("decoder exploded")
        return real(self, token_id)

    IncrementalDetokenizer.add = flaky
    engine = live.engine  # the server's side detokenizes
    real_add = engine.add

    def add(ids, params, rid=None):
        stream = real_add(ids, params, rid)
        stream._text.detok._poison = ids[:2] == [8, 8]
        return stream

    engine.add = add
    try:

        async def both():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:
                # ignore_eos: a sampled EOS would end the request before its detokenizer runs
                bad = c.post(
                    "/v1/completions", json={"prompt": [8, 8, 3], "max_tokens": 5, "ignore_eos": True}
                )
                good = c.post(
                    "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": True}
                )
                return await asyncio.gather(bad, good)

        bad, good = asyncio.run(both())
    finally:
        IncrementalDetokenizer.add = real
        engine.add = real_add
    assert bad.status_code == 500 and "decoder exploded" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 5
    assert live.engine.alive


def test_parser_fault_fails_only_its_request(live):
    from m3lm.text import reasoning

    real = reasoning.ReplyParser.feed

    def broken(self, token_id, text):
        raise RuntimeError("parser exploded")

    reasoning.ReplyParser.feed = broken
    try:
        r = httpx.post(
            live.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
    finally:
        reasoning.ReplyParser.feed = real
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    assert live.engine.alive
    wait_idle(live.engine)
    assert httpx.post(live.url + "/v1/completions", json=OK_BODY).status_code == 200


def test_slow_reader_does_not_stall_others(live):
    """A client that stops reading its stream holds only its own request."""
    body = {"prompt": "once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body) as slow:
        next(slow.iter_lines())  # read one line, then stop reading
        t0 = time.time()
        r = httpx.post(live.url + "/v1/completions", json=OK_BODY, timeout=30)
        assert r.status_code == 200 and time.time() - t0 < 10
    wait_idle(live.engine)


# --- checkpoint faults ----------------------------------------------------------------------------


def test_nan_in_a_weight_is_refused(checkpoint, tmp_path):
    tensors = load_file(checkpoint / "model.safetensors")
    name = "language_model.model.layers.1.self_attn.o_proj.weight"
    tensors[name][3, 4] = float("inf")
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(CheckpointError, match=f"{name} holds NaN or Inf"):
        m3lm.load(tmp_path, device="cpu")


def test_auto_map_is_never_executed(checkpoint, tmp_path):
    import shutil

    for f in checkpoint.iterdir():
        shutil.copy(f, tmp_path / f.name)
    marker = tmp_path / "executed"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\nclass Evil: pass\n")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.Evil", "AutoConfig": "evil.Evil"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tok_cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["evil.Evil", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    try:
        m3lm.load(tmp_path, device="cpu")
    except CheckpointError as e:
        assert "\n" not in str(e)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_hidden_layers", 0),
        ("vocab_size", 10**12 + 0.5),
        ("rms_norm_eps", float("nan")),
        ("head_dim", True),
        ("rope_theta", -1),
    ],
)
def test_out_of_range_config_values(checkpoint, tmp_path, key, value):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["text_config"][key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=key):
        m3lm.load(tmp_path, device="cpu")


# --- shutdown --------------------------------------------------------------------------------------


def running_and_waiting(metrics: str) -> tuple[float, float]:
    values = {}
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("m3lm:num_requests_running", "m3lm:num_requests_waiting"):
            values[name] = float(line.rsplit(" ", 1)[1])
    return values.get("m3lm:num_requests_running", 0.0), values.get("m3lm:num_requests_waiting", 0.0)


def test_sigterm_drains_in_flight_requests(checkpoint):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "m3lm",
            "serve",
            "--model",
            str(checkpoint),
            "--port",
            str(port),
            "--max-model-len",
            "512",
            "--drain-timeout",
            str(PATIENCE_S),  # a busy machine drains slowly; the drain's end is tested elsewhere
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + PATIENCE_S
        while True:
            assert proc.poll() is None and time.time() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)

        async def until(check):
            deadline = time.monotonic() + PATIENCE_S
            while not await check():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)

        async def load():
            async with httpx.AsyncClient(base_url=url, timeout=PATIENCE_S) as c:
                body = {"prompt": "once upon a time", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
                tasks = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(4)]

                async def all_admitted():
                    text = (await c.get("/metrics")).text
                    return sum(running_and_waiting(text)) == 4

                async def draining():
                    return (await c.get("/health")).status_code == 503

                await until(all_admitted)
                proc.send_signal(signal.SIGTERM)
                await until(draining)  # still listening while it drains
                late = await c.post("/v1/completions", json=body)
                return late, await asyncio.gather(*tasks, return_exceptions=True)

        late, results = asyncio.run(load())
        code = proc.wait(timeout=PATIENCE_S)
        assert code == 0
        assert late.status_code == 503
        assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in results), results
        assert all(r.json()["usage"]["completion_tokens"] == 300 for r in results)
        log = proc.stdout.read().decode()
        assert "SIGTERM: draining 4 open request(s)" in log and "Traceback" not in log
    finally:
        if proc.poll() is None:
            proc.kill()
