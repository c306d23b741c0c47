"""KV pool sizing: the arithmetic of `plan_pool`, EngineConfig's checks, the CLI flags, the engine's figures."""

import argparse
import logging

import pytest
import torch

import m3lm
from m3lm.cache.pool import CPU_DEFAULT_BYTES, graph_reserve, plan_pool
from m3lm.cli import build_parser
from m3lm.cli_parser import parse_size
from m3lm.config import EngineConfig
from m3lm.engine.engine import LLMEngine
from m3lm.engine.memory import profile_batches
from m3lm.errors import ConfigError

GIB = 1 << 30
PAGE, PER_PAGE = 128, 3 << 20  # tokens and bytes of one page (made-up figures)
GPU = {"total_bytes": 141 * GIB, "weight_bytes": 20 * GIB, "peak_activation_bytes": 3 * GIB}


def plan(**kw):
    base = {"bytes_per_page": PER_PAGE, "page_size": PAGE, "max_positions": 1 << 20, "max_num_seqs": 64}
    return plan_pool(**{**base, **kw})


@pytest.mark.parametrize("utilization", [0.5, 0.9, 1.0])
@pytest.mark.parametrize("reserve", [0, graph_reserve(64, 200064)])
def test_gpu_pool_takes_what_utilization_leaves(utilization, reserve):
    p = plan(utilization=utilization, reserve_bytes=reserve, max_model_len=4096, **GPU)
    left = 141 * GIB * utilization - 20 * GIB - 3 * GIB
    assert p.source == "gpu_memory_utilization" and p.budget_bytes == int(left) - reserve
    assert p.bytes <= p.budget_bytes < p.bytes + PER_PAGE  # whole pages, less than one lost
    assert p.bytes >= 0.85 * left  # the acceptance floor
    assert p.tokens == p.pages * PAGE and p.bytes == p.pages * PER_PAGE
    assert p.max_model_len == 4096 and p.max_concurrency == p.tokens / 4096


def test_gpu_pool_is_not_capped_by_max_num_seqs():
    p = plan(utilization=0.9, max_num_seqs=1, max_model_len=1024, **GPU)
    assert p.tokens > 1024 * 100


def test_unset_max_model_len_shrinks_to_the_pool():
    p = plan(utilization=0.9, **GPU)
    assert p.max_model_len == min(1 << 20, p.tokens)
    small = plan(explicit_tokens=1000)
    assert small.max_model_len == 1000 and small.tokens == 1000 and small.pages == 8


def test_explicit_bytes_and_tokens():
    p = plan(explicit_bytes=10 * PER_PAGE + 5, max_model_len=512, **GPU)
    assert (p.source, p.pages, p.bytes, p.tokens, p.budget_bytes) == (
        "kv_cache_memory",
        10,
        10 * PER_PAGE,
        1280,
        None,
    )
    t = plan(explicit_tokens=300, max_model_len=300, **GPU)
    assert (t.source, t.pages, t.tokens) == ("kv_cache_tokens", 3, 300)


def test_cpu_default_is_a_gib_capped_at_the_sequences():
    p = plan()
    assert p.source == "cpu default" and p.pages == CPU_DEFAULT_BYTES // PER_PAGE
    capped = plan(max_num_seqs=2, max_model_len=1000)
    assert capped.tokens == 2048 and capped.pages == 16  # 2 x 1000 rounded up to whole pages


def test_errors_name_the_flag():
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        plan(utilization=0.1, **GPU)  # 14.1 GiB < 23 GiB of weights and activation
    with pytest.raises(ConfigError, match=r"fewer than max_model_len.*raise --gpu-memory-utilization"):
        plan(utilization=0.2, max_model_len=1 << 20, **GPU)  # a budget, but not one sequence
    with pytest.raises(ConfigError, match="raise --kv-cache-memory"):
        plan(explicit_bytes=PER_PAGE - 1)
    with pytest.raises(ConfigError, match="lower --max-model-len or raise --kv-cache-tokens"):
        plan(explicit_tokens=100, max_model_len=200)


