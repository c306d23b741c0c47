"""ModelArgs from every config spelling, and clear errors for bad values."""

import copy

import pytest

from m3lm import config
from m3lm.config import ModelArgs, MSAConfig
from m3lm.errors import ConfigError
from tests.support.checkpoints import Spec, bare_text_config, hf_vl_config, release_config
from tests.support.paths import FIXTURES


def test_three_spellings_agree():
    s = Spec()
    a = ModelArgs.from_dict(release_config(s))
    assert a == ModelArgs.from_dict(hf_vl_config(s)) == ModelArgs.from_dict(bare_text_config(s))
    assert a.moe_layers == (False, True, True) and a.sparse_layers == (False, True, True)
    assert a.rotary_dim == 8 and a.kv_groups == 2 and a.index_topk_blocks == 3


def test_release_config_reads_back_as_written():
    """`release_config` writes what `parse_config` reads: the release's layer kinds by default,
    or each layer's kinds as given."""
    sizes = dict(
        vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rotary_dim=8, rope_theta=1e4, max_position_embeddings=512, dense_intermediate_size=96,
        intermediate_size=32, shared_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        index_head_dim=16, block_size=4, topk_blocks=3, local_blocks=1,
    )  # fmt: skip
    a = ModelArgs.from_dict(config.release_config(**sizes, dense_layers=1))
    assert a.moe_layers == a.sparse_layers == (False, True, True, True)
    assert a.msa == MSAConfig(block_size=4, topk_blocks=3, local_blocks=1, init_blocks=0)
    assert (a.vocab_size, a.head_dim, a.rotary_dim, a.num_local_experts) == (300, 16, 8, 8)
    b = ModelArgs.from_dict(
        config.release_config(
            **sizes, moe_layers=(1, 0, 1, 0), sparse_layers=(0, 1, 1, 0), routed_scaling_factor=3.0
        )
    )
    assert b.moe_layers == (True, False, True, False) and b.sparse_layers == (False, True, True, False)
    assert b.routed_scaling_factor == 3.0


def test_rotary_dim_derived_from_factor():
    cfg = release_config(Spec())
    del cfg["text_config"]["rotary_dim"]
    cfg["text_config"]["partial_rotary_factor"] = 0.25
    assert ModelArgs.from_dict(cfg).rotary_dim == 4


def test_release_values_parse():
    """The 428B release's text config (values from the model contract)."""
    n = 60
    text = release_config(Spec())["text_config"]
    text.update(
        vocab_size=200064, hidden_size=6144, num_hidden_layers=n, num_attention_heads=64, num_key_value_heads=4,
        head_dim=128, rotary_dim=64, partial_rotary_factor=0.5, rope_theta=5000000, intermediate_size=3072,
        shared_intermediate_size=3072, dense_intermediate_size=12288, num_local_experts=128, num_experts_per_tok=4,
        moe_layer_freq=[0, 0, 0] + [1] * 57,
    )  # fmt: skip
    text["sparse_attention_config"].update(
        sparse_attention_freq=[0, 0, 0] + [1] * 57, sparse_disable_index_value=[0, 0, 0] + [1] * 57,
        sparse_num_index_heads=4, sparse_index_dim=128, sparse_block_size=128, sparse_topk_blocks=16,
    )  # fmt: skip
    a = ModelArgs.from_dict({"model_type": "minimax_m3_vl", "text_config": text})
    assert a.kv_groups == 16 and a.dense_window == 2048 and sum(a.moe_layers) == 57


def mutate(path: str, value):
    cfg = release_config(Spec())
    node = cfg
    *parents, last = path.split(".")
    for p in parents:
        node = node[p]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return cfg


