"""How a checkpoint says its weights are quantised, read from its own files with no flag.

config.json names the scheme: MLX's `quantization` block (affine bits and group size, with
per-module overrides), or `quantization_config` with `quant_method` "mxfp8" (the release),
"modelopt" (NVIDIA Model Optimizer: NVFP4, MXFP8 or MIXED_PRECISION per module, with an
exclusion list; `hf_quant_config.json` where config.json has no block) or "compressed-tensors"
(config groups in MXFP4 or MXFP8, with an ignore list). `QuantScheme.rule(module)` says which
encodings a module's weight may be stored in; `stored` tells from the tensor headers which one
it is, and `check` that the two agree and every scale has its shape. Pure Python: no torch.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m3lm.errors import CheckpointError, ConfigError
from m3lm.model_dir import json_object

PLAIN, MXFP8, NVFP4, MXFP4, AFFINE = "plain", "MXFP8", "NVFP4", "MXFP4", "MLX affine"
AFFINE_BITS = (2, 3, 4, 5, 6, 8)  # what MLX packs
AFFINE_GROUPS = (32, 64, 128)
FLOATS = ("BF16", "F16", "F32")
E8M0 = ("U8", "F8_E8M0")  # E8M0 exponents: raw bytes, or safetensors' own dtype
MODELOPT_ALGOS = {"NVFP4": NVFP4, "W4A16_NVFP4": NVFP4, "MXFP8": MXFP8}
QUANT_METHODS = ("mxfp8", "modelopt", "compressed-tensors")  # quantization_config's families
CT_FORMATS = ("mxfp4-pack-quantized", "mxfp8-quantized", "float-quantized", "mixed-precision")
KV_SCALES = (
    ".k_scale",
    ".v_scale",
)  # Model Optimizer's KV-cache calibration; m3lm's cache stays in the compute dtype
BLOCK = {MXFP8: 32, NVFP4: 16, MXFP4: 32}  # inputs per scale


@dataclass(frozen=True)
class Rule:
    """What the config says of one module: the encodings its weight may have (affine: bits, group)."""

    kinds: frozenset[str]
    source: str
    bits: int = 0
    group: int = 0


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's scheme: ordered (matcher, pattern, rule) overrides over a default rule."""

    name: str
    default: Rule
    overrides: tuple[tuple[str, str, Rule], ...] = ()

    def rule(self, module: str) -> Rule:
        names = (module, canonical(module))
        for how, pattern, rule in self.overrides:
            if any(_matches(how, pattern, n) for n in names):
                return rule
        return self.default

    def ignored(self, name: str) -> bool:
        return self.name == "modelopt" and name.endswith(KV_SCALES)


@dataclass(frozen=True)
class Stored:
    """One weight as the headers show it: its encoding, the tensor holding its values, the name the
    remap sees, and its scale tensors by role (scale, biases, global, input_scale)."""

    kind: str
    value: str
    target: str
    module: str
    parts: dict[str, str] = field(default_factory=dict)


NONE = QuantScheme("none", Rule(frozenset({PLAIN, MXFP8}), "no quantization config"))


def canonical(module: str) -> str:
    """A module's name without a VL wrapper: `language_model.model.X` and `model.language_model.X`
    are `model.X`, `language_model.lm_head` is `lm_head` (configs spell them either way)."""
    for old, new in (
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.", ""),
    ):
        if module.startswith(old):
            return new + module[len(old) :]
    return module


def _matches(how: str, pattern: str, name: str) -> bool:
    if how == "exact":
        return name == pattern
    if how == "under":  # the module or one inside it (a layer listed for its experts)
        return name == pattern or name.startswith(pattern + ".")
    if how == "glob":
        return fnmatch.fnmatchcase(name, pattern)
    if how == "target":  # compressed-tensors: "re:<regex>", a layer class (every Linear), or a name
        if pattern.startswith("re:"):
            return re.match(pattern[3:], name) is not None
        return (pattern[:1].isupper() and "." not in pattern) or name == pattern
    raise AssertionError(how)


