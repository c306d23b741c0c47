"""Model configuration: one frozen `ModelArgs` built from any config.json spelling.

Three spellings reach us: the release's VL config (`text_config` with `sparse_attention_config`,
`moe_layer_freq`, `rope_theta`), the transformers re-save (`index_*`, `layer_types`,
`mlp_layer_types`, `rope_parameters`) and a bare text config. `ModelArgs.from_dict` reads them
all; every unsupported or inconsistent value raises `ConfigError` naming the key and the value.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from m3lm.checkpoint_quant import quant_family
from m3lm.errors import ConfigError
from m3lm.kv_events_config import KVEventsConfig
from m3lm.speculative.config import SpeculativeConfig

SESSION_CONTEXT = 32768  # `session_engine`'s default context, in tokens (`m3lm chat`'s)

TOP_MODEL_TYPES = ("minimax_m3_vl", "minimax_m3", "minimax_m3_vl_text")
TEXT_MODEL_TYPES = ("minimax_m3", "minimax_m3_vl_text")
_MISSING = object()
# Generous upper bounds on sizes (the release: vocab 200064, hidden 6144, 60 layers, 64 heads of
# 128, width 12288, 128 experts, blocks of 128, 1M positions), so that a typo is refused before
# it sizes parameters or caches. Both spellings of a key are listed.
CEILINGS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "num_hidden_layers": 1 << 10,
    "num_attention_heads": 1 << 10,
    "num_key_value_heads": 1 << 10,
    "head_dim": 1 << 10,
    "rotary_dim": 1 << 10,
    "intermediate_size": 1 << 18,
    "shared_intermediate_size": 1 << 18,
    "dense_intermediate_size": 1 << 18,
    "num_local_experts": 1 << 14,
    "num_experts_per_tok": 1 << 10,
    "max_position_embeddings": 1 << 24,
    "sparse_num_index_heads": 1 << 10,
    "index_n_heads": 1 << 10,
    "sparse_index_dim": 1 << 10,
    "index_head_dim": 1 << 10,
    "sparse_block_size": 1 << 12,
    "index_block_size": 1 << 12,
    "sparse_topk_blocks": 1 << 16,
    "index_topk_blocks": 1 << 16,
    "sparse_local_block": 1 << 16,
    "index_local_blocks": 1 << 16,
    "sparse_init_block": 1 << 16,
    "index_init_blocks": 1 << 16,
}


class MSAConfig(NamedTuple):
    """A sparse layer's block selection: each query's KV group attends the `topk_blocks` best blocks
    of `block_size` keys, `local_blocks` most recent and `init_blocks` first ones always among them."""

    block_size: int
    topk_blocks: int
    local_blocks: int
    init_blocks: int


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    swiglu_alpha: float
    swiglu_limit: float
    dense_intermediate_size: int
    intermediate_size: int
    shared_intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    moe_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP
    sparse_layers: tuple[bool, ...]  # per layer: MSA (True) or full attention
    index_n_heads: int
    index_head_dim: int
    index_block_size: int
    index_topk_blocks: int
    index_local_blocks: int
    index_init_blocks: int
    quant_method: str | None = None

    @property
    def kv_groups(self) -> int:
        """Query heads per KV head (16 in the release)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def msa(self) -> MSAConfig:
        return MSAConfig(
            self.index_block_size, self.index_topk_blocks, self.index_local_blocks, self.index_init_blocks
        )

    @property
    def dense_window(self) -> int:
        """Sequences up to this many tokens attend densely even on MSA layers (exact)."""
        return self.index_topk_blocks * self.index_block_size

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        return parse_config(config)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelArgs:
        path = Path(path)
        try:
            config = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        except RecursionError:
            raise ConfigError(f"{path} is nested too deeply to be a model config") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{path} must hold a JSON object, found {type(config).__name__}")
        return parse_config(config)


