"""`m3lm plan`: each GPU's weights as the loader holds them, and the KV cache the rest holds."""

from dataclasses import replace

import pytest
import torch

from m3lm.distributed.parallel import ParallelConfig
from m3lm.layers.linear import weight_bytes
from m3lm.loader import load_model
from m3lm.memory_plan import describe, plan_memory
from tests.support.checkpoints import TP_SPEC
from tests.support.cli import cli
from tests.support.quant_exports import modelopt_nvfp4_export, random_source

SPEC = replace(TP_SPEC, inter=64, shared_inter=64)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return modelopt_nvfp4_export(tmp_path_factory.mktemp("plan"), True, random_source(SPEC))


@pytest.mark.parametrize(("gpus", "ep"), [(1, False), (2, False), (2, True)])
def test_weights_per_gpu_are_what_each_rank_loads(export, gpus, ep):
    """The fullest rank's resident bytes as a GPU loads the NVFP4 export: on one GPU its 4-bit
    weights kept as stored, on several dequantised to bf16; the export's twin (the same weights
    in a float checkpoint) plans as the dequantised export."""
    plan = plan_memory(export.path, gpus, 10**9, expert_parallel=ep)
    quant = "keep" if gpus == 1 else "none"  # what "auto" does on a GPU
    loaded = [
        load_model(export.path, "cpu", torch.bfloat16, quant=quant, parallel=ParallelConfig(gpus, r, ep))
        for r in range(gpus)
    ]
    assert plan.weight_bytes == max(sum(weight_bytes(m).values()) for m in loaded)
    assert plan.quant == (None if gpus > 1 else "keep") and plan.scheme == "modelopt"
    twin = plan_memory(export.twin, gpus, 10**9, expert_parallel=ep).weight_bytes
    dequantised = plan_memory(export.path, gpus, 10**9, expert_parallel=ep, quant="none").weight_bytes
    assert twin == dequantised and (plan.weight_bytes < twin if gpus == 1 else plan.weight_bytes == twin)


def test_kv_cache_is_what_the_gpu_has_left_in_whole_pages(export):
    plan = plan_memory(export.path, 2, 10**9, utilization=0.5, reserve_bytes=10**8)
    s = SPEC  # per token on a rank: K and V of its KV head on every layer, index keys on MSA layers, bf16
    per_token = 2 * s.layers * (s.kv_heads // 2) * s.head_dim * 2 + sum(s.sparse) * s.index_dim * 2
    assert plan.kv_bytes_per_token == per_token
    left = 10**9 // 2 - plan.weight_bytes - 10**8
    assert plan.kv_bytes == left and plan.kv_tokens == left // (per_token * s.block) * s.block


def test_plan_command_prints_the_plan_and_refuses_a_missing_gpu_size(export):
    argv = ("plan", "--model", str(export.path), "--tensor-parallel-size", "2", "--gpu-memory", "1GB")
    r = cli(*argv, "--reserve", "100MB")
    assert r.returncode == 0, r.stderr
    plan = plan_memory(export.path, 2, 10**9, reserve_bytes=10**8)
    assert plan.kv_tokens > 0
    assert f"= {plan.kv_tokens:,} tokens at {plan.kv_bytes_per_token:,} B each" in r.stdout
    assert "per GPU on 2 GPUs, tensor parallel, held as bf16" in r.stdout
    if not torch.cuda.is_available():
        r = cli("plan", "--model", str(export.path))
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--gpu-memory" in r.stderr


def test_config_json_alone_plans_as_its_checkpoint(export, tmp_path):
    """A folder holding only config.json (say, the release's) plans from the config alone."""
    (tmp_path / "config.json").write_text((export.twin / "config.json").read_text())
    alone, full = plan_memory(tmp_path, 2, 10**9), plan_memory(export.twin, 2, 10**9)
    assert alone.weight_bytes == full.weight_bytes and alone.kv_tokens == full.kv_tokens
    assert alone.checkpoint_bytes == 0 and full.checkpoint_bytes > 0


def test_a_plan_where_the_weights_leave_no_room_says_so(export):
    plan = plan_memory(export.path, 1, 10**6)
    assert plan.kv_bytes == 0 and plan.kv_tokens == 0
    assert "no room for a KV cache" in describe(plan)


def test_an_mxfp8_checkpoint_plans_its_8_bit_shards(tmp_path):
    """On a GPU `serve` keeps an MXFP8 export's shards in 8 bits: so does the plan."""
    from tests.support.checkpoints import TP_MX_SPEC, write_mxfp8_release

    path = write_mxfp8_release(tmp_path, TP_MX_SPEC, seed=1)
    plan = plan_memory(path, 2, 10**9)
    loaded = [
        load_model(path, "cpu", torch.bfloat16, quant="mxfp8", parallel=ParallelConfig(2, r)) for r in (0, 1)
    ]
    assert plan.quant == "mxfp8" and plan.weight_bytes == max(sum(weight_bytes(m).values()) for m in loaded)
    assert plan.weight_bytes < plan_memory(path, 2, 10**9, quant="none").weight_bytes
