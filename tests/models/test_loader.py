"""Loader: every layout lands on the same parameters; bad checkpoints fail clearly and early."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import m3lm
from m3lm.errors import CheckpointError, ConfigError
from m3lm.loader import resolve_dtype
from tests.support.checkpoints import (
    Spec,
    hf_model,
    hf_vl_config,
    release_config,
    to_hf_layout,
    to_release,
    write_checkpoint,
)

SPEC = Spec()


@pytest.fixture(scope="module")
def release_tensors():
    return to_release(hf_model(SPEC, seed=5).state_dict(), SPEC)


def write(path, tensors, config=None, shards=1):
    return write_checkpoint(path, tensors, config or release_config(SPEC), shards)


def test_packed_and_separate_shared_expert_identical(tmp_path):
    sd = hf_model(SPEC, seed=4).state_dict()
    ids = torch.randint(0, SPEC.vocab, (1, 40), generator=torch.Generator().manual_seed(0))
    outs = []
    for packed in (False, True):
        path = write(tmp_path / str(packed), to_hf_layout(sd, SPEC, pack_shared=packed), hf_vl_config(SPEC))
        model, _ = m3lm.load(path, device="cpu", dtype=torch.float32)
        with torch.inference_mode():
            outs.append(model(ids))
    assert torch.equal(outs[0], outs[1])


def test_own_state_dict_round_trips(tmp_path, release_tensors):
    """An already converted checkpoint (m3lm's own names) passes through the remap."""
    model, _ = m3lm.load(write(tmp_path / "a", release_tensors), device="cpu")
    path = write(tmp_path / "b", dict(model.state_dict()))
    again, _ = m3lm.load(path, device="cpu")
    for (n, p), (_, q) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(p, q), n


def test_missing_tensor_is_named(tmp_path, release_tensors):
    t = dict(release_tensors)
    del t["language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    del t["language_model.model.layers.0.self_attn.q_norm.weight"]
    with pytest.raises(CheckpointError) as e:
        m3lm.load(write(tmp_path, t), device="cpu")
    msg = str(e.value)
    assert "missing tensor(s)" in msg
    assert "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight" in msg
    assert "language_model.model.layers.0.self_attn.q_norm.weight" in msg


def test_wrong_shape_names_expected_and_found(tmp_path, release_tensors):
    t = dict(release_tensors)
    t["language_model.model.layers.2.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    with pytest.raises(CheckpointError) as e:
        m3lm.load(write(tmp_path, t), device="cpu")
    assert (
        "language_model.model.layers.2.self_attn.k_proj.weight: expected shape [32, 64], found [16, 64]"
        in str(e.value)
    )


def test_unclaimed_tensor_is_an_error(tmp_path, release_tensors):
    t = dict(release_tensors)
    t["language_model.model.layers.1.self_attn.index_v_proj.weight"] = torch.zeros(16, 64)
    t["language_model.model.layers.7.mlp.up_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(
        CheckpointError, match="no parameter claims.*layers.1.self_attn.index_v_proj.*layers.7"
    ):
        m3lm.load(write(tmp_path, t), device="cpu")


def test_duplicate_tensor_is_an_error(tmp_path):
    sd = hf_model(SPEC, seed=4).state_dict()
    t = to_hf_layout(sd, SPEC, pack_shared=True)
    t["model.language_model.layers.1.mlp.shared_experts.down_proj.weight"] = sd[
        "model.layers.1.mlp.shared_experts.down_proj.weight"
    ]
    with pytest.raises(
        CheckpointError, match="more than once.*layers.1.block_sparse_moe.shared_experts.down_proj"
    ):
        m3lm.load(write(tmp_path, t, hf_vl_config(SPEC)), device="cpu")


def test_path_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        m3lm.load(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        m3lm.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(release_config(SPEC)))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        m3lm.load(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file: m3lm reads a local checkpoint directory"):
        m3lm.load(tmp_path / "file")


def test_bad_config_fails_before_weights(tmp_path, release_tensors):
    cfg = release_config(SPEC)
    cfg["text_config"]["num_attention_heads"] = 5
    with pytest.raises(ConfigError, match="num_attention_heads' = 5"):
        m3lm.load(write(tmp_path, release_tensors, cfg), device="cpu")


def test_corrupt_and_missing_shards(tmp_path, release_tensors):
    path = write(tmp_path, release_tensors, shards=2)
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot read safetensors header"):
        m3lm.load(path, device="cpu")
    shard.unlink()
    with pytest.raises(CheckpointError, match="names shard"):
        m3lm.load(path, device="cpu")


def test_truncated_data_is_reported(tmp_path, release_tensors):
    path = write(tmp_path, release_tensors)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-4096])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        m3lm.load(path, device="cpu")


def test_float8_without_scales_is_an_error(tmp_path, release_tensors):
    t = dict(release_tensors)
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    t[name] = t[name].to(torch.float8_e4m3fn)
    with pytest.raises(CheckpointError, match="float8 tensor without"):
        m3lm.load(write(tmp_path, t), device="cpu")


def test_dtype_names_and_defaults():
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) is torch.float32
    assert resolve_dtype(None, torch.device("cpu")) is torch.float32
    assert resolve_dtype(None, torch.device("cuda")) is torch.bfloat16
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8", torch.device("cpu"))


def test_load_streams_into_requested_dtype(tmp_path, release_tensors):
    model, tokenizer = m3lm.load(write(tmp_path, release_tensors), device="cpu", dtype="bfloat16")
    assert tokenizer is None
    assert model.lm_head.weight.dtype is torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())
    save_file({"x": torch.zeros(1)}, tmp_path / "unused.safetensors")  # stray files are ignored
    m3lm.load(tmp_path, device="cpu")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.float64, torch.bool])