class _Reader:
    """Typed access to one config dict, with errors that name the key and the value."""

    def __init__(self, d: dict[str, Any], prefix: str):
        self.d, self.prefix = d, prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.d and self.d[key] is not None:
            return self.d[key]
        if default is _MISSING:
            raise ConfigError(f"config.json: required key '{self.name(key)}' is missing")
        return default

    def int(self, key: str, default: Any = _MISSING, minimum: int = 1) -> int:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"config.json: '{self.name(key)}' = {v!r} must be an integer >= {minimum}")
        if v > CEILINGS[key]:
            raise ConfigError(f"config.json: '{self.name(key)}' = {v!r} exceeds the limit {CEILINGS[key]}")
        return v

    def float(self, key: str, default: Any = _MISSING, positive: bool = True) -> float:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"config.json: '{self.name(key)}' = {v!r} must be a finite number")
        if positive and v <= 0:
            raise ConfigError(f"config.json: '{self.name(key)}' = {v!r} must be > 0")
        return float(v)

    def flag(self, key: str, default: Any = _MISSING) -> bool:
        v = self.raw(key, default)
        if v not in (True, False, 0, 1):
            raise ConfigError(f"config.json: '{self.name(key)}' = {v!r} must be true or false")
        return bool(v)

    def require(self, key: str, allowed: tuple, default: Any = _MISSING) -> Any:
        v = self.raw(key, default)
        if v not in allowed:
            raise ConfigError(
                f"config.json: '{self.name(key)}' = {v!r} is not supported (expected one of {list(allowed)})"
            )
        return v

    def layer_list(self, key: str, n: int, mapping: dict[Any, bool]) -> tuple[bool, ...]:
        v = self.raw(key)
        if not isinstance(v, list) or len(v) != n:
            got = len(v) if isinstance(v, list) else type(v).__name__
            raise ConfigError(
                f"config.json: '{self.name(key)}' must be a list of num_hidden_layers = {n} entries, got {got}"
            )
        bad = [x for x in v if isinstance(x, (list, dict)) or x not in mapping]
        if bad:
            raise ConfigError(
                f"config.json: '{self.name(key)}' has unsupported entry {bad[0]!r} "
                f"(expected one of {list(mapping)})"
            )
        return tuple(mapping[x] for x in v)


def _text_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    top_type = config.get("model_type")
    if top_type is not None and top_type not in TOP_MODEL_TYPES:
        raise ConfigError(
            f"config.json: 'model_type' = {top_type!r} is not supported (expected one of {list(TOP_MODEL_TYPES)})"
        )
    if "text_config" not in config:
        return config, ""
    text = config["text_config"]
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: 'text_config' must be an object, found {type(text).__name__}")
    text_type = text.get("model_type")
    if text_type is not None and text_type not in TEXT_MODEL_TYPES:
        raise ConfigError(
            f"config.json: 'text_config.model_type' = {text_type!r} is not supported "
            f"(expected one of {list(TEXT_MODEL_TYPES)})"
        )
    return text, "text_config."


def _rope(r: _Reader, head_dim: int) -> tuple[float, int]:
    """(theta, rotary_dim) from `rope_parameters` or the flat release keys."""
    params = r.raw("rope_parameters", None)
    if params is not None:
        if not isinstance(params, dict):
            raise ConfigError(f"config.json: '{r.name('rope_parameters')}' must be an object")
        p = _Reader(params, r.name("rope_parameters."))
        p.require("rope_type", ("default",), "default")
        theta = p.float("rope_theta", r.d.get("rope_theta", _MISSING))
        factor = p.float("partial_rotary_factor", r.d.get("partial_rotary_factor", 1.0))
    else:
        if r.raw("rope_scaling", None) is not None:
            raise ConfigError(
                f"config.json: '{r.name('rope_scaling')}' = {r.raw('rope_scaling')!r} is not supported"
            )
        theta = r.float("rope_theta")
        factor = r.float("partial_rotary_factor", 1.0)
    from_factor = head_dim * factor
    rotary_dim = r.int("rotary_dim", int(from_factor))
    if "rotary_dim" in r.d and ("partial_rotary_factor" in r.d or params) and rotary_dim != from_factor:
        raise ConfigError(
            f"config.json: '{r.name('rotary_dim')}' = {rotary_dim} disagrees with head_dim * "
            f"partial_rotary_factor = {head_dim} * {factor}"
        )
    if rotary_dim > head_dim or rotary_dim % 2:
        raise ConfigError(
            f"config.json: '{r.name('rotary_dim')}' = {rotary_dim} must be even and <= head_dim = {head_dim}"
        )
    return theta, rotary_dim


