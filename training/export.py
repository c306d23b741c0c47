"""Write a trained `MiniMaxM3` as a release-layout checkpoint that `m3lm.load` reads like any other.

Layout: config.json in the release's VL form (`text_config` with `sparse_attention_config`,
`moe_layer_freq`, `rope_theta`, `rotary_dim`, `partial_rotary_factor`, `hidden_act: swigluoai`),
generation_config.json, the tokenizer files, and model.safetensors with the release key names:
`language_model.` + m3lm's parameter names, routed experts split per expert
(`block_sparse_moe.experts.E.w1/w2/w3.weight`), router weight and correction bias in fp32,
everything else bf16. The config carries no vision tower: the model has none and m3lm reads only
`text_config`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from m3lm.loader import FP32_PARAMS
from m3lm.models.minimax_m3 import MiniMaxM3, release_name

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


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
    dense_layers: int,
    dense_intermediate_size: int,
    intermediate_size: int,
    shared_intermediate_size: int,
    num_local_experts: int,
    num_experts_per_tok: int,
    index_head_dim: int,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
) -> dict[str, Any]:
    """A release-style config.json: the first `dense_layers` layers are dense MLP + full attention,
    the rest MoE + MSA, as in the release (3 dense layers of 60)."""
    kinds = [0] * dense_layers + [1] * (num_hidden_layers - dense_layers)
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
        "routed_scaling_factor": 2.0,
        "norm_topk_prob": True,
        "moe_layer_freq": kinds,
        "tie_word_embeddings": False,
        "sparse_attention_config": {
            "use_sparse_attention": True,
            "sparse_score_type": "max",
            "sparse_attention_freq": kinds,
            "sparse_disable_index_value": kinds,
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


def release_tensors(model: MiniMaxM3) -> dict[str, torch.Tensor]:
    """Release key -> tensor: experts split per expert; router weight and bias fp32, the rest bf16."""
    out = {}
    for name, p in model.state_dict().items():
        dtype = torch.float32 if name.endswith(FP32_PARAMS) else torch.bfloat16
        t = p.detach().to("cpu", dtype)
        if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            for e in range(t.shape[0]):
                out[release_name(name, e)] = t[e].contiguous()
        else:
            out[release_name(name)] = t.contiguous()
    return out


def export_checkpoint(
    model: MiniMaxM3,
    config: dict[str, Any],
    tokenizer_dir: Path,
    out: Path,
    bos_token_id: int,
    eos_token_id: int,
    temperature: float = 0.8,
) -> Path:
    """Write the checkpoint directory `out` and return it."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(release_tensors(model), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "do_sample": True,
        "temperature": temperature,  # a little below the release's 1.0: a small model wanders sooner
        "top_p": 0.95,
        "top_k": 40,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = config["text_config"]["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    return out
