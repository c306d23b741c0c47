import os
import subprocess
import sys

import pytest
import torch

from m3lm.cli import main
from tests.support.cli import cli, one_line_error, tiny_checkpoint
from tests.support.paths import FIXTURES, REPO

TINY = FIXTURES / "minimax-m3-tiny"
needs_fixture = pytest.mark.skipif(not TINY.is_dir(), reason="no golden fixtures")


def test_list_prints_the_family(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "MiniMax-M3" and out[1].split()[:2] == ["model_type", "minimax_m3_vl,"]
    assert any("MXFP8" in line for line in out)


def test_python_dash_m_works():
    r = cli("list")
    assert r.returncode == 0 and "MiniMaxM3" in r.stdout


def test_bad_model_path_is_one_line():
    r = cli("generate", "--model", "/does/not/exist", "--prompt", "hi")
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0 and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr
    v = cli("--verbose", "generate", "--model", "/does/not/exist", "--prompt", "hi")
    assert v.returncode != 0 and "Traceback" in v.stderr


@needs_fixture
def test_generate_streams_text_and_stats():
    import m3lm

    model, tok = m3lm.load(TINY, device="cpu")
    want = m3lm.generate(model, tok, "Once upon a time", max_tokens=20, temperature=0.0).text
    r = cli(
        "generate",
        "--model",
        str(TINY),
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "20",
        "--temperature",
        "0",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Once upon a time" + want + "\n"
    assert "prompt:" in r.stderr and "tok/s" in r.stderr and "peak memory" in r.stderr


@needs_fixture
def test_generate_with_compiled_decode_steps_gives_the_same_text():
    import m3lm

    model, tok = m3lm.load(TINY, device="cpu")
    want = m3lm.generate(model, tok, "Once upon a time", max_tokens=20, temperature=0.0).text
    argv = ["generate", "--model", str(TINY), "--prompt", "Once upon a time", "--max-tokens", "20"]
    r = cli("--verbose", *argv, "--temperature", "0", "--compile")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Once upon a time" + want + "\n"
    assert "decoding eagerly" not in r.stderr  # the compiled step ran


@needs_fixture
def test_generate_rejects_a_prompt_longer_than_the_context(tmp_path):
    import json
    import shutil

    shutil.copytree(TINY, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 16
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    r = cli("generate", "--model", str(tmp_path / "m"), "--prompt", "word " * 40, "--max-tokens", "4")
    assert r.returncode != 0 and "context" in r.stderr and r.stderr.strip().count("\n") == 0
    assert r.stdout == ""  # the refused prompt is not echoed
    r = cli(
        "generate",
        "--model",
        str(TINY),
        "--chat",
        "--prompt",
        "hi",
        "--thinking-mode",
        "enabled",
        "--max-tokens",
        "4",
    )
    assert r.returncode == 0, r.stderr


def chat_cli(stdin: str, *extra: str) -> subprocess.CompletedProcess:
    """`m3lm chat` on the tiny fixture, greedy, 8 tokens a reply, fed `stdin`."""
    return cli("chat", "--model", str(TINY), "--max-tokens", "8", "--temperature", "0", *extra, stdin=stdin)


@needs_fixture
def test_chat_repl_keeps_history():
    import m3lm

    model, tok = m3lm.load(TINY, device="cpu")
    first = m3lm.generate(
        model, tok, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0.0
    )
    history = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "and then?"},
    ]
    second = m3lm.generate(model, tok, messages=history, max_tokens=8, temperature=0.0)
    r = chat_cli("hello\nand then?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{first.text}\n{second.text}\n"
    assert r.stderr.count("generation:") == 2


def _two_turns():
    """The chat test's conversation, computed through the Python API: (model, tokenizer, turn 1's
    prompt ids, its greedy reply of 8 tokens, turn 2's prompt ids)."""
    import m3lm

    model, tok = m3lm.load(TINY, device="cpu")
    turn1 = [{"role": "user", "content": "hello"}]
    first = m3lm.generate(model, tok, messages=turn1, max_tokens=8, temperature=0.0)
    turn2 = [*turn1, {"role": "assistant", "content": first.text}, {"role": "user", "content": "and then?"}]
    return model, tok, tok.apply_chat_template(turn1), first, tok.apply_chat_template(turn2)


@needs_fixture
def test_chat_computes_only_what_each_turn_adds():
    """One engine serves the whole conversation: the second turn's prompt starts on the pages
    the first turn left cached, as many as its history shares with them in whole pages."""
    model, _, p1, first, p2 = _two_turns()
    written = p1 + first.token_ids[:-1]  # the last reply token was never fed back: no cache entry
    shared = next((k for k, (a, b) in enumerate(zip(p2, written, strict=False)) if a != b), len(written))
    page = model.args.index_block_size
    want = min(shared, len(p2) - 1) // page * page  # whole pages; the last prompt token is computed
    assert want > 0
    r = chat_cli("hello\nand then?\n/exit\n")
    assert r.returncode == 0, r.stderr
    stats = [line for line in r.stderr.splitlines() if line.startswith("prompt:")]
    assert len(stats) == 2
    assert stats[0].startswith(f"prompt: {len(p1)} tokens, ")
    assert stats[1].startswith(f"prompt: {len(p2)} tokens ({want} cached), ")


@needs_fixture
def test_chat_that_outgrows_its_context_says_so_and_goes_on():
    """A context that holds the second turn with 2 tokens of reply: the third turn is refused
    with the reason, and after /reset the conversation starts again."""
    _, _, _, first, p2 = _two_turns()
    limit = len(p2) + 2
    r = chat_cli("hello\nand then?\nwhat next?\n/reset\nhello\n/exit\n", "--max-model-len", str(limit))
    assert r.returncode == 0, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"context holds {limit}" in errors[0] and "/reset" in errors[0]
    assert r.stderr.count("generation:") == 3  # turns 1, 2 and the one after /reset
    assert r.stdout.startswith(first.text + "\n") and r.stdout.endswith("\n" + first.text + "\n")


def test_default_model_tells_a_story():
    """`m3lm generate --prompt ...` on the embedded model, greedy and sampled."""
    import m3lm

    greedy = cli("generate", "--prompt", "Once upon a time", "--temperature", "0", "--max-tokens", "300")
    assert greedy.returncode == 0, greedy.stderr
    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu")
    res = m3lm.generate(model, tok, "Once upon a time", max_tokens=300, temperature=0.0)
    assert greedy.stdout == "Once upon a time" + res.text + "\n"
    assert res.finish_reason == "stop"  # the model ends its story with EOS
    for text in (res.text, cli("generate", "--prompt", "Once upon a time", "--seed", "3").stdout):
        words = text.split()
        assert len(words) >= 20
        plain = sum(c.isascii() and (c.isalnum() or c in " .,!?'\"\n-") for c in text)
        assert plain / len(text) > 0.97
        assert sum(w.strip(".,!?\"'").lower() in COMMON for w in words) / len(words) > 0.3


COMMON = set(
    [
        "the",
        "a",
        "and",
        "to",
        "was",
        "he",
        "she",
        "they",
        "it",
        "his",
        "her",
        "of",
        "in",
        "on",
        "with",
        "said",
        "one",
        "day",
        "little",
        "big",
        "very",
        "happy",
        "there",
        "were",
        "had",
        "saw",
        "wanted",
        "play",
        "went",
        "friend",
        "friends",
        "mom",
        "dad",
        "time",
        "so",
        "but",
        "not",
        "you",
        "i",
        "is",
        "that",
        "at",
        "for",
        "what",
        "like",
        "be",
        "all",
        "up",
        "out",
        "go",
        "then",
    ]
)


def test_generate_with_weights_quantised_to_mxfp8_at_load():
    import m3lm

    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu", quant="mxfp8")
    want = m3lm.generate(model, tok, "Once upon a time", max_tokens=12, temperature=0.0).text
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())  # kept 8-bit on the CPU too
    r = cli(
        "generate",
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--quant",
        "mxfp8",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Once upon a time" + want + "\n"


@needs_fixture
def test_chat_under_tensor_parallelism_matches_one_process():
    args = ["chat", "--model", str(TINY), "--max-tokens", "8", "--temperature", "0"]
    one = cli(*args, stdin="hello\nand then?\n/exit\n")
    two = cli(*args, "--tensor-parallel-size", "2", stdin="hello\nand then?\n/exit\n")
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and one.stdout.count("\n") == 2


@pytest.mark.parametrize(("flag", "on"), [([], True), (["--no-prefix-caching"], False)])
def test_serve_passes_prefix_caching_to_the_engine(monkeypatch, flag, on):
    import m3lm.server.app as app

    seen = {}
    monkeypatch.setattr(app, "serve", lambda *a, **k: seen.update(k))
    assert main(["serve", *flag]) == 0
    assert seen["prefix_caching"] is on


@pytest.mark.parametrize(("flag", "on"), [([], True), (["--no-web-ui"], False)])
def test_serve_passes_the_web_ui_switch(monkeypatch, flag, on):
    import m3lm.server.app as app

    seen = {}
    monkeypatch.setattr(app, "serve", lambda *a, **k: seen.update(k))
    assert main(["serve", *flag]) == 0
    assert seen["web_ui"] is on


def test_cuda_device_without_cuda_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = one_line_error(capsys, ["generate", "--device", "cuda", "--prompt", "hi", "--max-tokens", "1"])
    assert "'cuda': torch " in err and "sees no CUDA GPU; use --device cpu" in err
    err = one_line_error(capsys, ["generate", "--device", "gpu0", "--prompt", "hi", "--max-tokens", "1"])
    assert "'gpu0' is not a device; use cuda, cuda:N (an NVIDIA GPU) or cpu" in err
    err = one_line_error(capsys, ["chat", "--device", "mps"])
    assert "'mps': m3lm runs on NVIDIA GPUs (cuda) and the CPU; use --device cpu" in err


def test_quantization_config_string_is_one_line(tmp_path, capsys):
    from tests.support.checkpoints import Spec, release_config

    cfg = {**release_config(Spec()), "quantization_config": "mxfp8"}
    path = tiny_checkpoint(tmp_path, cfg)
    err = one_line_error(capsys, ["generate", "--model", str(path), "--prompt", "hi"])
    assert "'quantization_config' = 'mxfp8' must be an object" in err


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors.index.json"])
def test_deeply_nested_json_is_one_line(tmp_path, capsys, name):
    path = tiny_checkpoint(tmp_path)
    (path / name).write_text("[" * 100_000 + "]" * 100_000)
    err = one_line_error(capsys, ["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "1"])
    assert name in err


def test_chat_template_raising_a_python_error_is_one_line(tmp_path, capsys):
    path = tiny_checkpoint(tmp_path, tokenizer_template="{{ messages[0].content ~ (1 / 0) }}")
    err = one_line_error(capsys, ["generate", "--model", str(path), "--chat", "--prompt", "hi"])
    assert "chat template: ZeroDivisionError: division by zero" in err


def test_version_prints_the_distribution_version(capsys, monkeypatch):
    from importlib import metadata

    from m3lm.version import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"m3lm {metadata.version('m3lm')}\n"

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)  # a plain source tree
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"m3lm {__version__}\n"


def test_the_version_has_one_home():
    """pyproject reads m3lm/version.py, so the installed distribution says the same."""
    from importlib import metadata

    from m3lm.version import __version__

    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'attr = "m3lm.version.__version__"' in pyproject
    assert metadata.version("m3lm") == __version__


@pytest.mark.parametrize(
    ("requested", "device", "cores", "params", "want"),
    [
        (None, "cpu", 2, 10_000_000, 1),  # a small model: one thread
        (None, "cpu", 2, 10**9, 2),
        (None, "cpu", 64, 10**9, 4),
        (12, "cpu", 2, 10_000_000, 12),
        (None, "cuda", 64, 10**9, None),
        (3, "cuda", 64, 10**9, None),
    ],
)
def test_cpu_threads_default_and_override(requested, device, cores, params, want):
    from m3lm.threads import cpu_threads

    assert cpu_threads(requested, device, cores, params) == want


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_threads_flag_is_documented(command, capsys):
    from m3lm.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    assert "--threads N" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([command, "--threads", "0"])


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["generate", "--promt", "x"],
            "m3lm generate: error: unrecognized argument: --promt (did you mean --prompt?)",
        ),
        (
            ["serve", "--port=8000", "--api-keys", "k"],
            "m3lm serve: error: unrecognized argument: --api-keys (did you mean --api-key?)",
        ),
        (["--verbose", "chat", "--xyzzy"], "m3lm chat: error: unrecognized argument: --xyzzy"),
    ],
)
def test_a_mistyped_flag_is_refused_under_its_command(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.rstrip().splitlines()[-1] == said
    assert err.startswith(f"usage: m3lm {argv[-2] if argv[0] == '--verbose' else argv[0]} ")


def test_flags_abbreviated_or_after_a_double_dash_are_left_to_argparse():
    from m3lm.cli import _refuse_unknown_flags, build_parser

    parser = build_parser()
    _refuse_unknown_flags(parser, ["generate", "--prom", "x", "--max-tok=3", "--", "--whatever"])  # no exit
    assert parser.parse_args(["generate", "--prom", "x", "--max-tok=3"]).prompt == "x"


@pytest.mark.parametrize(("flag", "want"), [([], 1), (["--threads", "2"], 2)])
def test_generate_sets_torch_threads_in_its_process(flag, want, monkeypatch, capsys):
    """The embedded model is small: one thread unless --threads says otherwise."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    argv = ["generate", "--prompt", "Once", "--max-tokens", "2", "--device", "cpu", *flag]
    assert main(argv) == 0
    assert calls == [want]


def test_cli_makes_openmp_threads_sleep_while_they_wait():
    """OMP_WAIT_POLICY=PASSIVE is in the environment before torch loads, unless the user set one."""
    code = "import os, sys; from m3lm.cli import main; main(['list']); print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.splitlines()[-1] == "PASSIVE"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**env, "OMP_WAIT_POLICY": "ACTIVE"}
    )
    assert out.stdout.splitlines()[-1] == "ACTIVE"


LIBRARY = """
import os, sys
import m3lm
import torch
before = torch.get_num_threads()
model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
m3lm.generate(model, tok, "Once", max_tokens=2, temperature=0.0)
print(os.environ.get("OMP_WAIT_POLICY"), before, torch.get_num_threads())
"""


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, ["PASSIVE", "1"]),
        ({"OMP_NUM_THREADS": "2"}, ["PASSIVE", "2"]),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, ["ACTIVE", "1"]),
    ],
)
def test_the_python_api_runs_a_small_model_on_one_sleeping_thread(env, want):
    """As the CLI does: OpenMP's waits sleep when `import m3lm` comes before torch, and the first
    engine of the embedded model sets one thread, unless the environment chose."""
    keep = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    }
    out = subprocess.run([sys.executable, "-c", LIBRARY], capture_output=True, text=True, env={**keep, **env})
    policy, before, after = out.stdout.split()
    assert [policy, after] == want, out.stderr[-2000:]
    if "OMP_NUM_THREADS" in env:
        assert before == after


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve", "--port", "99999"], "99999 is not a port (0 to 65535)"),
        (["generate", "--prompt", "x", "--dtype", "fp16"], "invalid choice: 'fp16'"),
    ],
)
def test_flags_out_of_range_are_refused_by_the_parser(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_bad_sampling_is_refused_before_the_model_loads(monkeypatch, capsys):
    import m3lm.cli

    monkeypatch.setattr(m3lm.cli, "_load", lambda args: pytest.fail("loaded the model"))
    assert main(["generate", "--prompt", "x", "--temperature", "-1"]) == 1
    assert capsys.readouterr().err.strip() == "m3lm: error: temperature = -1.0: must be in [0, 100]"


def test_ctrl_c_during_generate_stops_the_reply_and_exits_130(monkeypatch, capsys):
    """The reply stops after the current step, its stats are printed, and the exit says so."""
    import signal

    import m3lm.generation

    real = m3lm.generation.stream_generate

    def interrupted(*args, **kwargs):
        for i, chunk in enumerate(real(*args, **kwargs)):
            if i == 3:
                signal.raise_signal(signal.SIGINT)
            yield chunk

    monkeypatch.setattr(m3lm.generation, "stream_generate", interrupted)
    argv = ["generate", "--prompt", "Once", "--max-tokens", "50", "--ignore-eos", "--device", "cpu"]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "(stopped)" in err and "generation: 4 tokens" in err and err.rstrip().endswith("m3lm: interrupted")


def test_compile_is_announced_and_kept_out_of_the_generation_rate(monkeypatch, capsys):
    """What the engine reports as compile seconds is said apart and not counted as decoding."""
    import m3lm.generation

    real = m3lm.generation.stream_generate

    def compiling(*args, **kwargs):
        for i, chunk in enumerate(real(*args, **kwargs)):
            chunk.compile_s = 0.0 if i == 0 else 12.0  # the first decode step compiled
            yield chunk

    monkeypatch.setattr(m3lm.generation, "stream_generate", compiling)
    argv = [
        "generate",
        "--prompt",
        "Once",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--device",
        "cpu",
        "--compile",
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "| compiling: 12.0 s |" in err