def _layer_kinds(r: _Reader, n: int) -> tuple[tuple[bool, ...], tuple[bool, ...], dict[str, Any]]:
    """(moe_layers, sparse_layers, sparse settings) from either spelling."""
    if "mlp_layer_types" in r.d:
        moe = r.layer_list("mlp_layer_types", n, {"dense": False, "sparse": True})
    else:
        moe = r.layer_list("moe_layer_freq", n, {0: False, 1: True})
    sparse_cfg = r.raw("sparse_attention_config", None)
    if sparse_cfg is None:
        if "layer_types" in r.d:
            sparse = r.layer_list("layer_types", n, {"full_attention": False, "minimax_m3_sparse": True})
        else:
            sparse = (False,) * n
        s = {
            "heads": r.int("index_n_heads", 4),
            "dim": r.int("index_head_dim", 128),
            "block": r.int("index_block_size", 128),
            "topk": r.int("index_topk_blocks", 16),
            "local": r.int("index_local_blocks", 1, minimum=0),
            "init": r.int("index_init_blocks", 0, minimum=0),
        }
        return moe, sparse, s
    if not isinstance(sparse_cfg, dict):
        raise ConfigError(f"config.json: '{r.name('sparse_attention_config')}' must be an object")
    sr = _Reader(sparse_cfg, r.name("sparse_attention_config."))
    if sr.flag("use_sparse_attention", True):
        sparse = sr.layer_list("sparse_attention_freq", n, {0: False, 1: True})
    else:
        sparse = (False,) * n
    sr.require("sparse_score_type", ("max",), "max")
    if "sparse_disable_index_value" in sparse_cfg:
        disable = sr.layer_list("sparse_disable_index_value", n, {0: False, 1: True})
        for i, (is_sparse, off) in enumerate(zip(sparse, disable, strict=True)):
            if is_sparse and not off:
                raise ConfigError(
                    f"config.json: '{sr.name('sparse_disable_index_value')}[{i}]' = 0 on sparse layer {i} "
                    "needs an index-value projection, which m3lm does not support"
                )
    s = {
        "heads": sr.int("sparse_num_index_heads"),
        "dim": sr.int("sparse_index_dim"),
        "block": sr.int("sparse_block_size"),
        "topk": sr.int("sparse_topk_blocks"),
        "local": sr.int("sparse_local_block", 1, minimum=0),
        "init": sr.int("sparse_init_block", 0, minimum=0),
    }
    return moe, sparse, s


