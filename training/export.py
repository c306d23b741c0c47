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

__all__ = ["export_checkpoint", "release_tensors"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


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
