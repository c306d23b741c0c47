"""Stream a safetensors checkpoint into a MiniMax-M3 model, strictly.

Plan first, from the file headers alone: every tensor is remapped (`remap_key`), its shape and
dtype checked, and coverage verified (every parameter, and every expert slot, written exactly
once; no language-model tensor left unclaimed). Only then are bytes read, one tensor slice at a
time from memory-mapped files, so the peak host memory is about the size of the weights and a
bad checkpoint fails before anything is loaded. Under tensor parallelism the plan is made against
the full model and each rank reads only its slice of every tensor (`m3lm.distributed.shard`); an
8-bit shard takes its e4m3 slice and the matching E8M0 scale slice as stored.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from m3lm.checkpoint_quant import (
    MXFP4,
    MXFP8,
    NONE,
    NVFP4,
    PLAIN,
    Headers,
    QuantScheme,
    Stored,
    check,
    read_scheme,
    stored,
)
from m3lm.config import ModelArgs
from m3lm.device import resolve_device
from m3lm.distributed.parallel import SINGLE, ParallelConfig
from m3lm.distributed.shard import localize, mxfp8_split_errors, param_shard
from m3lm.errors import CheckpointError
from m3lm.kernels.fp8 import quantize_mxfp8
from m3lm.layers.linear import weight_bytes
from m3lm.layers.quantized import Kept, keep_as_stored_
from m3lm.model_dir import check_dir, check_inside, inside, json_object
from m3lm.models.minimax_m3 import MiniMaxM3, Piece, release_name, remap_key
from m3lm.weight_copy import check_finite, decode_packed, write_piece, write_q4_piece, write_slice

log = logging.getLogger("m3lm")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}  # fmt: skip
QUANT_MODES = ("auto", "keep", "mxfp8", "none")
SCALE_DTYPES = {"U8": torch.uint8, "F8_E8M0": torch.uint8, "F8_E4M3": torch.float8_e4m3fn,
                "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}  # fmt: skip
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights from config.json alone
FP32_PARAMS = ("block_sparse_moe.gate.weight", "block_sparse_moe.e_score_correction_bias")
# safetensors dtypes a plain weight may have; integers would be cast to floats and load as garbage.
FLOAT_DTYPES = ("F16", "BF16", "F32")


@dataclass(frozen=True)
class Packed:
    """A 4-bit or MLX affine weight's encoding and its scale tensors (role, name, file)."""

    kind: str
    bits: int
    parts: tuple[tuple[str, str, Path], ...]
    shape: tuple[int, ...]  # unpacked: what the shard plan cuts
    group: int = 0  # inputs per scale
    scale_dtype: str = ""  # the scale tensor's safetensors dtype

    def kept(self) -> Kept | None:
        """How the weight can stay in memory as stored (`kernels.q4`), or None: dequantised."""
        fmt = {NVFP4: "nvfp4", MXFP4: "mxfp4"}.get(self.kind, "affine4" if self.bits == 4 else None)
        if fmt is None or self.scale_dtype not in SCALE_DTYPES:
            return None
        return Kept(fmt, self.group, SCALE_DTYPES[self.scale_dtype])


@dataclass(frozen=True)
class Source:
    file: Path
    name: str
    scale: str | None  # the E8M0 scales of an MXFP8 tensor (`*_scale_inv` or `*.weight_scale`)
    scale_file: Path | None  # may be another shard
    pieces: tuple[Piece, ...]
    packed: Packed | None = None  # dequantised at load


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """A torch dtype or its name; default bf16 on a GPU, fp32 on the CPU."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"unsupported dtype {dtype!r} (expected one of {sorted(DTYPES)})")


def resolve_quant(
    quant: str | None, args: ModelArgs, device: torch.device, scheme: QuantScheme = NONE
) -> str | None:
    """ "auto": on a GPU keep an MXFP8 checkpoint in 8 bits, and another quantised one as it is
    stored ("keep"); dequantise on the CPU. "keep": every weight as stored, on any device (MXFP8
    and 4-bit ones; other encodings dequantised); "mxfp8": keep (or quantise at load) whatever the
    checkpoint; "none": dequantise. Returns the model's quant."""
    quant = quant or "auto"
    if quant not in QUANT_MODES:
        raise ValueError(f"quant = {quant!r} is not supported (expected one of {list(QUANT_MODES)})")
    if quant == "auto":
        if device.type != "cuda":
            return None
        return "mxfp8" if args.quant_method == "mxfp8" else "keep" if scheme is not NONE else None
    return None if quant == "none" else quant


