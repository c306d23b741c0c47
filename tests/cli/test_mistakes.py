"""A user's first mistakes each get one line that says what to do instead."""

import json
import subprocess
import sys

import httpx
import pytest

from m3lm.assets import DEFAULT_MODEL
from m3lm.config import EngineConfig
from m3lm.engine.engine import LLMEngine
from m3lm.loader import load
from m3lm.tokenizer import load_tokenizer
from tests.support.checkpoints import write_m3_tokenizer
from tests.support.cli import one_line_error, tiny_checkpoint
from tests.support.paths import PATIENCE_S


def test_a_hub_name_says_that_m3lm_reads_a_local_directory_and_never_downloads(capsys):
    err = one_line_error(capsys, ["generate", "--model", "MiniMaxAI/MiniMax-M3", "--prompt", "hi"])
    assert "m3lm reads a local checkpoint directory" in err and "never downloads" in err
    assert "download it first and pass its directory" in err


def test_a_gguf_file_says_what_m3lm_reads(tmp_path, capsys):
    gguf = tmp_path / "minimax-m3-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    err = one_line_error(capsys, ["chat", "--model", str(gguf)])
    assert f"model path {gguf} is a GGUF file: m3lm reads a local checkpoint directory" in err


def serve_output(*args: str) -> subprocess.CompletedProcess:
    """`m3lm serve` stopped before it loads anything (--device mps is refused), so that only what it
    says about its settings is seen."""
    argv = [sys.executable, "-m", "m3lm", "serve", "--device", "mps", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=PATIENCE_S)


def test_serving_beyond_this_machine_without_a_key_warns():
    warned = serve_output("--host", "0.0.0.0")
    assert "--host 0.0.0.0 without --api-key: anyone who can reach this machine" in warned.stderr
    for quiet in (serve_output("--host", "0.0.0.0", "--api-key", "k"), serve_output("--host", "127.0.0.1")):
        assert "without --api-key" not in quiet.stderr, quiet.stderr


def test_a_max_model_len_above_the_models_is_logged_with_its_reason(caplog):
    model, tok = load(DEFAULT_MODEL, device="cpu")
    most = model.args.max_position_embeddings
    with caplog.at_level("WARNING", logger="m3lm"):
        engine = LLMEngine(model, tok, EngineConfig(max_model_len=most * 4, kv_cache_tokens=most))
    assert engine.max_model_len == most
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"max_model_len = {most * 4} is above the model's {most} positions" in " ".join(said), said


def test_a_long_prompt_gets_no_transformers_warning_before_our_error(tmp_path, capfd):
    """A tokenizer whose config declares a short model_max_length: transformers would warn that
    the sequence "will result in indexing errors" before the engine's own clear error."""
    write_m3_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 8}))
    tok = load_tokenizer(tmp_path)
    assert len(tok.encode("once upon a time " * 20)) > 8
    assert "indexing errors" not in capfd.readouterr().err


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from tests.support.live_server import start

    server = start(
        tiny_checkpoint(tmp_path_factory.mktemp("m"), tokenizer_template="{{ 'x' }}"), api_key=None
    )
    yield server
    server.stop()


def test_invalid_json_gets_our_own_words(live):
    json_type = {"Content-Type": "application/json"}
    r = httpx.post(live.url + "/v1/completions", content=b'{"prompt": "hi",,}', headers=json_type)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "the request body is not valid JSON (Expecting property name enclosed in double quotes at character 16)"
    )
    for body, headers in ((b"[1, 2]", json_type), (b'{"prompt": "hi"}', {}), (b"", json_type)):
        r = httpx.post(live.url + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "the request body must be a JSON object (sent with Content-Type: application/json)"
        ), body
