"""Speculative decoding through the interfaces: `--speculative-config` on the command line,
`LLM(speculative_config=...)`, and the server's /metrics counters under vLLM's names."""

import httpx
import openai
import pytest
import torch

import m3lm
from m3lm.cli import main
from m3lm.config import EngineConfig
from m3lm.engine.engine import LLMEngine
from m3lm.llm import LLM
from m3lm.server.app import create_server_app
from m3lm.server.engine_client import AsyncEngine
from m3lm.server.protocol import Limits
from m3lm.speculative.config import SpeculativeConfig
from tests.support.cli import cli
from tests.support.live_server import API_KEY, LiveServer

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
PROMPT = "Tom had a red ball. Tom had a red ball. Tom had a"


def test_generate_prints_the_mean_acceptance_length_and_the_same_story():
    args = ["generate", "--prompt", PROMPT, "--max-tokens", "40", "--temperature", "0"]
    plain = cli(*args)
    spec = cli(*args, "--speculative-config", NGRAM)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "mean acceptance length" not in plain.stderr
    stats = spec.stderr.strip().splitlines()[-1]
    value = float(stats.split("mean acceptance length: ")[1].split()[0])
    assert 1.0 <= value <= 4.0


def test_a_bad_speculative_config_is_one_line():
    r = cli("generate", "--prompt", "hi", "--speculative-config", '{"method": "medusa"}')
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "speculative_config: method = 'medusa' is not supported" in r.stderr


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_serve_and_chat_take_the_speculative_config(monkeypatch, command):
    import m3lm.chat_repl as chat_repl
    import m3lm.server.app as app

    seen = {}
    monkeypatch.setattr(app, "serve", lambda *a, **k: seen.update(k))
    monkeypatch.setattr(chat_repl, "run_chat", lambda model, tok, args, *rest: seen.update(vars(args)) or 0)
    assert main([command, "--speculative-config", NGRAM]) == 0
    assert seen["speculative_config"] == SpeculativeConfig("ngram", 3, 2, 4)


def test_offline_llm_takes_the_speculative_config():
    params = m3lm.SamplingParams(max_tokens=30, temperature=0.0)
    plain = LLM(m3lm.DEFAULT_MODEL, device="cpu", dtype="float32").generate([PROMPT], params)
    llm = LLM(m3lm.DEFAULT_MODEL, device="cpu", dtype="float32", speculative_config=NGRAM)
    spec = llm.generate([PROMPT], params)
    assert spec[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.engine.speculator.stats.num_drafts > 0


def metrics(url: str) -> dict[str, float]:
    """The speculation counters of /metrics, by name (and `@position` for the per-position one)."""
    import re

    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(m3lm:spec_decode\w+)\{([^}]*)\} (\S+)$", text, re.M):
        position = re.search(r'position="(\d+)"', labels)
        key = name + (f"@{position.group(1)}" if position else "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def test_the_server_counts_drafted_and_accepted_tokens():
    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    config = EngineConfig(max_model_len=256, max_num_seqs=8, speculative_config=NGRAM)
    engine = AsyncEngine(LLMEngine(model, tok, config)).start()
    server = LiveServer(create_server_app(engine, tok, "story", API_KEY, Limits()))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        r = client.completions.create(model="story", prompt=PROMPT, max_tokens=40, temperature=0)
        want = m3lm.generate(model, tok, PROMPT, max_tokens=40, temperature=0.0).text
        assert r.choices[0].text == want
        st = engine.engine.speculator.stats
        m = metrics(server.url)
        assert st.num_drafts > 0 and st.num_accepted_tokens > 0
        assert m["m3lm:spec_decode_num_drafts_total"] == st.num_drafts
        assert m["m3lm:spec_decode_num_draft_tokens_total"] == st.num_draft_tokens
        assert m["m3lm:spec_decode_num_accepted_tokens_total"] == st.num_accepted_tokens
        per_pos = [m.get(f"m3lm:spec_decode_num_accepted_tokens_per_pos_total@{i}", 0) for i in range(3)]
        assert per_pos == st.accepted_per_pos and sum(per_pos) == st.num_accepted_tokens
    finally:
        server.stop()
