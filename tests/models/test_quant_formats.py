"""4- and 8-bit exports load as published, with no flag, and equal their dequantised twins.

Each layout is written by `tests.support.quant_exports` from a random model; the twin carries the
same weights as the tests' own dequantiser reads them. The package's dequantisers are checked
against the tests' on small tensors first.
"""

import pytest
import torch

import m3lm
from m3lm.errors import CheckpointError, ConfigError
from m3lm.kernels.affine import AFFINE_BITS, dequant_affine
from m3lm.kernels.fp4 import dequant_mxfp4, dequant_nvfp4
from m3lm.kernels.fp8 import dequant_mxfp8
from tests.support.checkpoints import release_config, write_checkpoint
from tests.support.quant_exports import (
    QUANT_SPEC,
    affine_dequant,
    affine_quantize,
    ct_mxfp4_export,
    flash_export,
    mlx_export,
    modelopt_nvfp4_export,
    mxfp4_dequant,
    mxfp8_dequant,
    nvfp4_dequant,
    pack_nibbles,
    pack_stream,
    random_source,
    read_stream,
)

GEN = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, generator=GEN)


@pytest.mark.parametrize("bits", AFFINE_BITS)
@pytest.mark.parametrize("group", [32, 64])
def test_affine_dequant_matches_the_tests_reading_of_the_bit_stream(bits, group):
    codes = torch.randint(0, 1 << bits, (3, 2, 128), generator=GEN)
    assert torch.equal(read_stream(pack_stream(codes, bits), bits), codes)
    packed, scales, biases = affine_quantize(randn(3, 2, 128), bits, group)
    assert packed.dtype == torch.uint32 and packed.shape == (3, 2, 128 * bits // 32)
    assert torch.equal(
        dequant_affine(packed, scales, biases, bits), affine_dequant(packed, scales, biases, bits)
    )


def test_affine_codes_cross_bytes_in_stream_order():
    """3-bit codes 0..7 in a row: stream bits 0-2 hold code 0, bits 3-5 code 1, bits 6-8 code 2 ..."""
    codes = torch.arange(32).remainder(8)[None]
    packed = pack_stream(codes, 3)
    first = packed.view(torch.uint8)[0, :3].tolist()
    assert first == [0b10_001_000, 0b1_100_011_0, 0b111_110_10]
    ones = torch.ones(1, 1, dtype=torch.bfloat16)
    assert dequant_affine(packed, ones, 0 * ones, 3).tolist() == [[float(c) for c in codes[0]]]


def test_e2m1_nibbles_low_first_with_their_block_scales():
    codes = torch.tensor([[1, 9, 7, 15] * 8])  # 0.5, -0.5, 6, -6
    packed = pack_nibbles(codes)
    assert packed[0, :2].tolist() == [0x91, 0xF7]
    scale = torch.tensor([[2.0, 0.25]]).to(torch.float8_e4m3fn)
    w = dequant_nvfp4(packed, scale, torch.tensor(3.0))
    assert w[0, :4].tolist() == [3.0, -3.0, 36.0, -36.0] and w[0, 16:20].tolist() == [
        0.375,
        -0.375,
        4.5,
        -4.5,
    ]
    assert dequant_mxfp4(packed, torch.tensor([[130]], dtype=torch.uint8))[0, :4].tolist() == [
        4.0,
        -4.0,
        48.0,
        -48.0,
    ]


def test_fp4_and_fp8_dequant_match_the_tests_dequantisers():
    packed = torch.randint(0, 256, (5, 32), generator=GEN, dtype=torch.int64).to(torch.uint8)
    scale = (randn(5, 4).abs() * 4).to(torch.float8_e4m3fn)
    g = torch.tensor(0.0123, dtype=torch.float32)
    assert torch.equal(dequant_nvfp4(packed, scale, g), nvfp4_dequant(packed, scale, g))
    e8 = torch.randint(100, 150, (5, 2), generator=GEN).to(torch.uint8)
    assert torch.equal(dequant_mxfp4(packed, e8), mxfp4_dequant(packed, e8))
    q = (randn(5, 64) * 50).to(torch.float8_e4m3fn)
    assert torch.equal(dequant_mxfp8(q, e8), mxfp8_dequant(q, e8))
    assert torch.equal(dequant_mxfp8(q, e8.view(torch.float8_e8m0fnu)), mxfp8_dequant(q, e8))


def greedy(model, ids: torch.Tensor, n: int = 6) -> list[int]:
    out = ids
    with torch.inference_mode():
        for _ in range(n):
            out = torch.cat([out, model(out)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out[0, ids.shape[1] :].tolist()


def assert_twin(export, spec=QUANT_SPEC, **load):
    """Loads with no flag; fp32 logits equal the twin's within 1e-5 relative; greedy identical."""
    ids = torch.randint(0, spec.vocab, (1, 24), generator=torch.Generator().manual_seed(1))
    model, _ = m3lm.load(export.path, device="cpu", dtype=torch.float32, **load)
    twin, _ = m3lm.load(export.twin, device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        got, want = model(ids), twin(ids)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    assert greedy(model, ids) == greedy(twin, ids)
    return model, twin


MLX_CASES = {
    "4-bit, attention 8-bit, lm_head kept": (4, 64, {"model.lm_head": False} | {
        f"model.layers.{i}.self_attn.{p}": {"bits": 8, "group_size": 32} for i in range(3) for p in ("q_proj", "o_proj")
    }),
    "8-bit, one layer's stacked experts 4-bit": (8, 64, {
        f"model.layers.1.block_sparse_moe.switch_mlp.{p}_proj": {"bits": 4, "group_size": 32} for p in ("gate", "up", "down")
    }),
    "3-bit experts, 6-bit attention": (3, 64, {
        f"model.layers.{i}.self_attn.{p}": {"bits": 6, "group_size": 64}
        for i in range(3) for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    }),
}  # fmt: skip


@pytest.mark.parametrize("case", MLX_CASES)
def test_mlx_affine_export_equals_its_dequantised_twin(tmp_path, case):
    bits, group, overrides = MLX_CASES[case]
    model, twin = assert_twin(mlx_export(tmp_path, bits, group, overrides))
    # every weight decoded with its own module's bits and group, as the tests' dequantiser read it
    for name, p in twin.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], p), name


def test_an_mlx_export_without_the_indexer_attends_densely(tmp_path, caplog):
    """mlx-lm's exports leave the MSA indexer out; the model then runs every layer densely, as the
    twin whose config has no MSA layer (exact below the dense window)."""
    model, _ = assert_twin(mlx_export(tmp_path, 4, 64, {}, indexer=False))
    assert not any(model.args.sparse_layers) and "no MSA indexer weights" in caplog.text


def test_an_unquantised_mlx_export_without_the_indexer_attends_densely_too(tmp_path):
    model, _ = assert_twin(mlx_export(tmp_path, 0, 64, {}, indexer=False))
    assert not any(model.args.sparse_layers)


def test_a_half_missing_indexer_is_still_a_missing_tensor(tmp_path):
    export = mlx_export(tmp_path, 4, 64, {})
    name = "model.layers.1.self_attn.index_k_proj"
    path = rewrite(export, lambda t: [t.pop(name + s) for s in (".weight", ".scales", ".biases")])
    with pytest.raises(CheckpointError, match="missing tensor.*layers.1.self_attn.index_k_proj"):
        m3lm.load(path, device="cpu")


@pytest.mark.parametrize("in_config_json", [False, True], ids=["hf_quant_config", "config.json"])
def test_modelopt_nvfp4_export_with_exclusions(tmp_path, in_config_json):
    export = modelopt_nvfp4_export(tmp_path, in_config_json)
    model, twin = assert_twin(export)
    layer = model.model.layers[1]
    assert torch.equal(layer.block_sparse_moe.experts.w1, twin.model.layers[1].block_sparse_moe.experts.w1)


def test_compressed_tensors_mxfp4_beside_mxfp8(tmp_path):
    assert_twin(ct_mxfp4_export(tmp_path))


def test_compressed_tensors_export_held_in_8_bits_exactly_when_asked(tmp_path):
    """quant="mxfp8": the MXFP8 modules as stored, and the MXFP4 experts too, exactly (an E2M1 value
    times an E8M0 scale is an e4m3 value times an E8M0 scale)."""
    model, twin = assert_twin(ct_mxfp4_export(tmp_path), quant="mxfp8")
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    for layer in (1, 2):
        ours, theirs = (
            model.model.layers[layer].block_sparse_moe.experts,
            twin.model.layers[layer].block_sparse_moe.experts,
        )
        for w in ("w1", "w2", "w3"):
            assert torch.equal(
                dequant_mxfp8(getattr(ours, w), getattr(ours, w + "_scale")), getattr(theirs, w)
            )


def test_m3_1_flash_mix_with_msa_on_every_layer(tmp_path):
    from tests.support.quant_exports import FLASH_SPEC

    model, _ = assert_twin(flash_export(tmp_path), spec=FLASH_SPEC)
    assert all(model.args.sparse_layers)


def rewrite(export, edit):
    """The export's tensors passed through `edit`, written back in place."""
    from safetensors.torch import load_file, save_file

    f = export.path / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f)
    return export.path


def test_a_wrong_scale_shape_names_the_tensor(tmp_path):
    export = modelopt_nvfp4_export(tmp_path, in_config_json=True)
    name = "language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight_scale"
    path = rewrite(export, lambda t: t.__setitem__(name, t[name][:, :2].contiguous()))
    with pytest.raises(
        CheckpointError, match=f"{name}: the scale of NVFP4 weight .* must be F8_E4M3 \\[64, 4\\]"
    ):
        m3lm.load(path, device="cpu")


def test_an_excluded_module_stored_quantised_is_refused(tmp_path):
    export = ct_mxfp4_export(tmp_path)
    config = (export.path / "config.json").read_text().replace('"lm_head"', '"re:.*o_proj$"')
    (export.path / "config.json").write_text(config)
    with pytest.raises(
        CheckpointError, match=r"self_attn.o_proj.weight: stored as MXFP8, but compressed-tensors ignores"
    ):
        m3lm.load(export.path, device="cpu")


def test_nan_scales_are_refused(tmp_path):
    export = ct_mxfp4_export(tmp_path)
    name = "language_model.model.layers.2.block_sparse_moe.experts.0.w2.weight_scale"
    path = rewrite(export, lambda t: t[name].view(-1)[3].fill_(255))
    with pytest.raises(CheckpointError, match="w2.weight_packed holds NaN"):
        m3lm.load(path, device="cpu")


UNKNOWN = {
    "quant_method": ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "'gptq' is not supported"),
    "modelopt algo": (
        {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}},
        "Model Optimizer quant_algo 'FP8' is not supported",
    ),
    "mlx mode": ({"quantization": {"bits": 4, "group_size": 32, "mode": "mxfp4"}}, "mode 'mxfp4' is not supported"),
    "mlx bits": ({"quantization": {"bits": 7, "group_size": 64}}, "bits = 7, group_size = 64 is not supported"),
    "compressed-tensors int4": (
        {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": {
            "targets": ["Linear"], "format": "pack-quantized",
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}},
        "config group 'g' \\(int 4-bit, strategy group, group_size 128, format 'pack-quantized'\\) is not supported",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", UNKNOWN)