def parse_config(config: dict[str, Any]) -> ModelArgs:
    """Build `ModelArgs` from a config.json dict in any of the three spellings."""
    text, prefix = _text_config(config)
    r = _Reader(text, prefix)
    n_layers = r.int("num_hidden_layers")
    hidden = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    kv_heads = r.int("num_key_value_heads")
    if heads % kv_heads:
        raise ConfigError(
            f"config.json: '{r.name('num_attention_heads')}' = {heads} is not divisible by "
            f"'{r.name('num_key_value_heads')}' = {kv_heads}"
        )
    head_dim = r.int("head_dim", hidden // heads)
    theta, rotary_dim = _rope(r, head_dim)
    r.require("hidden_act", ("swigluoai", "silu"))  # transformers re-saves swigluoai as "silu"
    r.require("use_gemma_norm", (True,), True)
    r.require("use_qk_norm", (True,), True)
    r.require("qk_norm_type", ("per_head",), "per_head")
    r.require("attention_output_gate", (False,), False)
    r.require("tie_word_embeddings", (False,), False)
    moe, sparse, s = _layer_kinds(r, n_layers)

    if any(moe):
        r.require("scoring_func", ("sigmoid",), "sigmoid")
        r.require("use_routing_bias", (True,), True)
        r.require("norm_topk_prob", (True,), True)
        r.require("n_shared_experts", (1,), 1)
        n_experts = r.int("num_local_experts")
        top_k = r.int("num_experts_per_tok")
        if top_k > n_experts:
            raise ConfigError(
                f"config.json: '{r.name('num_experts_per_tok')}' = {top_k} exceeds "
                f"'{r.name('num_local_experts')}' = {n_experts}"
            )
        inter = r.int("intermediate_size")
        shared_inter = r.int("shared_intermediate_size")
    else:
        n_experts = top_k = inter = shared_inter = 0
    dense_inter = r.int("dense_intermediate_size") if not all(moe) else 0
    max_pos = r.int("max_position_embeddings", 1 << 20)
    if s["block"] > max_pos:  # the block is also the cache page size, on every layer
        raise ConfigError(
            f"config.json: block size = {s['block']} exceeds max_position_embeddings = {max_pos}"
        )

    if any(sparse):
        if s["heads"] != kv_heads:
            raise ConfigError(
                f"config.json: index heads = {s['heads']} must equal num_key_value_heads = {kv_heads} "
                "(one block selection per KV group)"
            )
        if rotary_dim > s["dim"]:
            raise ConfigError(
                f"config.json: rotary_dim = {rotary_dim} exceeds the index head dim = {s['dim']}"
            )
        if s["local"] + s["init"] > s["topk"]:
            raise ConfigError(
                f"config.json: local blocks ({s['local']}) + init blocks ({s['init']}) exceed "
                f"the top-k blocks ({s['topk']})"
            )

    return ModelArgs(
        vocab_size=r.int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        rms_norm_eps=r.float("rms_norm_eps", 1e-6),
        max_position_embeddings=max_pos,
        swiglu_alpha=r.float("swiglu_alpha", 1.702),
        swiglu_limit=r.float("swiglu_limit", 7.0),
        dense_intermediate_size=dense_inter,
        intermediate_size=inter,
        shared_intermediate_size=shared_inter,
        num_local_experts=n_experts,
        num_experts_per_tok=top_k,
        routed_scaling_factor=r.float("routed_scaling_factor", 2.0) if any(moe) else 1.0,
        moe_layers=moe,
        sparse_layers=sparse,
        index_n_heads=s["heads"],
        index_head_dim=s["dim"],
        index_block_size=s["block"],
        index_topk_blocks=s["topk"],
        index_local_blocks=s["local"],
        index_init_blocks=s["init"],
        quant_method=quant_family(config, text),
    )


def release_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    rotary_dim: int,
    rope_theta: float,
    max_position_embeddings: int,
    dense_intermediate_size: int,
    intermediate_size: int,
    shared_intermediate_size: int,
    num_local_experts: int,
    num_experts_per_tok: int,
    index_head_dim: int,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
    dense_layers: int = 0,
    moe_layers: Sequence[bool] | None = None,
    sparse_layers: Sequence[bool] | None = None,
    routed_scaling_factor: float = 2.0,
) -> dict[str, Any]:
    """A release-style config.json (what `parse_config` reads back): the first `dense_layers`
    layers are dense MLP + full attention, the rest MoE + MSA, as in the release (3 dense layers
    of 60); `moe_layers` and `sparse_layers` set each layer's kinds instead."""
    kinds = [0] * dense_layers + [1] * (num_hidden_layers - dense_layers)
    moe = kinds if moe_layers is None else [int(x) for x in moe_layers]
    sparse = kinds if sparse_layers is None else [int(x) for x in sparse_layers]
    text = {
        "model_type": "minimax_m3",
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "rotary_dim": rotary_dim,
        "partial_rotary_factor": rotary_dim / head_dim,
        "rope_theta": rope_theta,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "hidden_act": "swigluoai",
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "use_gemma_norm": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_head",
        "attention_output_gate": False,
        "intermediate_size": intermediate_size,
        "dense_intermediate_size": dense_intermediate_size,
        "shared_intermediate_size": shared_intermediate_size,
        "n_shared_experts": 1,
        "num_local_experts": num_local_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "routed_scaling_factor": routed_scaling_factor,
        "norm_topk_prob": True,
        "moe_layer_freq": moe,
        "tie_word_embeddings": False,
        "sparse_attention_config": {
            "use_sparse_attention": True,
            "sparse_score_type": "max",
            "sparse_attention_freq": sparse,
            "sparse_disable_index_value": sparse,
            "sparse_num_index_heads": num_key_value_heads,
            "sparse_index_dim": index_head_dim,
            "sparse_block_size": block_size,
            "sparse_topk_blocks": topk_blocks,
            "sparse_init_block": 0,
            "sparse_local_block": local_blocks,
        },
        "num_mtp_modules": 0,
    }
    return {
        "model_type": "minimax_m3_vl",
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


@dataclass(frozen=True)
class LoadSpec:
    """Every loading option in one place: what the CLI, `serve`, `LLM` and the engine process
    load from (`m3lm.engine.launch.load_for_engine`). `dtype` is a torch dtype or its name."""

    model_dir: str
    device: str | None = None
    dtype: Any = None
    quant: str = "auto"
    load_format: str = "auto"  # "dummy": random weights from config.json alone
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    skip_tokenizer_init: bool = False  # token ids in and out

    def check(self, under_torchrun: bool = False) -> None:
        """Refuse combinations that cannot load (a ValueError saying which)."""
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: must be at least 1")
        if self.tensor_parallel_size > 1 or under_torchrun:
            if self.load_format != "auto":
                raise ValueError("--load-format dummy needs --tensor-parallel-size 1")
            if self.skip_tokenizer_init:
                raise ValueError("--skip-tokenizer-init needs --tensor-parallel-size 1 (and no torchrun)")


@dataclass(frozen=True)
class EngineConfig:
    """Runtime knobs of the engine (not properties of a checkpoint).

    The paged KV pool: `kv_cache_tokens` (positions) or `kv_cache_memory` (bytes) set its size;
    else on a GPU it takes what `gpu_memory_utilization` (the share of the whole GPU's memory for
    weights, activations and cache) leaves after the weights and the measured peak activation,
    and on the CPU 1 GiB capped at `max_num_seqs` sequences of `max_model_len`
    (`m3lm.cache.pool.plan_pool`). `max_model_len` None: the model's, shrunk to what the pool
    holds. `msa_dense_window` F > 0 is an opt-in approximation: a sparse layer attends densely
    while its selected window covers at least 1/F of the context (t < F * topk * block_size);
    off (exact MSA) by default.
    `index_cache_fp8` stores the MSA index keys as e4m3 with one fp32 scale per token (about half
    the bytes); it rounds the index scores, so it may change block selections: off by default.
    `prefix_caching`: a new prompt starts on the cache pages that already hold its longest prefix
    of whole pages (`BlockManager.match`); pages of finished requests stay cached until their
    room is needed. `warmup`: whether a serving engine runs `engine.warmup.warm_up` before its first
    request (every kernel variant a step can need compiled, every decode graph captured).
    `cpu_compile`: on the CPU a decode step runs as one compiled program kept on disk instead of
    op by op (`engine.cpu_compile`). "auto" (the default, or $M3LM_CPU_COMPILE): a program on
    disk is used at once, a missing one is built in the background while steps run op by op;
    "wait": the warm-up waits for missing ones; "off": op by op. True and False mean "wait"
    and "off".
    """

    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    kv_cache_tokens: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    msa_dense_window: float | None = None
    cuda_graphs: bool = True  # decode steps on a GPU replay captured graphs
    cpu_compile: str | bool | None = None  # "auto", "wait" or "off" (`engine.cpu_compile`)
    index_cache_fp8: bool = False
    prefix_caching: bool = True  # a prompt starts on the cached pages of its longest known prefix
    warmup: bool = True  # compile kernels and capture graphs before serving
    # drafts verified per step (`SpeculativeConfig`; a dict or its JSON text is read into one)
    speculative_config: SpeculativeConfig | None = None
    # KV-cache events for routers (`KVEventsConfig`, vLLM's spelling; a dict or its JSON text)
    kv_events_config: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_tokens"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{key} = {v!r} must be an integer >= 1")
        m = self.kv_cache_memory
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ConfigError(f"kv_cache_memory = {m!r} must be a number of bytes >= 1")
        if m is not None and self.kv_cache_tokens is not None:
            raise ConfigError("set kv_cache_tokens or kv_cache_memory, not both")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ConfigError(f"gpu_memory_utilization = {u!r} must be a number in (0, 1]")
        if self.msa_dense_window is not None and not self.msa_dense_window > 0:
            raise ConfigError(f"msa_dense_window = {self.msa_dense_window!r} must be > 0")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        object.__setattr__(self, "cpu_compile", _cpu_compile_mode(self.cpu_compile))


CPU_COMPILE_MODES = ("auto", "wait", "off")


def _cpu_compile_mode(value: str | bool | None) -> str:
    """`EngineConfig.cpu_compile` as one of CPU_COMPILE_MODES (None: $M3LM_CPU_COMPILE or "auto")."""
    if value is None:
        value = os.environ.get("M3LM_CPU_COMPILE") or "auto"
    if isinstance(value, bool):
        return "wait" if value else "off"
    if value not in CPU_COMPILE_MODES:
        raise ConfigError(f"cpu_compile = {value!r} must be one of {', '.join(CPU_COMPILE_MODES)}")
    return value
