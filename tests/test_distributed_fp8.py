"""Tensor and expert parallelism with 8-bit weights: each rank keeps its MXFP8 shard (e4m3 values
and the E8M0 scales of the same rows and 32-blocks), read as stored or quantised at load, and a
gloo group of 2 or 4 processes computes the single process's logits and greedy tokens."""

import logging

import pytest
import torch
from checkpoints import (
    Spec,
    hf_model,
    hf_vl_config,
    mxfp8_release,
    quantize_hf,
    release_config,
    to_hf_layout,
    write_checkpoint,
)
from conftest import FIXTURES
from test_distributed import assert_equal_to_single_process, run_group

from m3lm.config import ModelArgs
from m3lm.distributed.parallel import ParallelConfig
from m3lm.distributed.shard import local_shape, param_shard, scale_shard
from m3lm.errors import ConfigError
from m3lm.layers.linear import weight_bytes
from m3lm.loader import load_model
from m3lm.models.minimax_m3 import MiniMaxM3

# Row-parallel inputs (heads x head_dim 128, MLP and expert widths 128) split into whole 32-blocks
# up to TP 4; 8 query heads over 2 KV heads (TP 4 replicates KV heads), 8 experts.
SPEC = Spec(vocab=96, heads=8, kv_heads=2, experts=8, block=4, topk_blocks=2, inter=128, shared_inter=128,
            dense_inter=128)  # fmt: skip
MXFP8_FIXTURE = FIXTURES / "minimax-m3-tiny-mxfp8"
GROUPS = [(2, False), (2, True), (4, False), (4, True)]


def _mx_config(config: dict) -> dict:
    config["text_config"]["quantization_config"] = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    return config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same random weights as an MXFP8 release export (3 shards) and as a float transformers
    re-save with the shared expert packed into the stacked experts."""
    root = tmp_path_factory.mktemp("mx")
    sd = hf_model(SPEC, seed=5).state_dict()
    values, scales, _ = quantize_hf(sd)
    mx = write_checkpoint(
        root / "mx", mxfp8_release(values, scales, SPEC), _mx_config(release_config(SPEC)), 3
    )
    hf = write_checkpoint(root / "hf", to_hf_layout(sd, SPEC, pack_shared=True), hf_vl_config(SPEC))
    return mx, hf


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize(("world", "ep"), GROUPS)
def test_scale_shards_follow_their_weights(world, ep):
    args = ModelArgs.from_dict(release_config(SPEC))
    with torch.device("meta"):
        full = {n: tuple(p.shape) for n, p in MiniMaxM3(args, quant="mxfp8").named_parameters()}
        for rank in range(world):
            pc = ParallelConfig(world, rank, ep)
            local = dict(MiniMaxM3(args, quant="mxfp8", parallel=pc).named_parameters())
            assert local.keys() == full.keys()
            for name, p in local.items():
                shard = param_shard(name, full[name], args, pc)
                assert tuple(p.shape) == local_shape(full[name], shard), name
                if name.endswith("_scale"):  # same rows (experts), input columns / 32
                    weight = name.removesuffix("_scale")
                    assert local[weight].dtype == torch.float8_e4m3fn and p.dtype == torch.uint8
                    w = param_shard(weight, full[weight], args, pc)
                    assert shard == scale_shard(w, weight) and shard[:-1] == w[:-1], name
    assert sum(n.endswith("_scale") for n in full) == 4 + 3 + 2 * (6 + 3 + 3)  # dense GQA, 2 x MSA + MoE


def test_splits_that_cut_32_blocks_are_refused():
    small = ModelArgs.from_dict(release_config(Spec()))  # expert, shared and dense widths 32 or 64
    with pytest.raises(ConfigError, match=r"intermediate_size = 32 over 2 ranks gives 16 per rank"):
        MiniMaxM3(small, quant="mxfp8", parallel=ParallelConfig(2, 0))
    with pytest.raises(ConfigError, match=r"whole 32-element MXFP8 blocks"):
        scale_shard((slice(0, 64), slice(16, 32)), "model.layers.1.mlp.down_proj.weight")
    if not MXFP8_FIXTURE.is_dir():
        return  # the fixture's widths (shared expert 32, dense MLP 96) do not split into 32-blocks
    for world in (2, 4):
        with pytest.raises(ConfigError, match="shared_intermediate_size = 32"):
            load_model(MXFP8_FIXTURE, "cpu", torch.float32, quant="mxfp8", parallel=ParallelConfig(world, 0))


@pytest.mark.skipif(not MXFP8_FIXTURE.is_dir(), reason=f"no fixtures at {FIXTURES}")
def test_auto_dequantises_shards_that_would_cut_blocks(monkeypatch, caplog):
    """On a GPU "auto" keeps 8 bits; where a split would cut a block it warns and dequantises."""
    monkeypatch.setattr("m3lm.loader.resolve_quant", lambda *_: "mxfp8")  # as on a GPU
    with caplog.at_level(logging.WARNING, logger="m3lm"):
        model = load_model(MXFP8_FIXTURE, "cpu", torch.float32, quant="auto", parallel=ParallelConfig(2, 1))
    assert "dequantising the 8-bit shards" in caplog.text
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_each_rank_holds_exactly_its_8_bit_slice(checkpoints):
    """MXFP8 slices copied as stored, and a float checkpoint's slices quantised at load: the same
    bytes as the single process's 8-bit parameters, cut by the shard plan."""
    for path in checkpoints:
        full = load_model(path, "cpu", torch.float32, quant="mxfp8")
        ref = dict(full.named_parameters())
        for world, ep in GROUPS:
            for rank in range(world):
                pc = ParallelConfig(world, rank, ep)
                model = load_model(path, "cpu", torch.float32, quant="mxfp8", parallel=pc)
                for name, p in model.named_parameters():
                    shard = param_shard(name, tuple(ref[name].shape), full.args, pc)
                    want = ref[name][shard] if shard else ref[name]
                    assert p.dtype == want.dtype and torch.equal(_bits(p), _bits(want)), (
                        path.name,
                        world,
                        name,
                    )


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_8_bit_logits_and_greedy_equal_single_process(world, checkpoints, tmp_path):
    mx = checkpoints[0]
    results = run_group(world, [("mx", str(mx), ep, "mxfp8") for ep in (False, True)], tmp_path)
    single = load_model(mx, "cpu", torch.float32, quant="mxfp8")
    dtypes = {n: p.dtype for n, p in single.named_parameters()}
    full = weight_bytes(single)
    for ep in (False, True):
        key = f"mx-ep{int(ep)}"
        assert_equal_to_single_process(results[0][key], single, (world, ep))
        for rank in results:
            assert rank[key]["dtypes"] == dtypes  # float8 exactly where the single process has it
            size = rank[key]["bytes"]
            assert size["uint8"] * 32 == size["float8_e4m3fn"]
            # 1/N of the 8-bit weights, plus the replicated index-key head (and KV heads at N = 4)
            assert (
                full["float8_e4m3fn"] / world <= size["float8_e4m3fn"] < 1.05 * full["float8_e4m3fn"] / world
            )
            assert size["float32"] < 0.7 * full["float32"]  # vocab rows split; norms and router replicated