def test_an_unknown_scheme_is_one_line_naming_it(tmp_path, case):
    block, message = UNKNOWN[case]
    config = release_config(QUANT_SPEC)
    config.update(block)
    path = write_checkpoint(tmp_path, {"x": torch.zeros(1)}, config)
    with pytest.raises((ConfigError, CheckpointError), match=message) as e:
        m3lm.load(path, device="cpu")
    assert "\n" not in str(e.value)


def test_nvfp4_tensors_without_a_scheme_are_refused(tmp_path):
    export = modelopt_nvfp4_export(tmp_path, in_config_json=False)
    (export.path / "hf_quant_config.json").unlink()
    with pytest.raises(CheckpointError, match="stored as NVFP4, but no quantization config makes it"):
        m3lm.load(export.path, device="cpu")


@pytest.mark.parametrize("layout", ["mlx", "nvfp4"])
def test_each_rank_reads_its_slice_of_packed_weights(tmp_path, layout):
    """Under tensor and expert parallelism a rank dequantises whole rows and keeps its slice: the
    single process's parameters cut by the shard plan (columns split inside a quantisation group)."""
    from dataclasses import replace

    from m3lm.distributed.parallel import ParallelConfig
    from m3lm.distributed.shard import param_shard
    from m3lm.loader import load_model
    from tests.support.checkpoints import TP_SPEC

    source = random_source(replace(TP_SPEC, inter=64, shared_inter=64))
    export = (
        mlx_export(tmp_path, 4, 64, {}, source)
        if layout == "mlx"
        else modelopt_nvfp4_export(tmp_path, True, source)
    )
    full = load_model(export.path, "cpu", torch.float32)
    ref = dict(full.named_parameters())
    for pc in (ParallelConfig(2, 1), ParallelConfig(2, 0, ep=True)):
        model = load_model(export.path, "cpu", torch.float32, parallel=pc)
        for name, p in model.named_parameters():
            shard = param_shard(name, tuple(ref[name].shape), full.args, pc)
            assert torch.equal(p, ref[name][shard] if shard else ref[name]), (pc, name)


