"""Tiny random MiniMax-M3 checkpoints in every layout, with transformers as the reference.

A `Spec` describes a model; `hf_model` builds transformers' implementation with random weights
(every parameter, norms and router bias included); the writers turn its state dict into the
release layout, the transformers re-save layout (optionally with the shared expert packed into
the stacked experts), a bare text checkpoint, or an MXFP8 export.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from m3lm import config
from m3lm.kernels.fp8 import dequant_mxfp8, quantize_mxfp8


@dataclass
class Spec:
    vocab: int = 96
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    rotary_dim: int = 8
    theta: float = 10000.0
    moe: tuple = (False, True, True)
    sparse: tuple = (False, True, True)
    experts: int = 6
    top_k: int = 2
    inter: int = 32
    shared_inter: int = 32
    dense_inter: int = 64
    index_dim: int = 16
    block: int = 4
    topk_blocks: int = 3
    local: int = 1
    scaling: float = 2.0

    @property
    def layers(self) -> int:
        return len(self.moe)


def hf_text_config(s: Spec) -> dict:
    """The text config as transformers normalises it."""
    return {
        "model_type": "minimax_m3_vl_text",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "rotary_dim": s.rotary_dim,
        "rope_parameters": {
            "rope_theta": s.theta,
            "partial_rotary_factor": s.rotary_dim / s.head_dim,
            "rope_type": "default",
        },
        "intermediate_size": s.inter,
        "dense_intermediate_size": s.dense_inter,
        "shared_intermediate_size": s.shared_inter,
        "num_local_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "routed_scaling_factor": s.scaling,
        "layer_types": ["minimax_m3_sparse" if x else "full_attention" for x in s.sparse],
        "mlp_layer_types": ["sparse" if x else "dense" for x in s.moe],
        "index_n_heads": s.kv_heads,
        "index_head_dim": s.index_dim,
        "index_block_size": s.block,
        "index_topk_blocks": s.topk_blocks,
        "index_local_blocks": s.local,
        "max_position_embeddings": 4096,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def release_config(s: Spec) -> dict:
    """The config.json of a release: VL wrapper, `sparse_attention_config`, `moe_layer_freq`."""
    return config.release_config(
        vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, head_dim=s.head_dim, rotary_dim=s.rotary_dim, rope_theta=s.theta,
        max_position_embeddings=4096, dense_intermediate_size=s.dense_inter, intermediate_size=s.inter,
        shared_intermediate_size=s.shared_inter, num_local_experts=s.experts, num_experts_per_tok=s.top_k,
        index_head_dim=s.index_dim, block_size=s.block, topk_blocks=s.topk_blocks, local_blocks=s.local,
        moe_layers=s.moe, sparse_layers=s.sparse, routed_scaling_factor=s.scaling,
    )  # fmt: skip


def hf_model(s: Spec, seed: int = 0):
    """transformers' MiniMax-M3 causal LM (eager attention, fp32) with every weight random."""
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    cfg = dict(hf_text_config(s))
    cfg.pop("model_type")
    config = MiniMaxM3VLTextConfig(**cfg)
    config._attn_implementation = "eager"
    model = MiniMaxM3VLForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in sorted(model.state_dict().items()):
            std = 0.3 if t.dim() == 1 else 0.08  # norms and bias: large enough to matter
            t.copy_(torch.randn(t.shape, generator=gen) * std)
    return model


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def to_release(sd: dict[str, torch.Tensor], s: Spec) -> dict[str, torch.Tensor]:
    """transformers' state dict -> release names, per-expert w1/w2/w3, unfused gate/up."""
    out = {}
    for k, t in sd.items():
        k = k.replace("self_attn.indexer.", "self_attn.index_")
        if ".mlp.experts.gate_up_proj" in k:
            base = k.replace("mlp.experts.gate_up_proj", "block_sparse_moe.experts.")
            for e in range(t.shape[0]):
                out[f"{base}{e}.w1.weight"], out[f"{base}{e}.w3.weight"] = t[e].chunk(2)
            continue
        if ".mlp.experts.down_proj" in k:
            base = k.replace("mlp.experts.down_proj", "block_sparse_moe.experts.")
            for e in range(t.shape[0]):
                out[f"{base}{e}.w2.weight"] = t[e]
            continue
        layer = int(k.split(".")[2]) if k.startswith("model.layers.") else -1
        if layer >= 0 and s.moe[layer]:
            k = k.replace(".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias")
            k = k.replace(".mlp.", ".block_sparse_moe.")
        if k.endswith("gate_up_proj.weight"):
            g, u = t.chunk(2)
            out[k.replace("gate_up_proj", "gate_proj")], out[k.replace("gate_up_proj", "up_proj")] = g, u
            continue
        out[k] = t
    out = {"language_model." + k: v.contiguous() for k, v in out.items()}
    # Tensors a text engine must skip.
    out["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.ones(4, 3, 2, 2)
    out["multi_modal_projector.linear_1.weight"] = torch.ones(4, 4)
    out["mtp.layers.0.enorm.weight"] = torch.ones(s.hidden)
    return out


def to_hf_layout(sd: dict[str, torch.Tensor], s: Spec, pack_shared: bool = False) -> dict[str, torch.Tensor]:
    """The transformers re-save layout; `pack_shared` moves the shared expert into stacked entry E."""
    out = {}
    for k, t in sd.items():
        out[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = t.contiguous()
    if pack_shared:
        for layer, moe in enumerate(s.moe):
            if not moe:
                continue
            p = f"model.language_model.layers.{layer}.mlp."
            for kind in ("gate_up_proj", "down_proj"):
                shared = out.pop(f"{p}shared_experts.{kind}.weight")
                out[f"{p}experts.{kind}"] = torch.cat([out[f"{p}experts.{kind}"], shared[None]]).contiguous()
    out["model.vision_tower.layers.0.layer_norm1.weight"] = torch.ones(4)
    return out


def hf_vl_config(s: Spec) -> dict:
    return {
        "model_type": "minimax_m3_vl",
        "text_config": hf_text_config(s),
        "vision_config": {"hidden_size": 4},
    }


def bare_text_config(s: Spec) -> dict:
    text = release_config(s)["text_config"]
    return {**text, "model_type": "minimax_m3"}


def quantize_hf(sd: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """MXFP8-quantise every language-model Linear of a transformers state dict.

    Returns (values, scales, dequantised): values holds float8 weights where quantised and the
    original tensors elsewhere; the router, norms, embeddings and lm_head stay as they are.
    """
    values, scales, dequant = {}, {}, {}
    for k, t in sd.items():
        linear = k.startswith("model.layers.") and (k.endswith("proj.weight") or ".experts." in k)
        if linear and t.shape[-1] % 32 == 0:
            values[k], scales[k] = quantize_mxfp8(t)
            dequant[k] = dequant_mxfp8(values[k], scales[k])
        else:
            values[k] = dequant[k] = t
    return values, scales, dequant


def mxfp8_release(values: dict, scales: dict, s: Spec) -> dict[str, torch.Tensor]:
    """Release-layout MXFP8 export: float8 weights with their `*_scale_inv` siblings."""
    out = to_release(values, s)
    for k, v in to_release(scales, s).items():
        if k in out and out[k].dtype == torch.float8_e4m3fn:
            out[k + "_scale_inv"] = v
    return out


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict, shards: int = 1) -> Path:
    """Write config.json and the tensors, as one file or `shards` files with an index."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    names = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in names}, path / "model.safetensors")
        return path
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, path / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


M3_SPECIALS = [
    "]~!b[",
    "]~b]",
    "[e~[",
    "<mm:think>",
    "</mm:think>",
    "]<]minimax[>[",
    "<tool_call>",
    "</tool_call>",
]
# An M3-style chat template: own BOS, turns ending in EOS, thinking_mode choosing the prompt's end,
# tools listed in a system turn, assistant tool calls written back in the namespaced XML.
M3_TEMPLATE = (
    "{%- set ns_tok = ']<]minimax[>[' -%}{%- set mode = thinking_mode | default('adaptive') -%}"
    "{{- ']~!b[' -}}"
    "{%- if tools -%}{{- ']~b]system\\n' -}}{%- for t in tools -%}{{- (t | tojson) ~ '\\n' -}}{%- endfor -%}"
    "{{- '[e~[\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- ']~b]' ~ ('ai' if m.role == 'assistant' else m.role) ~ '\\n' ~ (m.content or '') -}}"
    "{%- if m.tool_calls -%}{{- ns_tok ~ '<tool_call>' -}}{%- for c in m.tool_calls -%}"
    "{{- ns_tok ~ '<invoke name=\"' ~ c.function.name ~ '\">' -}}"
    "{%- for k, v in c.function.arguments.items() -%}{{- ns_tok ~ '<' ~ k ~ '>' ~ v ~ ns_tok ~ '</' ~ k ~ '>' -}}{%- endfor -%}"
    "{{- ns_tok ~ '</invoke>' -}}{%- endfor -%}{{- ns_tok ~ '</tool_call>' -}}{%- endif -%}"
    "{{- '[e~[\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- ']~b]ai\\n' -}}"
    "{%- if mode == 'enabled' -%}{{- '<mm:think>' -}}{%- elif mode == 'disabled' -%}{{- '</mm:think>' -}}{%- endif -%}"
    "{%- endif -%}"
)


def write_m3_tokenizer(path: Path, vocab_size: int = 384) -> int:
    """A small byte-level BPE with the M3 special tokens and chat template; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=M3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "once upon a time there was a little fox who liked to play in the sun. " * 3,
        "the weather in paris is sunny today",
    ]
    tok.train_from_iterator(corpus * 8, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "]~!b[",
        "eos_token": "[e~[",
        "chat_template": M3_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tok.token_to_id("[e~["), "temperature": 1.0})
    )
    return tok.get_vocab_size()