def read_scheme(path: Path) -> QuantScheme:
    """The scheme of the checkpoint folder `path` (config.json, else hf_quant_config.json)."""
    config = _json(path / "config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if config.get("quantization") is not None:
        return mlx_scheme(config["quantization"])
    qc = config.get("quantization_config") or text.get("quantization_config")
    if qc is None:
        hf = path / "hf_quant_config.json"
        return modelopt_scheme(_json(hf), hf.name) if hf.is_file() else NONE
    if not isinstance(qc, dict):
        raise ConfigError(f"config.json: 'quantization_config' = {qc!r} must be an object")
    method = qc.get("quant_method")
    if method == "mxfp8":
        return QuantScheme("mxfp8", Rule(frozenset({PLAIN, MXFP8}), "quant_method mxfp8"))
    if method == "modelopt":
        return modelopt_scheme(qc, "config.json quantization_config")
    if method == "compressed-tensors":
        return compressed_tensors_scheme(qc)
    raise ConfigError(
        f"config.json: quantization scheme {method!r} is not supported "
        "(m3lm reads mxfp8, modelopt, compressed-tensors and MLX's 'quantization' block)"
    )


def quant_family(config: dict[str, Any], text: dict[str, Any]) -> str | None:
    """The scheme's family: "mlx" for MLX's `quantization` block, else `quantization_config`'s
    `quant_method` (`text`: the text model's part of config.json, which may hold it); `read_scheme`
    reads the scheme's details when weights load."""
    if config.get("quantization") is not None:
        return "mlx"
    qc = config.get("quantization_config") or text.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(
            f"config.json: 'quantization_config' = {qc!r} must be an object such as "
            '{"quant_method": "mxfp8", "weight_block_size": [1, 32]}'
        )
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise ConfigError(
            f"config.json: 'quantization_config.quant_method' = {method!r} is not supported "
            f"(expected one of {list(QUANT_METHODS)}, or MLX's 'quantization' block)"
        )
    block = qc.get("weight_block_size", [1, 32])
    if method == "mxfp8" and block != [1, 32]:
        raise ConfigError(
            f"config.json: 'quantization_config.weight_block_size' = {block!r} is not supported (expected [1, 32])"
        )
    return method


def _json(f: Path) -> dict[str, Any]:
    return json_object(f, ConfigError)


def _names(value: Any, where: str) -> list[str]:
    """A config's list of module names or patterns (absent: none)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise ConfigError(f"{where}: expected a list of module names or patterns, found {value!r}")
    return value


def _affine_rule(q: dict, where: str, default: Rule | None = None) -> Rule:
    mode = q.get("mode", "affine")
    if mode != "affine":
        raise ConfigError(f"config.json: {where} mode {mode!r} is not supported (m3lm reads MLX's 'affine')")
    bits = q.get("bits", default.bits if default else None)
    group = q.get("group_size", default.group if default else None)
    if bits not in AFFINE_BITS or group not in AFFINE_GROUPS:
        raise ConfigError(
            f"config.json: {where} bits = {bits!r}, group_size = {group!r} is not supported "
            f"(bits one of {list(AFFINE_BITS)}, group_size one of {list(AFFINE_GROUPS)})"
        )
    return Rule(frozenset({PLAIN, AFFINE}), f"{where} ({bits}-bit, groups of {group})", bits, group)


def mlx_scheme(q: Any) -> QuantScheme:
    """MLX: {"bits", "group_size", "mode", "<module path>": {...} | false} (mlx-lm's module paths)."""
    if not isinstance(q, dict):
        raise ConfigError(f"config.json: 'quantization' = {q!r} must be an object")
    default = _affine_rule(q, "'quantization'")
    overrides = []
    for key, value in q.items():
        if key in ("bits", "group_size", "mode"):
            continue
        if value is False:
            overrides.append(
                ("exact", canonical(key), Rule(frozenset({PLAIN}), f"'quantization.{key}' = false"))
            )
        elif isinstance(value, dict):
            overrides.append(("exact", canonical(key), _affine_rule(value, f"'quantization.{key}'", default)))
        elif value is not True:
            raise ConfigError(f"config.json: 'quantization.{key}' = {value!r} must be an object or a boolean")
    return QuantScheme("mlx", default, tuple(overrides))


def modelopt_scheme(q: dict, where: str) -> QuantScheme:
    """Model Optimizer: {"quantization": {"quant_algo", "exclude_modules", ...}} (hf_quant_config.json)
    or config.json's flat {"quant_method": "modelopt", "quant_algo", "ignore", ...}."""
    nested = isinstance(q.get("quantization"), dict)
    body = q["quantization"] if nested else q
    algo = str(body.get("quant_algo") or "").upper()
    excluded = _names(body.get("exclude_modules" if nested else "ignore", body.get("exclude_modules")), where)
    group = body.get("group_size")
    if group not in (None, 16) and algo != "MXFP8":
        raise ConfigError(f"{where}: NVFP4 group_size = {group!r} is not supported (NVFP4 scales 16 inputs)")
    rules = [("glob", p, Rule(frozenset({PLAIN}), f"{where} excludes {p!r}")) for p in excluded]
    if algo == "MIXED_PRECISION":
        layers = body.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise ConfigError(f"{where}: MIXED_PRECISION needs a 'quantized_layers' object of modules")
        for module, info in layers.items():
            sub = str(info.get("quant_algo", "") if isinstance(info, dict) else "").upper()
            if sub not in MODELOPT_ALGOS:
                raise ConfigError(
                    f"{where}: quantized_layers[{module!r}] quant_algo {sub!r} is not supported "
                    f"(m3lm reads {', '.join(MODELOPT_ALGOS)})"
                )
            rule = Rule(frozenset({PLAIN, MODELOPT_ALGOS[sub]}), f"{where} lists {module!r} as {sub}")
            rules.append(("under", canonical(module), rule))
        return QuantScheme("modelopt", Rule(frozenset({PLAIN}), f"{where} lists no algorithm"), tuple(rules))
    if algo not in MODELOPT_ALGOS:
        raise ConfigError(
            f"{where}: Model Optimizer quant_algo {algo or None!r} is not supported "
            f"(m3lm reads {', '.join(MODELOPT_ALGOS)} and MIXED_PRECISION)"
        )
    kind = MODELOPT_ALGOS[algo]
    return QuantScheme("modelopt", Rule(frozenset({PLAIN, kind}), f"{where} quant_algo {algo}"), tuple(rules))


def _ct_kind(name: str, group: Any, top_format: Any) -> Rule:
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise ConfigError(f"compressed-tensors config group {name!r} must be an object with 'weights'")
    w = group["weights"]
    fmt = group.get("format") or top_format
    spec = (w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("group_size"))
    kind = {(4, "float", "group", 32): MXFP4, (8, "float", "group", 32): MXFP8}.get(spec)
    if kind is None or (fmt is not None and fmt not in CT_FORMATS):
        raise ConfigError(
            f"compressed-tensors config group {name!r} ({spec[1]} {spec[0]}-bit, strategy {spec[2]}, "
            f"group_size {spec[3]}, format {fmt!r}) is not supported (m3lm reads MXFP4: float 4-bit "
            "in groups of 32, and MXFP8: float 8-bit in groups of 32)"
        )
    return Rule(frozenset({PLAIN, kind}), f"compressed-tensors group {name!r} ({kind})")


def compressed_tensors_scheme(q: dict) -> QuantScheme:
    """compressed-tensors: {"config_groups": {name: {"targets", "weights", "format"}}, "ignore", "format"}."""
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError("config.json: compressed-tensors 'config_groups' must be a non-empty object")
    ignore = _names(q.get("ignore"), "compressed-tensors 'ignore'")
    rules = [("target", p, Rule(frozenset({PLAIN}), f"compressed-tensors ignores {p!r}")) for p in ignore]
    for name, group in groups.items():
        rule = _ct_kind(name, group, q.get("format"))
        rules += [("target", t, rule) for t in _names(group.get("targets"), f"group {name!r} 'targets'")]
    return QuantScheme(
        "compressed-tensors", Rule(frozenset({PLAIN}), "no config group targets it"), tuple(rules)
    )


Headers = dict[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, safetensors dtype)
# What each scale tensor of a packed weight must be, by role: (shape, allowed dtypes).
PartsWanted = dict[str, tuple[tuple[int, ...], tuple[str, ...]]]


def stored(name: str, headers: Headers) -> Stored | None:
    """The encoding of weight tensor `name` from its siblings' names and dtypes; None for a tensor
    that is not a weight's values (a sibling itself, or a plain non-weight tensor)."""
    if name.endswith(".weight_packed"):  # compressed-tensors' packed 4-bit values
        module = name[: -len(".weight_packed")]
        if module + ".weight_global_scale" in headers:
            raise CheckpointError(f"{name}: compressed-tensors NVFP4 (weight_global_scale) is not supported")
        return Stored(MXFP4, name, module + ".weight", module, {"scale": module + ".weight_scale"})
    if not name.endswith(".weight"):
        return None
    module = name[: -len(".weight")]
    has = {s: module + s for s in (".scales", ".biases", ".weight_scale", ".weight_scale_2", ".input_scale")}
    if has[".scales"] in headers:
        return Stored(AFFINE, name, name, module, {"scale": has[".scales"], "biases": has[".biases"]})
    if has[".weight_scale_2"] in headers:
        parts = {"scale": has[".weight_scale"], "global": has[".weight_scale_2"]}
        if has[".input_scale"] in headers:
            parts["input_scale"] = has[".input_scale"]
        return Stored(NVFP4, name, name, module, parts)
    if name + "_scale_inv" in headers:
        return Stored(MXFP8, name, name, module, {"scale": name + "_scale_inv"})
    if has[".weight_scale"] in headers:
        if headers[name][1] != "F8_E4M3":
            raise CheckpointError(
                f"{name}: has {has['.weight_scale']} but is neither MXFP8 (F8_E4M3 values) nor NVFP4 "
                f"(no {has['.weight_scale_2']}); found {headers[name][1]}"
            )
        return Stored(MXFP8, name, name, module, {"scale": has[".weight_scale"]})
    return Stored(PLAIN, name, name, module)


def check(s: Stored, headers: Headers, rule: Rule) -> tuple[tuple[int, ...], str | None]:
    """(the weight's unpacked shape, an error naming the tensor or None)."""
    shape = headers[s.value][0]
    if s.kind not in rule.kinds:
        allowed = " or ".join(sorted(rule.kinds))
        return shape, f"{s.value}: stored as {s.kind}, but {rule.source} makes it {allowed}"
    if s.kind == PLAIN:
        return shape, None
    missing = [p for p in s.parts.values() if p not in headers]
    if missing:
        return shape, f"{s.value}: {s.kind} weight without its {', '.join(missing)}"
    if s.kind == MXFP8:
        return shape, _mxfp8_error(s, headers)
    if s.kind == AFFINE:
        full, want, error = _affine_layout(s, headers, rule)
    else:
        full, want, error = _fp4_layout(s, headers)
    return full, error or _parts_error(s, headers, full, want)


def _mxfp8_error(s: Stored, headers: Headers) -> str | None:
    """What is wrong with an MXFP8 weight's e4m3 values or their E8M0 scales, if anything."""
    shape, dtype = headers[s.value]
    lead, cols = shape[:-1], shape[-1] if shape else 0
    sc_shape, sc_dtype = headers[s.parts["scale"]]
    want_sc = (*lead, cols // BLOCK[MXFP8])
    if dtype != "F8_E4M3" or sc_dtype not in E8M0 or tuple(sc_shape) != want_sc or cols % BLOCK[MXFP8]:
        return (
            f"{s.value}: MXFP8 weight must be F8_E4M3 {list(shape)} with U8 scales {list(want_sc)}, "
            f"found {dtype} with {sc_dtype} {list(sc_shape)}"
        )
    return None


def _affine_layout(
    s: Stored, headers: Headers, rule: Rule
) -> tuple[tuple[int, ...], PartsWanted, str | None]:
    """An MLX affine weight's unpacked shape (its width from the scales), what its scales and
    biases must be, and what is wrong with its packed words, if anything."""
    shape, dtype = headers[s.value]
    lead, cols = shape[:-1], shape[-1] if shape else 0
    sc_shape, _ = headers[s.parts["scale"]]
    width = sc_shape[-1] * rule.group if sc_shape else 0
    want = {
        "scale": ((*lead, width // rule.group), FLOATS),
        "biases": ((*lead, width // rule.group), FLOATS),
    }
    full = (*lead, width)
    if dtype != "U32" or cols * 32 != width * rule.bits:
        return (
            full,
            want,
            (
                f"{s.value}: {rule.source} needs U32 words [..., {width * rule.bits // 32}] for "
                f"{width} inputs, found {dtype} {list(shape)}"
            ),
        )
    return full, want, None


def _fp4_layout(s: Stored, headers: Headers) -> tuple[tuple[int, ...], PartsWanted, str | None]:
    """An NVFP4 or MXFP4 weight's unpacked shape (two values a byte), what its scales must be,
    and what is wrong with its packed bytes, if anything."""
    shape, dtype = headers[s.value]
    lead, cols = shape[:-1], shape[-1] if shape else 0
    width = cols * 2  # two E2M1 values a byte
    full = (*lead, width)
    blocks = (*lead, width // BLOCK[s.kind])
    scale_dtype = ("F8_E4M3",) if s.kind == NVFP4 else E8M0
    want = {"scale": (blocks, scale_dtype), "global": ((), ("F32",)), "input_scale": ((), ("F32",))}
    if dtype != "U8":
        return full, want, f"{s.value}: {s.kind} values must be U8 (two E2M1 a byte), found {dtype}"
    if width % BLOCK[s.kind]:
        return full, want, f"{s.value}: {width} inputs are not whole {s.kind} blocks of {BLOCK[s.kind]}"
    return full, want, None


def _parts_error(s: Stored, headers: Headers, full: tuple[int, ...], want: PartsWanted) -> str | None:
    """The first scale tensor of a packed weight whose shape or dtype is not what its role needs
    (a global or input scale is one value), named with what it should be."""
    for role, part in s.parts.items():
        (p_shape, p_dtype), (w_shape, w_dtypes) = headers[part], want[role]
        scalar = role in ("global", "input_scale")
        if (math.prod(p_shape) != 1 if scalar else tuple(p_shape) != w_shape) or p_dtype not in w_dtypes:
            return (
                f"{part}: the {role} of {s.kind} weight {s.value} {list(full)} must be "
                f"{'/'.join(w_dtypes)} {'one value' if scalar else list(w_shape)}, found {p_dtype} {list(p_shape)}"
            )
    return None