def test_non_float_weight_is_refused_with_its_dtype(tmp_path, release_tensors, dtype):
    t = dict(release_tensors)
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    t[name] = t[name].to(dtype)
    found = {torch.int32: "I32", torch.int8: "I8", torch.float64: "F64", torch.bool: "BOOL"}[dtype]
    with pytest.raises(CheckpointError) as e:
        m3lm.load(write(tmp_path, t), device="cpu")
    assert f"{name}: dtype {found} is not supported (expected one of F16, BF16, F32" in str(e.value)


def test_half_precision_weights_load(tmp_path, release_tensors):
    t = {
        k: v.to(torch.bfloat16 if i % 2 else torch.float16)
        for i, (k, v) in enumerate(release_tensors.items())
    }
    model, _ = m3lm.load(write(tmp_path, t), device="cpu")
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, t[name].float())


def test_mxfp8_scales_must_be_uint8(tmp_path, release_tensors):
    from m3lm.kernels.fp8 import quantize_mxfp8

    t = dict(release_tensors)
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    t[name], scale = quantize_mxfp8(t[name])
    t[name + "_scale_inv"] = scale.to(torch.int16)
    with pytest.raises(
        CheckpointError, match=f"{name}: MXFP8 weight must be F8_E4M3.*found F8_E4M3 with I16"
    ):
        m3lm.load(write(tmp_path, t), device="cpu")


def test_config_promising_more_weights_than_the_files_hold_is_refused(tmp_path, release_tensors):
    big = Spec(experts=60)
    want = sum(t.numel() for t in hf_model(big).state_dict().values())
    have = sum(t.numel() for t in release_tensors.values())
    with pytest.raises(CheckpointError) as e:
        m3lm.load(write(tmp_path, release_tensors, release_config(big)), device="cpu")
    msg = str(e.value)
    assert (
        f"config.json describes {want:,} parameters but the checkpoint's tensors hold only {have:,} values"
        in msg
    )
    # per MoE layer: 54 absent experts x 3 matrices + the mis-shaped router and bias; 20 named
    assert (
        "layers.1.block_sparse_moe.experts.6.w1.weight" in msg
        and f"(and {2 * (54 * 3 + 2) - 20} more)" in msg
    )