def test_profile_batches():
    assert profile_batches(2048, 64, 1 << 20) == [[2048]]
    assert profile_batches(2048, 64, 1000) == [[1000, 1000, 48]]
    assert profile_batches(16, 64, 100) == [[16], [1] * 64]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"gpu_memory_utilization": 0}, r"in \(0, 1\]"),
        ({"gpu_memory_utilization": 1.01}, r"in \(0, 1\]"),
        ({"gpu_memory_utilization": float("nan")}, r"in \(0, 1\]"),
        ({"gpu_memory_utilization": True}, r"in \(0, 1\]"),
        ({"kv_cache_memory": 0}, "bytes >= 1"),
        ({"kv_cache_memory": 1.5}, "bytes >= 1"),
        ({"kv_cache_tokens": 0}, ">= 1"),
        ({"kv_cache_tokens": 8, "kv_cache_memory": 1 << 20}, "not both"),
    ],
)
def test_engine_config_refuses(kw, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kw)


def test_engine_config_defaults():
    c = EngineConfig()
    assert c.gpu_memory_utilization == 0.9 and c.kv_cache_memory is None and c.kv_cache_tokens is None
    assert not hasattr(c, "kv_cache_bytes")


@pytest.mark.parametrize(
    ("text", "want"),
    [("1024", 1024), ("20GiB", 20 * GIB), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("2 kib", 2048)],
)
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "0", "20XB", "1e9"])
def test_parse_size_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_pool_flags_parse(command):
    extra = ["--prompt", "x"] if command == "generate" else []
    a = build_parser().parse_args(
        [command, *extra, "--gpu-memory-utilization", "0.8", "--kv-cache-memory", "2GiB"]
    )
    assert (a.gpu_memory_utilization, a.kv_cache_memory, a.kv_cache_tokens) == (0.8, 2 * GIB, None)
    a = build_parser().parse_args([command, *extra, "--kv-cache-tokens", "4096"])
    assert a.kv_cache_tokens == 4096
    assert a.gpu_memory_utilization == (0.9 if command == "serve" else None)
    for bad in (["--gpu-memory-utilization", "0"], ["--kv-cache-tokens", "8", "--kv-cache-memory", "1GiB"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, *extra, *bad])


def test_serve_passes_the_pool_flags(monkeypatch):
    import m3lm.server.app as app
    from m3lm.cli import main

    seen = {}
    monkeypatch.setattr(app, "serve", lambda load, **k: seen.update(k, load=load))
    assert (
        main(["serve", "--kv-cache-memory", "64MiB", "--load-format", "dummy", "--skip-tokenizer-init"]) == 0
    )
    assert seen["kv_cache_memory"] == 64 << 20 and seen["gpu_memory_utilization"] == 0.9
    load = seen["load"]
    assert "kv_cache_tokens" not in seen and load.load_format == "dummy" and load.skip_tokenizer_init


@pytest.fixture(scope="module")
def story():
    return m3lm.load(m3lm.DEFAULT_MODEL, device="cpu")


def test_engine_info_and_startup_line_on_the_cpu(story, caplog):
    model, tok = story
    with caplog.at_level(logging.INFO, logger="m3lm.engine"):
        engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, kv_cache_memory=16 << 20))
    info = engine.info
    assert info.device == "cpu" and info.dtype == "float32" and info.peak_activation_bytes is None
    assert info.pool_source == "kv_cache_memory" and info.pool_bytes <= 16 << 20
    assert info.pool_tokens == engine.blocks.num_pages * model.args.index_block_size
    assert (
        info.max_model_len
        == engine.max_model_len
        == min(info.pool_tokens, model.args.max_position_embeddings)
    )
    assert info.weight_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine on"))
    assert f"{info.pool_tokens:,} tokens" in line and "from kv_cache_memory" in line


@pytest.mark.cuda
@pytest.mark.whole_gpu
def test_gpu_pool_holds_85_percent_of_what_is_left():
    model, _ = m3lm.load(m3lm.DEFAULT_MODEL, device="cuda")
    engine = LLMEngine(model, None, EngineConfig(gpu_memory_utilization=0.5, max_model_len=2048))
    info = engine.info
    assert info.pool_source == "gpu_memory_utilization" and info.peak_activation_bytes > 0
    total = torch.cuda.get_device_properties(0).total_memory
    left = total * 0.5 - info.weight_bytes - info.peak_activation_bytes
    assert info.pool_bytes >= 0.85 * left and info.max_concurrency >= 1
    assert info.pool_bytes <= info.budget_bytes < left
    assert engine.cache.k[0].shape[0] == engine.blocks.num_pages + 1  # the spare page