def scale_params(params: dict) -> set[str]:
    """The E8M0 scale parameters of 8-bit weights (`<weight>_scale`), written with their weight."""
    return {n + "_scale" for n in params if n + "_scale" in params}


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shard index if there is one, else model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(
                f"{index}: not a valid safetensors index ({type(e).__name__}: {e})"
            ) from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        # An index is data from the checkpoint: it may not make us read files elsewhere.
        outside = [str(f) for f in files if not inside(path, f)]
        if outside:
            raise CheckpointError(f"{index} names shard(s) outside the model folder: {', '.join(outside)}")
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        check_inside(path, single)
        return [single]
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """name -> (file, shape, dtype) for every tensor, from the headers only."""
    out: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    sl = st.get_slice(name)
                    out[name] = (f, tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # safetensors raises several types for truncated or corrupt files
            raise CheckpointError(f"{f}: cannot read safetensors header ({e})") from None
    return out


def plan(files: list[Path], args: ModelArgs, model: MiniMaxM3, scheme: QuantScheme = NONE) -> list[Source]:
    """Map every checkpoint tensor to parameter pieces; raise on any gap, overlap or mismatch.
    Each weight's encoding comes from its tensors and must be one `scheme` allows its module."""
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for n in scale_params(params):
        del params[n]
    tensors = _headers(files)
    headers = {n: (shape, dtype) for n, (_, shape, dtype) in tensors.items()}
    weights, errors = _stored_weights(headers)
    consumed = {p for s in weights.values() for p in s.parts.values()}
    sources, unclaimed = [], []
    written: dict[tuple[str, int | None], int] = defaultdict(int)
    for name, (file, _, dtype) in tensors.items():
        if name in consumed or scheme.ignored(name):
            continue  # read with its weight
        st = weights.get(name) or Stored(PLAIN, name, name, name)
        rule = scheme.rule(st.module)
        full, error = check(st, headers, rule)
        if error:
            errors.append(error)
            continue
        r = remap_key(st.target, full, args, params)
        if r is None:
            continue
        if r.shape is None or any(p.param not in params for p in r.pieces):
            unclaimed.append(name)
            continue
        if error := _mismatch(name, st.kind, dtype, full, r.shape):
            errors.append(error)
            continue
        for p in r.pieces:
            written[(p.param, p.slot)] += 1
        sources.append(_source(file, name, st, rule.bits, full, r.pieces, tensors))
    errors += _coverage_errors(params, tensors, written, unclaimed)
    if errors:
        raise CheckpointError("; ".join(errors))
    return sources


def _stored_weights(headers: Headers) -> tuple[dict[str, Stored], list[str]]:
    """Each weight tensor's encoding (`stored`) by its name, and the errors of the weights whose
    sibling tensors make an encoding m3lm cannot read."""
    weights, errors = {}, []
    for name in headers:
        try:
            if (s := stored(name, headers)) is not None:
                weights[name] = s
        except CheckpointError as e:
            errors.append(str(e))
    return weights, errors


def _mismatch(name: str, kind: str, dtype: str, full: tuple[int, ...], expected: tuple[int, ...]) -> str:
    """What is wrong with a claimed tensor's shape or stored dtype ("" when nothing is)."""
    if full != expected:
        return f"{name}: expected shape {list(expected)}, found {list(full)}"
    if kind == PLAIN and dtype == "F8_E4M3":
        return f"{name}: float8 tensor without its _scale_inv scales"
    if kind == PLAIN and dtype not in FLOAT_DTYPES:
        return (
            f"{name}: dtype {dtype} is not supported (expected one of {', '.join(FLOAT_DTYPES)}, "
            f"or F8_E4M3 with U8 _scale_inv scales)"
        )
    return ""


def _source(
    file: Path,
    name: str,
    st: Stored,
    bits: int,
    full: tuple[int, ...],
    pieces: tuple[Piece, ...],
    tensors: dict,
) -> Source:
    """Where a checked tensor's bytes are and how they are encoded: with its MXFP8 scales, or the
    parts of a packed (4-bit or MLX) weight."""
    scale = st.parts["scale"] if st.kind == MXFP8 else None
    packed = None
    if st.kind not in (PLAIN, MXFP8):
        _, s_shape, s_dtype = tensors[st.parts["scale"]]
        packed = Packed(
            st.kind, bits, tuple((k, v, tensors[v][0]) for k, v in st.parts.items()), full,
            full[-1] // s_shape[-1], s_dtype,
        )  # fmt: skip
    return Source(file, name, scale, tensors[scale][0] if scale else None, pieces, packed)


def _coverage_errors(
    params: dict[str, tuple[int, ...]], tensors: dict, written: dict, unclaimed: list[str]
) -> list[str]:
    """The plan's gaps and overlaps: tensors no parameter claims, parameter slots no tensor
    writes (and whether the checkpoint is too small to hold them), slots written twice."""
    errors = []
    if unclaimed:
        errors.append(
            f"unexpected language-model tensor(s) that no parameter claims: {', '.join(sorted(unclaimed))}"
        )
    missing = _missing(params, written)
    twice = [release_name(n, s) for (n, s), c in written.items() if c > 1]
    if missing:
        errors.append(f"missing tensor(s): {missing}")
        want, have = (
            sum(math.prod(s) for s in params.values()),
            sum(math.prod(t[1]) for t in tensors.values()),
        )
        if want > have:
            errors.append(
                f"config.json describes {want:,} parameters but the checkpoint's tensors hold only {have:,} values"
            )
    if twice:
        errors.append(
            f"tensor(s) given more than once (e.g. packed and separate shared expert): {', '.join(twice)}"
        )
    return errors


def kept_weights(sources: list[Source]) -> dict[str, Kept]:
    """The parameters every piece of which is stored MXFP8 or in a 4-bit format m3lm multiplies
    as stored (`kernels.q4`), and how: what `quant="keep"` holds so."""
    hows: dict[str, set[Kept | None]] = defaultdict(set)
    for src in sources:
        how = src.packed.kept() if src.packed else Kept("mxfp8") if src.scale else None
        for p in src.pieces:
            hows[p.param].add(how)
    return {param: next(iter(h)) for param, h in hows.items() if len(h) == 1 and None not in h}


def model_args(path: Path, files: list[Path], scheme: QuantScheme) -> ModelArgs:
    """config.json's `ModelArgs`, as the checkpoint's tensors make them (`dense_without_indexer`)."""
    args = ModelArgs.from_file(path / "config.json")
    return dense_without_indexer(args, _headers(files), scheme) if files else args


def dense_without_indexer(args: ModelArgs, tensors: dict, scheme: QuantScheme = NONE) -> ModelArgs:
    """mlx-lm's MiniMax-M3 leaves the MSA indexer out of its exports (quantised, or in its own
    `switch_mlp` names) and attends densely on every layer; such an export runs so here too:
    exact up to `dense_window` tokens, dense beyond."""
    mlx = scheme.name == "mlx" or any(".switch_mlp." in n for n in tensors)
    if (
        not mlx
        or not any(args.sparse_layers)
        or any("index_q_proj" in n or ".indexer." in n for n in tensors)
    ):
        return args
    log.warning(
        "this MLX export has no MSA indexer weights (mlx-lm drops them): every layer attends densely, "
        "which equals MSA up to %d tokens",
        args.dense_window,
    )
    return replace(args, sparse_layers=(False,) * args.num_hidden_layers)


def _missing(params: dict[str, tuple[int, ...]], written: dict, limit: int = 20) -> str:
    """The first `limit` unwritten parameter slots by name, and how many more. Slots are walked
    lazily: a config can promise far more expert slots than fit in memory as a list."""
    slots = (
        (n, s)
        for n, shape in params.items()
        for s in ([None] if not n.endswith(("w1", "w2", "w3")) else range(shape[0]))
    )
    names = [
        release_name(n, s) for n, s in islice(((n, s) for n, s in slots if not written.get((n, s))), limit)
    ]
    total = sum(shape[0] if n.endswith(("w1", "w2", "w3")) else 1 for n, shape in params.items())
    covered = sum(1 for (n, s), c in written.items() if c and (s is None or s < params[n][0]))
    more = total - covered - len(names)
    return ", ".join(names) + (f" (and {more:,} more)" if more > 0 else "")


def _read_scale(st, src: Source):
    """The scales of an MXFP8 tensor, from its own shard or (rarely) another one."""
    return _sibling(st, src.file, src.scale, src.scale_file)


def _sibling(st, file: Path, name: str, where: Path, whole: bool = False):
    """Tensor `name` (a slice object in `file`'s open shard unless `whole`, else read from `where`)."""
    if where == file:
        return st.get_tensor(name) if whole else st.get_slice(name)
    with safe_open(where, framework="pt") as other:
        return other.get_tensor(name)


def _packed_rows(st, src: Source, sl, lead: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rows `lead` of a packed weight as stored: its values and its scale tensors by role (the
    values and scales share every dim but the last; a global factor is one fp32 value)."""
    assert src.packed is not None
    parts = {}
    for role, name, where in src.packed.parts:
        if role in ("scale", "biases"):
            t = _sibling(st, src.file, name, where)
            parts[role] = t[lead] if lead else t[:]
        else:  # one fp32 value
            parts[role] = _sibling(st, src.file, name, where, whole=True)
    return (sl[lead] if lead else sl[:]), parts


def _unpacked(st, src: Source, sl, index: tuple) -> torch.Tensor:
    """Rows `index` of a packed weight, dequantised to fp32; the inputs are cut after."""
    assert src.packed is not None
    ndim = len(src.packed.shape)
    lead = index[:-1] if len(index) == ndim else index
    w = decode_packed(src.packed.kind, *_packed_rows(st, src, sl, lead), src.packed.bits)
    return w[..., index[-1]] if len(index) == ndim else w


def _write_packed(st, src: Source, sl, params: dict, shards) -> None:
    """Every piece of a packed weight this rank owns: kept as stored where its parameter keeps
    4 bits (uint8 codes; checked finite once dequantised), else dequantised."""
    assert src.packed is not None
    for index, param, slot in _pieces(src, src.packed.shape, shards):
        if params[param].dtype != torch.uint8:
            write_piece(params, Piece(param, slot), _unpacked(st, src, sl, index), None, src.name)
            continue
        assert len(index) < len(src.packed.shape), "a kept 4-bit piece has whole rows"
        values, parts = _packed_rows(st, src, sl, index)
        check_finite(decode_packed(src.packed.kind, values, parts, src.packed.bits), src.name)
        write_q4_piece(params, Piece(param, slot), values, parts)


def _pieces(src: Source, shape: tuple[int, ...], shards: dict[str, tuple[slice, ...]] | None):
    """(read index, parameter, slot) of each piece this rank owns (every piece on one process)."""
    if shards is None:
        return ((p.index, p.param, p.slot) for p in src.pieces)
    return _local_pieces(src, shape, shards)


def _local_pieces(src: Source, shape: tuple[int, ...], shards: dict[str, tuple[slice, ...]]):
    """(read index, parameter, slot) of each piece this rank owns."""
    for p in src.pieces:
        where = localize(p.index, p.slot, shape, shards.get(p.param, ()))
        if where is not None:
            yield where[0], p.param, where[1]


def _write_source(st, src: Source, params: dict, shards: dict[str, tuple[slice, ...]] | None) -> None:
    """Copy one planned tensor from its open shard `st` into the parameters: every piece, or with
    `shards` this rank's slices; a packed weight dequantised or kept as stored."""
    sl = st.get_slice(src.name)
    scale = _read_scale(st, src) if src.scale else None
    if src.packed is not None:
        _write_packed(st, src, sl, params, shards)
    elif shards is None:
        for p in src.pieces:
            t = sl[p.index] if p.index else sl[:]
            s = (scale[p.index] if p.index else scale[:]) if scale is not None else None
            write_piece(params, p, t, s, src.name)
    else:  # this rank's slices
        for index, param, slot in _local_pieces(src, tuple(sl.get_shape()), shards):
            write_slice(params, Piece(param, slot), sl, scale, index, src.name)


def stream_weights(
    model: MiniMaxM3,
    sources: list[Source],
    progress: Callable[[int, int], None] | None = None,
    shards: dict[str, tuple[slice, ...]] | None = None,
) -> None:
    """Copy every planned tensor into the (already allocated) parameters, one shard at a time;
    with `shards` (parameter -> this rank's slice), only the owned slices are read."""
    params = dict(model.named_parameters())
    by_file: dict[Path, list[Source]] = defaultdict(list)
    for s in sources:
        by_file[s.file].append(s)
    done = 0
    with torch.no_grad():
        for file, items in by_file.items():
            try:
                with safe_open(file, framework="pt") as st:
                    for src in items:
                        _write_source(st, src, params, shards)
                        done += 1
                        if progress is not None:
                            progress(done, len(sources))
            except CheckpointError:
                raise
            except Exception as e:  # truncated or corrupt data surfaces only when it is read
                raise CheckpointError(f"{file}: cannot read tensor data ({e})") from None


@torch.no_grad()
def random_weights_(model: MiniMaxM3, seed: int = 0) -> MiniMaxM3:
    """Fill every parameter in place with seeded normal noise at a scale that keeps activations
    finite: std 0.1 for vectors (norms, biases), 0.02 for matrices, the router bias 100x smaller.
    8-bit weights are drawn in bf16 and quantised (the release's scheme) a block of rows at a
    time, so the model has the layout of a loaded MXFP8 one. Deterministic on a given device."""
    params = dict(model.named_parameters())
    scales = scale_params(params)
    gen = None
    for name, p in params.items():
        if name in scales:
            continue  # written with its weight
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        std = 0.1 if p.dim() == 1 else 0.02
        if p.dtype == torch.float8_e4m3fn:
            _random_mxfp8_(p, params[name + "_scale"], std, gen)
        else:
            p.normal_(0.0, std, generator=gen)
        if name.endswith("e_score_correction_bias"):
            p.mul_(0.01)
    return model


def _random_mxfp8_(q: torch.Tensor, scale: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """q [..., In] e4m3 and scale [..., In/32] E8M0 = quantised normal(0, std) bf16 noise."""
    q2, s2 = q.view(-1, q.shape[-1]), scale.view(-1, scale.shape[-1])
    step = max(1, (64 << 20) // (q.shape[-1] * 4))  # rows per draw: about 64 MiB of fp32 at a time
    for i in range(0, q2.shape[0], step):
        w = torch.empty(q2[i : i + step].shape, dtype=torch.bfloat16, device=q.device)
        q2[i : i + step], s2[i : i + step] = quantize_mxfp8(w.normal_(0.0, std, generator=gen))


def allocate(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """`model.to_empty(device=device)`: a model made on the meta device given uninitialised
    storage, each tensor by `torch.empty_strided` (`to_empty`'s `empty_like` of a meta tensor
    first imports torch's symbolic-shape machinery and sympy, at every start)."""
    return model._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device))


def load_model(
    path: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    progress: Callable[[int, int], None] | None = None,
    quant: str | None = "auto",
    parallel: ParallelConfig = SINGLE,
    load_format: str = "auto",
) -> MiniMaxM3:
    """Read config.json and the weights of a local checkpoint directory into a MiniMaxM3
    (this rank's shard of it under tensor parallelism).

    `quant` (see `resolve_quant`): by default an MXFP8 checkpoint stays 8-bit on a GPU, on one GPU
    or as each tensor-parallel rank's 8-bit shard (dequantised instead, with a warning, when the
    split would cut a 32-block of inputs; quant="mxfp8" refuses such a split).
    `load_format="dummy"`: no safetensors are read; the weights are `random_weights_` (seed 0)
    made on the device, in the layout `quant` gives (8-bit where an MXFP8 config is kept so)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format = {load_format!r} is not supported (expected one of {list(LOAD_FORMATS)})"
        )
    path = check_dir(path)
    args = ModelArgs.from_file(path / "config.json")  # a bad config is its own error, first
    files = weight_files(path) if load_format == "auto" else []
    scheme = read_scheme(path)
    args = dense_without_indexer(args, _headers(files), scheme) if files else args
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    auto = (quant or "auto") == "auto"
    quant = resolve_quant(quant, args, dev, scheme if files else NONE)
    if quant == "keep" and parallel.world > 1:
        if not auto:
            raise ValueError(
                "quant='keep' runs on one device; under parallelism 4-bit weights are dequantised"
            )
        log.warning("dequantising the checkpoint's 4-bit weights: kept as stored on one device only")
        quant = None
    if quant == "mxfp8" and auto and (misaligned := mxfp8_split_errors(args, parallel)):
        log.warning(
            "dequantising the 8-bit shards (rank slices not multiples of 32: %s)", "; ".join(misaligned)
        )
        quant = None
    built = None if quant == "keep" else quant
    with torch.device("meta"):
        model = MiniMaxM3(args, dtype=dt, quant=built)
        local = MiniMaxM3(args, dtype=dt, quant=built, parallel=parallel) if parallel.world > 1 else model
    if load_format == "dummy":
        model = random_weights_(allocate(local, dev))
    else:
        sources = plan(files, args, model, scheme)  # a bad checkpoint fails here, before allocation
        if quant == "keep":
            keep_as_stored_(model, kept_weights(sources))
        shards = None
        if parallel.world > 1:  # the full model's parameters (8-bit scales included) -> this rank's slice
            shards = {n: param_shard(n, tuple(p.shape), args, parallel) for n, p in model.named_parameters()}
        model = allocate(local, dev)
        stream_weights(model, sources, progress, shards)
    sizes = weight_bytes(model)
    log.info(
        "resident weights: %.3f GB (%s)",
        sum(sizes.values()) / 1e9,
        ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in sizes.items()),
    )
    return model.eval().requires_grad_(False).prepare_()  # the weights are final


def load(
    path: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    progress: Callable[[int, int], None] | None = None,
    quant: str | None = "auto",
    parallel: ParallelConfig = SINGLE,
    load_format: str = "auto",
    skip_tokenizer_init: bool = False,
) -> tuple[MiniMaxM3, Any]:
    """Load a local checkpoint directory: returns (model, tokenizer or None).

    `quant`: "auto" keeps an MXFP8 checkpoint's weights in 8 bits on a GPU, "mxfp8" always
    (quantising a bf16/fp32 checkpoint at load), "none" dequantises. With `parallel` (a rank of
    a tensor-parallel group) the model is that rank's shard, 8-bit where the weights are.
    The model carries the checkpoint's generation_config.json as `model.generation_config`
    (sampling defaults and EOS ids). `load_format="dummy"` builds the model from config.json
    alone with seeded random weights made on the device (`m3lm.loader.random_weights_`); with
    `skip_tokenizer_init` the tokenizer is None (token ids in and out).
    """
    from m3lm.tokenizer import load_tokenizer  # transformers: only when a tokenizer is loaded

    path = check_dir(path)
    model = load_model(
        path,
        device=device,
        dtype=dtype,
        progress=progress,
        quant=quant,
        parallel=parallel,
        load_format=load_format,
    )
    model.generation_config = read_generation_config(path)
    return model, None if skip_tokenizer_init else load_tokenizer(path)


def read_generation_config(path: Path) -> dict:
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return {}
    check_inside(Path(path), f)
    return json_object(f)
