"""Tiny checkpoints in the published 4- and 8-bit layouts, each with its dequantised twin.

A release-layout model (random, `random_source`, or a checkpoint folder such as the embedded
model, `checkpoint_source`) is exported as MLX affine (mlx-lm's
names, stacked `switch_mlp` experts, config.json's `quantization` block with per-module
overrides), Model Optimizer NVFP4 (`weight`, `weight_scale`, `weight_scale_2`, `input_scale`;
the scheme in hf_quant_config.json or config.json, with an exclusion list), compressed-tensors
MXFP4 beside MXFP8, and the M3.1-Flash mix (Model Optimizer MIXED_PRECISION). The twin carries
each quantised weight's values as this file's own dequantiser reads them, in fp32, in the
release layout. The codecs here share no code with the package: codes are packed and read with
Python integers, E2M1 and E8M0 from their definitions.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.support.checkpoints import Spec, hf_model, release_config, to_release, write_checkpoint

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# --- codes and bit streams ------------------------------------------------------------------------


def pack_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., n] (0 .. 2^bits - 1) -> [..., n * bits / 32] uint32: one little-endian bit stream a row."""
    rows = codes.reshape(-1, codes.shape[-1]).tolist()
    out = []
    for row in rows:
        value = sum(int(c) << (i * bits) for i, c in enumerate(row))
        out.append(list(value.to_bytes(len(row) * bits // 8, "little")))
    packed = torch.tensor(out, dtype=torch.uint8).view(torch.uint32)
    return packed.reshape(*codes.shape[:-1], -1)


def read_stream(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack_stream`: [..., words] uint32 -> codes [..., words * 32 / bits] int64."""
    words = packed.reshape(-1, packed.shape[-1])
    n = packed.shape[-1] * 32 // bits
    out = []
    for row in words.view(torch.uint8).reshape(words.shape[0], -1).tolist():
        value = int.from_bytes(bytes(row), "little")
        out.append([(value >> (i * bits)) & ((1 << bits) - 1) for i in range(n)])
    return torch.tensor(out, dtype=torch.int64).reshape(*packed.shape[:-1], n)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., n] -> [..., n / 2] uint8, input 2j in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def e2m1_value(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code of each value (already scaled into [-6, 6])."""
    mags = torch.tensor(E2M1, dtype=torch.float64)
    code = (x.abs()[..., None] - mags).abs().argmin(-1)
    return code | ((x < 0).long() << 3)


# --- quantisers (any reasonable rounding: the tests check decoding, not the encoder) -----------------


def affine_quantize(w: torch.Tensor, bits: int, group: int):
    """MLX's affine scheme: per group scale = (max - min) / (2^bits - 1), bias = min, bf16 both."""
    g = w.double().unflatten(-1, (-1, group))
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / ((1 << bits) - 1)).clamp(min=1e-8).to(torch.bfloat16)
    bias = lo.to(torch.bfloat16)
    q = ((g - bias.double()[..., None]) / scale.double()[..., None]).round().clamp(0, (1 << bits) - 1).long()
    return pack_stream(q.flatten(-2), bits), scale, bias


def affine_dequant(packed, scales, biases, bits: int) -> torch.Tensor:
    q = read_stream(packed, bits).double().unflatten(-1, (scales.shape[-1], -1))
    return (scales.double()[..., None] * q + biases.double()[..., None]).flatten(-2).float()


def nvfp4_quantize(w: torch.Tensor):
    """(packed uint8 [O, In/2], e4m3 scales [O, In/16], fp32 global scale, fp32 input scale)."""
    g = w.double().unflatten(-1, (-1, 16))
    global_scale = torch.tensor(float(w.abs().max()) / (6 * 448), dtype=torch.float32)
    scale = (g.abs().amax(-1) / 6 / float(global_scale)).clamp(max=448).to(torch.float8_e4m3fn)
    denom = scale.double().clamp(min=2.0**-9) * float(global_scale)
    codes = e2m1_codes(g / denom[..., None]).flatten(-2)
    return pack_nibbles(codes), scale, global_scale, torch.tensor(0.5, dtype=torch.float32)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """[..., n / 2] uint8 -> the E2M1 values [..., n] in fp64, read nibble by nibble."""
    rows = [[e2m1_value(c) for byte in row for c in (byte & 0x0F, byte >> 4)] for row in packed.tolist()]
    return torch.tensor(rows, dtype=torch.float64)


def nvfp4_dequant(packed, scale, global_scale) -> torch.Tensor:
    vals = e2m1_values(packed).unflatten(-1, (-1, 16))
    return (vals * scale.double()[..., None] * float(global_scale)).flatten(-2).float()


def e8m0(scale: torch.Tensor) -> torch.Tensor:
    return torch.tensor([[2.0 ** (int(s) - 127) for s in row] for row in scale.tolist()], dtype=torch.float64)


def mx_exponents(g: torch.Tensor, top: float) -> torch.Tensor:
    """Per block E8M0 byte with amax / 2^(e - 127) <= top."""
    amax = g.abs().amax(-1).clamp(min=2.0**-100)
    return (torch.ceil(torch.log2(amax / top)) + 127).clamp(1, 254).long()


def mxfp4_quantize(w: torch.Tensor):
    g = w.double().unflatten(-1, (-1, 32))
    s = mx_exponents(g, 6.0)
    codes = e2m1_codes(g / torch.exp2(s.double() - 127)[..., None]).flatten(-2)
    return pack_nibbles(codes), s.to(torch.uint8)


def mxfp4_dequant(packed, scale) -> torch.Tensor:
    return (e2m1_values(packed).unflatten(-1, (-1, 32)) * e8m0(scale)[..., None]).flatten(-2).float()


def mxfp8_quantize(w: torch.Tensor):
    g = w.double().unflatten(-1, (-1, 32))
    s = mx_exponents(g, 448.0)
    q = (g / torch.exp2(s.double() - 127)[..., None]).to(torch.float8_e4m3fn).flatten(-2)
    return q, s.to(torch.uint8)


def mxfp8_dequant(q, scale) -> torch.Tensor:
    return (q.double().unflatten(-1, (-1, 32)) * e8m0(scale)[..., None]).flatten(-2).float()


# --- exports ----------------------------------------------------------------------------------------------

QUANT_SPEC = Spec(inter=64, shared_inter=64)  # every input width a multiple of 64
FLASH_SPEC = Spec(inter=64, shared_inter=64, sparse=(True, True, True))  # M3.1-Flash: MSA on every layer
_EXPERT = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


@dataclass
class Export:
    path: Path
    twin: Path


@dataclass
class Source:
    """A release-layout checkpoint to export: its language-model tensors, its config.json, and the
    folder whose tokenizer files both the export and its twin take (None: no tokenizer)."""

    tensors: dict[str, torch.Tensor]
    config: dict
    folder: Path | None = None


def random_source(spec: Spec = QUANT_SPEC, seed: int = 0) -> Source:
    t = to_release(hf_model(spec, seed=seed).state_dict(), spec)
    return Source({k: v for k, v in t.items() if k.startswith("language_model.")}, release_config(spec))


def checkpoint_source(folder: Path) -> Source:
    """A release-layout checkpoint folder (one safetensors file), e.g. the embedded model."""
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    return Source(tensors, json.loads((folder / "config.json").read_text()), folder)


def _linear(name: str) -> bool:
    return name.endswith("proj.weight") or bool(_EXPERT.fullmatch(name)) or name.endswith("gate.weight")


def _write_pair(root: Path, tensors: dict, config: dict, twin: dict, source: Source, extra: dict | None = None,
                twin_config: dict | None = None) -> Export:  # fmt: skip
    path = write_checkpoint(root / "export", tensors, config)
    for name, content in (extra or {}).items():
        (path / name).write_text(json.dumps(content))
    twin_path = write_checkpoint(root / "twin", twin, twin_config or source.config)
    if source.folder is not None:
        for f in source.folder.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
                for dest in (path, twin_path):
                    shutil.copy(f, dest / f.name)
    return Export(path, twin_path)


def mlx_export(
    root: Path,
    bits: int,
    group: int,
    overrides: dict,
    source: Source | None = None,
    indexer: bool = True,
) -> Export:
    """mlx-lm's layout: names without `language_model.`, experts stacked as `switch_mlp`, every Linear
    and the embedding quantised (router at 8 bits, as mlx-lm's predicate), bf16 elsewhere. Without
    `indexer`, the MSA indexer is left out as mlx-lm's export does (the twin then has no MSA layer)."""
    source = source or random_source()
    rel = {k: v.to(torch.bfloat16) for k, v in source.tensors.items()}
    if not indexer:
        rel = {k: v for k, v in rel.items() if ".self_attn.index_" not in k}
    quant = {"group_size": group, "bits": bits, "mode": "affine", **overrides}
    for name in rel:
        if name.endswith("block_sparse_moe.gate.weight"):
            module = name.removeprefix("language_model.").removesuffix(".weight")
            quant.setdefault(module, {"group_size": 64, "bits": 8})
    out, twin, experts = {}, {}, {}
    for name, w in rel.items():
        mlx = name.removeprefix("language_model.")
        module = mlx.removesuffix(".weight")
        rule = quant.get(module, {"bits": bits, "group_size": group})
        if (e := _EXPERT.fullmatch(mlx)) is not None:  # switch_mlp.*: one rule for the stacked experts
            kind = {"w1": "gate", "w2": "down", "w3": "up"}[e.group(3)]
            module = f"{e.group(1)}.block_sparse_moe.switch_mlp.{kind}_proj"
            rule = quant.get(module, {"bits": bits, "group_size": group})
        quantised = bits > 0 and (_linear(name) or "embed_tokens" in name) and rule is not False
        if not quantised or w.shape[-1] % rule["group_size"]:
            twin[name] = w.float()
            if e is None:
                out[mlx] = w
            else:
                experts.setdefault(module, {})[int(e.group(2))] = (w,)
            continue
        packed, scales, biases = affine_quantize(w, rule["bits"], rule["group_size"])
        twin[name] = affine_dequant(packed, scales, biases, rule["bits"])
        if e is None:
            out[mlx], out[module + ".scales"], out[module + ".biases"] = packed, scales, biases
        else:
            experts.setdefault(module, {})[int(e.group(2))] = (packed, scales, biases)
    for module, by_expert in experts.items():
        stacked = [
            torch.stack([by_expert[i][k] for i in sorted(by_expert)]) for k in range(len(by_expert[0]))
        ]
        out[module + ".weight"] = stacked[0]
        if len(stacked) == 3:
            out[module + ".scales"], out[module + ".biases"] = stacked[1], stacked[2]
    text = copy.deepcopy(source.config.get("text_config", source.config))
    config = text | {"model_type": "minimax_m3"}
    if bits:  # bits 0: mlx-lm's layout unquantised, with no quantization block
        config |= {"quantization": quant, "quantization_config": quant}
    twin_config = None
    if not indexer:  # the twin has no MSA layer either
        twin_config = copy.deepcopy(source.config)
        twin_text = twin_config.get("text_config", twin_config)
        twin_text["sparse_attention_config"]["use_sparse_attention"] = False
    return _write_pair(root, out, config, twin, source, twin_config=twin_config)


def modelopt_nvfp4_export(root: Path, in_config_json: bool, source: Source | None = None) -> Export:
    """Routed and shared experts NVFP4; attention, dense MLP, router and lm_head excluded (bf16)."""
    exclude = ["lm_head", "*self_attn*", "*.mlp.*", "*block_sparse_moe.gate"]
    out, twin = {}, {}
    source = source or random_source()
    for name, w in source.tensors.items():
        module = name.removesuffix(".weight")
        if _linear(name) and not any(_glob(module, p) for p in exclude):
            packed, scale, global_scale, input_scale = nvfp4_quantize(w)
            out[name], out[module + ".weight_scale"] = packed, scale
            out[module + ".weight_scale_2"], out[module + ".input_scale"] = global_scale, input_scale
            twin[name] = nvfp4_dequant(packed, scale, global_scale)
        else:
            out[name] = w.to(torch.bfloat16)
            twin[name] = out[name].float()
    config = copy.deepcopy(source.config)
    body = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16}
    if in_config_json:
        config["quantization_config"] = {"quant_method": "modelopt", **body, "ignore": exclude}
        return _write_pair(root, out, config, twin, source)
    hf = {"producer": {"name": "modelopt"}, "quantization": {**body, "exclude_modules": exclude}}
    return _write_pair(root, out, config, twin, source, {"hf_quant_config.json": hf})


def _glob(name: str, pattern: str) -> bool:
    return any(fnmatch.fnmatchcase(n, pattern) for n in (name, name.removeprefix("language_model.")))


def ct_mxfp4_export(root: Path, source: Source | None = None) -> Export:
    """Routed experts MXFP4 (`weight_packed`, U8 E8M0 `weight_scale`); shared expert, attention and
    dense MLP MXFP8 (`weight` e4m3, `weight_scale` typed F8_E8M0); router and lm_head ignored."""
    out, twin = {}, {}
    source = source or random_source()
    for name, w in source.tensors.items():
        module = name.removesuffix(".weight")
        if _EXPERT.fullmatch(name):
            packed, scale = mxfp4_quantize(w)
            out[module + ".weight_packed"], out[module + ".weight_scale"] = packed, scale
            twin[name] = mxfp4_dequant(packed, scale)
        elif _linear(name) and not name.endswith("gate.weight") and "lm_head" not in name:
            q, scale = mxfp8_quantize(w)
            out[name], out[module + ".weight_scale"] = q, scale.view(torch.float8_e8m0fnu)
            twin[name] = mxfp8_dequant(q, scale)
        else:
            out[name] = w.to(torch.bfloat16)
            twin[name] = out[name].float()
    weights = {"type": "float", "strategy": "group", "group_size": 32, "symmetric": True, "dynamic": False}
    config = copy.deepcopy(source.config)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "config_groups": {
            "group_0": {"targets": [r"re:.*experts\.\d+\.w[123]$"], "format": "mxfp4-pack-quantized",
                        "weights": {"num_bits": 4, **weights}},
            "group_1": {"targets": ["Linear"], "format": "mxfp8-quantized", "weights": {"num_bits": 8, **weights}},
        },
        "ignore": ["lm_head", r"re:.*block_sparse_moe\.gate$"],
    }  # fmt: skip
    return _write_pair(root, out, config, twin, source)


FLASH_MXFP8 = ("q_proj", "k_proj", "v_proj", "o_proj", "index_q_proj", "index_k_proj")


def flash_export(root: Path, source: Source | None = None) -> Export:
    """The M3.1-Flash mix: NVFP4 routed experts, MXFP8 attention and indexer projections, bf16
    elsewhere, as Model Optimizer MIXED_PRECISION with its `quantized_layers` (by default on a
    model with MSA on every layer, as the release)."""
    out, twin, layers = {}, {}, {}
    source = source or random_source(FLASH_SPEC)
    for name, w in source.tensors.items():
        module = name.removesuffix(".weight")
        if _EXPERT.fullmatch(name):
            packed, scale, global_scale, input_scale = nvfp4_quantize(w)
            out[name], out[module + ".weight_scale"] = packed, scale
            out[module + ".weight_scale_2"], out[module + ".input_scale"] = global_scale, input_scale
            twin[name] = nvfp4_dequant(packed, scale, global_scale)
            layers[module] = {"quant_algo": "NVFP4", "group_size": 16}
        elif module.rsplit(".", 1)[-1] in FLASH_MXFP8:
            q, scale = mxfp8_quantize(w)
            out[name], out[module + ".weight_scale"] = q, scale
            twin[name] = mxfp8_dequant(q, scale)
            layers[module] = {"quant_algo": "MXFP8"}
        else:
            out[name] = w.to(torch.bfloat16)
            twin[name] = out[name].float()
    config = copy.deepcopy(source.config)
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "quantized_layers": layers,
        "ignore": ["lm_head"],
    }
    return _write_pair(root, out, config, twin, source)