def test_a_corrupt_hf_quant_config_is_one_line_naming_it(tmp_path):
    export = modelopt_nvfp4_export(tmp_path, in_config_json=False)
    (export.path / "hf_quant_config.json").write_text('{"quantization": ')
    with pytest.raises(ConfigError, match="hf_quant_config.json: not valid JSON") as e:
        m3lm.load(export.path, device="cpu")
    assert "\n" not in str(e.value)


# --- weights kept as stored (quant="keep": 4-bit and MXFP8 multiplied as published) ------------

KEPT = {
    "MLX 4-bit, attention 8-bit": lambda root: mlx_export(root, 4, 64, MLX_CASES["4-bit, attention 8-bit, lm_head kept"][2]),
    "Model Optimizer NVFP4": lambda root: modelopt_nvfp4_export(root, True),
    "compressed-tensors MXFP4": ct_mxfp4_export,
}  # fmt: skip


def decoder_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.layers.parameters())


@pytest.mark.parametrize("layout", KEPT)
def test_weights_kept_as_stored_compute_the_dequantised_twin(tmp_path, layout):
    """Every 4-bit module keeps its codes and scales (a Q4Linear, or 4-bit routed experts), MXFP8
    modules their e4m3 values; the logits are the twin's within rounding, greedy text identical."""
    from m3lm.layers.linear import MXFP8Linear, Q4Linear

    model, twin = assert_twin(KEPT[layout](tmp_path), quant="keep")
    experts = model.model.layers[1].block_sparse_moe.experts
    assert experts.q4[0] in ("affine4", "nvfp4", "mxfp4") and experts.w1.dtype == torch.uint8
    kinds = {type(m) for m in model.modules()}
    assert (Q4Linear in kinds) == (not layout.startswith("compressed"))  # its MXFP4: the experts alone
    assert (MXFP8Linear in kinds) == layout.startswith("compressed")
    assert decoder_bytes(model) < 0.5 * decoder_bytes(twin)


def test_a_4_bit_slice_keeps_at_most_030x_of_bf16(tmp_path):
    """MLX 4-bit with groups of 64 (the common export): the decoder layers' resident bytes
    (codes, scales and biases; norms and router as they are) against the same layers in bf16."""
    export = mlx_export(tmp_path, 4, 64, {})
    kept, _ = m3lm.load(export.path, device="cpu", dtype=torch.bfloat16, quant="keep")
    plain, _ = m3lm.load(export.path, device="cpu", dtype=torch.bfloat16, quant="none")
    ratio = decoder_bytes(kept) / decoder_bytes(plain)
    assert ratio <= 0.30, ratio


def test_keep_is_refused_under_parallelism_and_auto_dequantises_on_the_cpu(tmp_path):
    from m3lm.distributed.parallel import ParallelConfig

    export = modelopt_nvfp4_export(tmp_path, True)
    with pytest.raises(ValueError, match="keep.*one device"):
        m3lm.load(export.path, device="cpu", quant="keep", parallel=ParallelConfig(2, 0, False))
    model, _ = m3lm.load(export.path, device="cpu")
    assert model.model.layers[1].block_sparse_moe.experts.w1.dtype == torch.float32
