"""Codex and Claude Code, as their users install and run them, against the server: a plain turn
and a tool turn each, on a copy of the embedded model configured for a 32k context (their
prompts are long). The story model never calls a tool by itself, so the tool turn scripts the
sampler (a call of the agent's shell tool, then an answer once its output is in the prompt); the
agents' own loops, tool runs and protocol stay real. They are installed with npm into a cache
folder; without npm or the registry the tests skip with the reason. Installing them takes
minutes, so they run when M3LM_AGENT_TESTS=1 (CI sets it).

Claude Code's tool turn offers the model only its shell (`--tools Bash`, the agent's own flag):
with every tool's definition and the call's output its request passes a 32k context in the
story tokenizer's 4,096 ids (M3's vocabulary writes the same text in about half the tokens)."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import m3lm
from tests.support.live_server import API_KEY
from tests.support.story_server import NAME, scripted, story_server, tool_call_ids

AGENTS = {"codex": "@openai/codex@0.171.0", "claude": "@anthropic-ai/claude-code@2.1.332"}
CONTEXT = 32768
MARK = "m3lm-tool-ok"


@pytest.fixture(scope="module")
def agents() -> dict[str, Path]:
    """The agents' executables, installed once into a cache folder."""
    if os.environ.get("M3LM_AGENT_TESTS") != "1":
        pytest.skip("the coding agents' tests install them with npm: M3LM_AGENT_TESTS=1 runs them")
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed")
    home = Path(os.environ.get("M3LM_AGENTS_DIR", Path.home() / ".cache" / "m3lm-test-agents"))
    bins = {name: home / "node_modules" / ".bin" / name for name in AGENTS}
    if not all(b.exists() for b in bins.values()):
        home.mkdir(parents=True, exist_ok=True)
        cmd = ["npm", "install", "--prefix", str(home), "--no-audit", "--no-fund", *AGENTS.values()]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0 or not all(b.exists() for b in bins.values()):
            pytest.skip(f"could not install the agents with npm: {(r.stderr or r.stdout).strip()[-300:]}")
    return bins


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The story model with a 32k context (its RoPE runs past its training length: only the
    protocol matters here)."""
    path = tmp_path_factory.mktemp("story32k") / "story"
    shutil.copytree(m3lm.DEFAULT_MODEL, path)
    config = json.loads((path / "config.json").read_text())
    for c in (config, config.get("text_config", {})):
        c["max_position_embeddings"] = CONTEXT
    (path / "config.json").write_text(json.dumps(config))
    with story_server(max_model_len=CONTEXT, checkpoint=path) as s:
        yield s


def codex(agents, server, tmp_path, prompt: str, *flags: str) -> subprocess.CompletedProcess:
    home = tmp_path / "codex-home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{NAME}"\nmodel_provider = "m3lm"\n\n[model_providers.m3lm]\nname = "m3lm"\n'
        f'base_url = "{server.url}/v1"\nenv_key = "M3LM_KEY"\nwire_api = "responses"\n'
    )
    env = {**os.environ, "CODEX_HOME": str(home), "M3LM_KEY": API_KEY}
    argv = [
        str(agents["codex"]),
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        *flags,
    ]
    return subprocess.run([*argv, prompt], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


def claude(agents, server, tmp_path, prompt: str, *flags: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "ANTHROPIC_BASE_URL": server.url,
        "ANTHROPIC_API_KEY": API_KEY,
        "ANTHROPIC_MODEL": NAME,
        "ANTHROPIC_SMALL_FAST_MODEL": NAME,
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    argv = [str(agents["claude"]), "-p", prompt, "--model", NAME, "--allowedTools", "Bash(echo:*)", *flags]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


RUN = {"codex": codex, "claude": claude}
SHELL = {"codex": ("exec_command", "cmd"), "claude": ("Bash", "command")}
TOOL_TURN_FLAGS = {"codex": (), "claude": ("--tools", "Bash")}


@pytest.mark.parametrize("agent", list(AGENTS))
def test_a_plain_turn_ends_with_the_models_text(agents, server, tmp_path, agent):
    r = RUN[agent](agents, server, tmp_path, "Tell me a story.")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert len(r.stdout.split()) >= 5, (r.stdout + r.stderr)[-3000:]


@pytest.mark.parametrize("agent", list(AGENTS))
def test_a_tool_turn_runs_the_agents_shell_and_answers(agents, server, tmp_path, agent):
    tok = server.tok
    eos = tok.hf.eos_token_id
    name, arg = SHELL[agent]
    call = [*tool_call_ids(tok, name, [(arg, f"echo {MARK}")]), eos]
    answer = [*tok.encode("All done."), eos]
    ran = []  # for each request after the call: whether the tool's output follows it

    def reply(prompt: list[int]) -> list[int]:
        text = tok.decode(prompt[-2000:])  # the end of the prompt: the call and its output, once made
        _, called, after = text.rpartition("</invoke>")
        if not called:
            return call
        ran.append(MARK in after)
        return answer

    with scripted(server, reply):
        r = RUN[agent](agents, server, tmp_path, f"Run echo {MARK}.", *TOOL_TURN_FLAGS[agent])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "All done." in r.stdout and ran and all(ran), (r.stdout + r.stderr)[-3000:]
