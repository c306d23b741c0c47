"""The checkpoint's own quantisation description: which encodings each module may be stored in."""

import pytest

from m3lm.checkpoint_quant import (
    AFFINE,
    MXFP4,
    MXFP8,
    NVFP4,
    PLAIN,
    check,
    compressed_tensors_scheme,
    mlx_scheme,
    modelopt_scheme,
    stored,
)
from m3lm.errors import CheckpointError

Q = "language_model.model.layers.3.self_attn.q_proj"


def test_mixed_precision_layers_match_either_wrapper_spelling():
    scheme = modelopt_scheme(
        {"quant_algo": "MIXED_PRECISION", "ignore": ["lm_head"], "quantized_layers": {
            "model.language_model.layers.3.self_attn.q_proj": {"quant_algo": "MXFP8"},
            "model.language_model.layers.3.mlp.experts": {"quant_algo": "W4A16_NVFP4"}}},
        "config.json",
    )  # fmt: skip
    assert scheme.rule(Q).kinds == {PLAIN, MXFP8}
    assert scheme.rule("model.layers.3.mlp.experts.7.gate_proj").kinds == {PLAIN, NVFP4}  # listed as a parent
    assert scheme.rule("language_model.model.layers.3.self_attn.k_proj").kinds == {PLAIN}  # not listed
    assert scheme.rule("language_model.lm_head").kinds == {PLAIN}


def test_exclusions_are_wildcards_and_come_first():
    scheme = modelopt_scheme(
        {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["*self_attn*"]}}, "hf"
    )
    assert scheme.rule(Q).kinds == {PLAIN}
    assert scheme.rule("model.layers.3.block_sparse_moe.experts.0.w1").kinds == {PLAIN, NVFP4}


def test_compressed_tensors_targets_in_order_after_ignore():
    weights = {"type": "float", "strategy": "group", "group_size": 32}
    scheme = compressed_tensors_scheme({
        "config_groups": {
            "experts": {"targets": [r"re:.*experts\.\d+\.w[123]$"], "weights": {"num_bits": 4, **weights}},
            "rest": {"targets": ["Linear"], "weights": {"num_bits": 8, **weights}},
        },
        "ignore": [r"re:.*\.gate$"],
    })  # fmt: skip
    assert scheme.rule("model.layers.1.block_sparse_moe.experts.5.w2").kinds == {PLAIN, MXFP4}
    assert scheme.rule(Q).kinds == {PLAIN, MXFP8}
    assert scheme.rule("model.layers.1.block_sparse_moe.gate").kinds == {PLAIN}


def test_mlx_overrides_per_module_and_false():
    scheme = mlx_scheme({"bits": 3, "group_size": 64, "model.layers.3.self_attn.q_proj": {"bits": 6},
                         "lm_head": False})  # fmt: skip
    assert (scheme.rule(Q).bits, scheme.rule(Q).group) == (6, 64)  # the group from the default
    assert scheme.rule("model.layers.3.self_attn.k_proj").bits == 3
    assert scheme.rule("language_model.lm_head").kinds == {PLAIN}


def test_stored_reads_the_encoding_from_sibling_names():
    h = {
        "a.weight": ((8, 4), "U32"), "a.scales": ((8, 1), "BF16"), "a.biases": ((8, 1), "BF16"),
        "b.weight": ((8, 16), "U8"), "b.weight_scale": ((8, 2), "F8_E4M3"), "b.weight_scale_2": ((), "F32"),
        "c.weight_packed": ((8, 16), "U8"), "c.weight_scale": ((8, 1), "U8"),
        "d.weight": ((8, 32), "F8_E4M3"), "d.weight_scale": ((8, 1), "F8_E8M0"),
        "e.weight": ((8, 32), "BF16"), "e.bias": ((8,), "BF16"),
    }  # fmt: skip
    kinds = {n: s.kind for n in h if (s := stored(n, h)) is not None}
    assert kinds == {
        "a.weight": AFFINE,
        "b.weight": NVFP4,
        "c.weight_packed": MXFP4,
        "d.weight": MXFP8,
        "e.weight": PLAIN,
    }
    assert stored("c.weight_packed", h).target == "c.weight"
    rule = mlx_scheme({"bits": 4, "group_size": 32}).rule("a")
    assert check(stored("a.weight", h), h, rule) == ((8, 32), None)
    h["b.weight_scale"] = ((8, 3), "F8_E4M3")
    shape, error = check(stored("b.weight", h), h, modelopt_scheme({"quant_algo": "NVFP4"}, "c").rule("b"))
    assert shape == (8, 32) and error.startswith("b.weight_scale: the scale of NVFP4 weight b.weight [8, 32]")
    h["f.weight"], h["f.weight_scale"] = ((8, 32), "BF16"), ((8, 1), "U8")
    with pytest.raises(CheckpointError, match="f.weight: has f.weight_scale but is neither MXFP8"):
        stored("f.weight", h)