BAD = [
    ("text_config.num_key_value_heads", 3, "num_attention_heads"),
    ("text_config.sparse_attention_config.sparse_num_index_heads", 1, "index heads = 1"),
    ("text_config.sparse_attention_config.sparse_score_type", "mean", "sparse_score_type' = 'mean'"),
    (
        "text_config.sparse_attention_config.sparse_disable_index_value",
        [0, 0, 1],
        "sparse_disable_index_value[1]",
    ),
    ("text_config.hidden_act", "gelu", "hidden_act' = 'gelu'"),
    ("text_config.hidden_size", KeyError, "'text_config.hidden_size' is missing"),
    ("text_config.rotary_dim", 32, "rotary_dim"),
    (
        "text_config.moe_layer_freq",
        [0, 1],
        "moe_layer_freq' must be a list of num_hidden_layers = 3 entries, got 2",
    ),
    ("text_config.sparse_attention_config.sparse_attention_freq", [0, 1, 1, 1], "sparse_attention_freq"),
    ("text_config.num_experts_per_tok", 9, "num_experts_per_tok' = 9 exceeds"),
    ("text_config.hidden_size", -64, "'text_config.hidden_size' = -64"),
    ("text_config.rms_norm_eps", "tiny", "rms_norm_eps"),
    ("text_config.model_type", "llama", "text_config.model_type' = 'llama'"),
    ("model_type", "qwen3", "'model_type' = 'qwen3'"),
    ("text_config.scoring_func", "softmax", "scoring_func' = 'softmax'"),
    ("text_config.sparse_attention_config.sparse_local_block", 4, "local blocks (4)"),
    ("quantization_config", {"quant_method": "gptq"}, "quant_method' = 'gptq'"),
    ("text_config.tie_word_embeddings", True, "tie_word_embeddings"),
    ("quantization_config", {"quant_method": "mxfp8", "weight_block_size": 32}, "weight_block_size' = 32"),
    ("text_config.num_local_experts", 10**9, "num_local_experts' = 1000000000 exceeds the limit 16384"),
    ("text_config.num_local_experts", True, "num_local_experts' = True must be an integer"),
    ("text_config.num_hidden_layers", 2.0, "num_hidden_layers' = 2.0 must be an integer"),
    ("text_config.hidden_size", 1 << 20, "hidden_size' = 1048576 exceeds the limit 65536"),
    ("text_config.vocab_size", 0, "vocab_size' = 0 must be an integer >= 1"),
    ("text_config.head_dim", 4096, "head_dim' = 4096 exceeds the limit 1024"),
    ("text_config.intermediate_size", 10**7, "intermediate_size' = 10000000 exceeds"),
    ("text_config.max_position_embeddings", 1 << 30, "max_position_embeddings' = 1073741824 exceeds"),
    (
        "text_config.sparse_attention_config.sparse_block_size",
        2 * 10**6,
        "sparse_block_size' = 2000000 exceeds",
    ),
    ("text_config.sparse_attention_config.sparse_block_size", 8192, "sparse_block_size' = 8192 exceeds"),
    ("text_config.max_position_embeddings", 2, "block size = 4 exceeds max_position_embeddings = 2"),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD, ids=[b[0] + "=" + repr(b[1]) for b in BAD])
def test_bad_values_name_key_and_value(path, value, message):
    with pytest.raises(ConfigError) as e:
        ModelArgs.from_dict(mutate(path, value))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_transformers_spelling():
    cfg = hf_vl_config(Spec())
    bad = copy.deepcopy(cfg)
    bad["text_config"]["layer_types"] = ["full_attention", "sliding_attention", "full_attention"]
    with pytest.raises(ConfigError, match="sliding_attention"):
        ModelArgs.from_dict(bad)
    bad = copy.deepcopy(cfg)
    bad["text_config"]["rope_parameters"]["rope_type"] = "yarn"
    with pytest.raises(ConfigError, match="rope_type' = 'yarn'"):
        ModelArgs.from_dict(bad)


def test_from_file_errors(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelArgs.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        ModelArgs.from_file(tmp_path / "config.json")


@pytest.mark.skipif(not FIXTURES.is_dir(), reason="no golden fixtures")
def test_fixture_configs_agree():
    names = ["minimax-m3-tiny", "minimax-m3-tiny-hf-layout", "minimax-m3-tiny-mxfp8"]
    args = [ModelArgs.from_file(FIXTURES / n / "config.json") for n in names]
    assert args[0] == args[1]
    assert args[2].quant_method == "mxfp8"