def test_huge_expert_count_is_refused_without_listing_every_slot(tmp_path, release_tensors):
    import tracemalloc

    cfg = release_config(Spec(experts=16384))
    tracemalloc.start()
    with pytest.raises(CheckpointError, match=r"\(and 98,2\d\d more\).*config.json describes"):
        m3lm.load(write(tmp_path, release_tensors, cfg), device="cpu")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 50 * 2**20


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink"])
def test_index_may_not_name_shards_outside_the_model_folder(tmp_path, release_tensors, where):
    outside = tmp_path / "elsewhere.safetensors"
    save_file({"x": torch.zeros(1)}, outside)
    path = write(tmp_path / "m", release_tensors, shards=2)
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = {"absolute": str(outside), "dotdot": "../elsewhere.safetensors", "symlink": "link.safetensors"}[
        where
    ]
    if where == "symlink":
        (path / name).symlink_to(outside)
    data["weight_map"]["x"] = name
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as e:
        m3lm.load(path, device="cpu")
    assert str(e.value) == f"{index} names shard(s) outside the model folder: {path / name}"


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_a_config_leading_outside_the_model_folder_is_refused(tmp_path, release_tensors, name):
    path = write(tmp_path / "m", release_tensors)
    outside = tmp_path / "elsewhere.json"
    outside.write_text(((path / name) if (path / name).exists() else path / "config.json").read_text())
    (path / name).unlink(missing_ok=True)
    (path / name).symlink_to(outside)
    with pytest.raises(CheckpointError) as e:
        m3lm.load(path, device="cpu")
    assert str(e.value) == f"{path / name} leads outside the model folder (to {outside})"


def test_a_hub_cache_snapshot_linking_into_its_blobs_loads(tmp_path, release_tensors):
    """The hub's cache keeps a revision as `snapshots/<rev>/<file>` -> `../../blobs/<hash>`."""
    plain = write(tmp_path / "plain", release_tensors, shards=2)
    repo = tmp_path / "hub" / "models--org--m"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(plain.iterdir())):
        f.rename(blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    model, _ = m3lm.load(snapshot, device="cpu")
    reference, _ = m3lm.load(write(tmp_path / "again", release_tensors, shards=2), device="cpu")
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_index_with_non_string_file_is_refused(tmp_path, release_tensors):
    path = write(tmp_path, release_tensors, shards=2)
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": 5}}))
    with pytest.raises(CheckpointError, match="'weight_map' must map tensor names to file names"):
        m3lm.load(path, device="cpu")


def test_allocation_matches_to_empty_and_a_load_leaves_sympy_unimported():
    """`allocate` gives what `to_empty` gives (kinds, shapes, strides, dtypes, devices); loading
    the embedded model through it never imports torch's symbolic-shape machinery (sympy), a
    quarter of a second of every start."""
    import subprocess
    import sys

    from m3lm.config import ModelArgs
    from m3lm.loader import allocate
    from m3lm.models.minimax_m3 import MiniMaxM3

    args = ModelArgs.from_file(m3lm.assets.DEFAULT_MODEL / "config.json")
    with torch.device("meta"):
        a, b = MiniMaxM3(args, dtype=torch.float32), MiniMaxM3(args, dtype=torch.float32, quant="mxfp8")
    for model in (a, b):
        want = {
            n: (type(t), t.shape, t.stride(), t.dtype) for n, t in model.state_dict(keep_vars=True).items()
        }
        got = allocate(model, "cpu").state_dict(keep_vars=True)
        assert {n: (type(t), t.shape, t.stride(), t.dtype) for n, t in got.items()} == want
        assert all(t.device.type == "cpu" for t in got.values())
    code = (
        "import sys, m3lm; m3lm.load(m3lm.assets.DEFAULT_MODEL, device='cpu'); print('sympy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]
