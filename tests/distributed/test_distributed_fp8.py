"""Tensor and expert parallelism with 8-bit weights: each rank keeps its MXFP8 shard (e4m3 values
and the E8M0 scales of the same rows and 32-blocks), read as stored or quantised at load. The
gloo groups that run 8-bit shards are in test_distributed.py (one group per size for all cases)."""

import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from m3lm.config import ModelArgs
from m3lm.distributed.parallel import ParallelConfig
from m3lm.distributed.shard import local_shape, param_shard, scale_shard
from m3lm.errors import CheckpointError, ConfigError
from m3lm.loader import load_model
from m3lm.models.minimax_m3 import MiniMaxM3
from tests.support.checkpoints import TP_MX_SPEC as MX_SPEC
from tests.support.checkpoints import (
    Spec,
    hf_model,
    hf_vl_config,
    release_config,
    to_hf_layout,
    write_checkpoint,
    write_mxfp8_release,
)
from tests.support.paths import FIXTURES

SPEC = MX_SPEC
MXFP8_FIXTURE = FIXTURES / "minimax-m3-tiny-mxfp8"
GROUPS = [(2, False), (2, True), (4, False), (4, True)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same random weights as an MXFP8 release export (3 shards) and as a float transformers
    re-save with the shared expert packed into the stacked experts."""
    root = tmp_path_factory.mktemp("mx")
    mx = write_mxfp8_release(root / "mx", SPEC, seed=5, shards=3)
    sd = hf_model(SPEC, seed=5).state_dict()
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


@pytest.mark.parametrize("bad", ["value", "scale"])
def test_8_bit_shards_refuse_nan_encodings(tmp_path, bad):
    """A rank copying e4m3 and E8M0 as stored still refuses their NaN encodings (in its slice)."""
    path = write_mxfp8_release(tmp_path, SPEC, seed=6)
    name = "language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight"  # rows I = 128
    with safe_open(path / "model.safetensors", framework="pt") as st:
        tensors = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
    if bad == "value":
        q = tensors[name].view(torch.uint8).clone()
        q[70, 5] = 0x7F  # e4m3fn NaN, in rank 1's rows at TP 2
        tensors[name] = q.view(torch.float8_e4m3fn)
    else:
        tensors[name + "_scale_inv"][70, 1] = 255  # E8M0 NaN
    save_file(tensors, path / "model.safetensors")
    for pc in (ParallelConfig(2, 0), ParallelConfig(2, 1, ep=True)):  # rows 0-63; experts 4-7
        load_model(path, "cpu", torch.float32, quant="mxfp8", parallel=pc)
    for pc in (ParallelConfig(2, 1), ParallelConfig(2, 0, ep=True)):  # rows 64-127; experts 0-3
        with pytest.raises(CheckpointError, match="NaN"):
            load_model(path, "cpu", torch.float32, quant="mxfp8", parallel=pc)