def write_chat_checkpoint(path, seed: int):
    """A tiny random release-layout checkpoint with M3's tokenizer and chat template."""
    s = Spec(vocab=write_m3_tokenizer(path))
    return write_checkpoint(path, to_release(hf_model(s, seed=seed).state_dict(), s), release_config(s))


# 8 query heads over 2 KV heads (TP 4 replicates KV heads), 8 experts (EP 4 = 2 per rank).
TP_SPEC = Spec(vocab=96, heads=8, kv_heads=2, experts=8, block=4, topk_blocks=2)
# The same with row-parallel inputs (heads x head_dim, MLP and expert widths 128) that split into
# whole 32-element MXFP8 blocks up to TP 4, so ranks can keep 8-bit shards.
TP_MX_SPEC = replace(TP_SPEC, inter=128, shared_inter=128, dense_inter=128)


def write_mxfp8_release(path, s: Spec, seed: int, shards: int = 1):
    """A random MXFP8 release export of spec `s` (the release's quantisation scheme)."""
    values, scales, _ = quantize_hf(hf_model(s, seed=seed).state_dict())
    config = release_config(s)
    config["text_config"]["quantization_config"] = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    return write_checkpoint(path, mxfp8_release(values, scales, s), config, shards)


def random_prompt(n: int, seed: int = 0, vocab: int = 96) -> list[int]:
    """n seeded random token ids below `vocab`."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
