"""What a checkpoint needs on each GPU, before any weight is read: every rank's resident weights
(the model built on the meta device as that rank's shard, held as the loader would hold it) and
the KV cache that the rest of a GPU holds (`m3lm plan`; `benchmarks/multi_gpu_plan.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from m3lm.cache.kv_cache import KVCache
from m3lm.cache.pool import plan_pool
from m3lm.checkpoint_quant import read_scheme
from m3lm.config import ModelArgs
from m3lm.distributed.parallel import ParallelConfig
from m3lm.distributed.shard import mxfp8_split_errors
from m3lm.errors import ConfigError
from m3lm.layers.linear import weight_bytes
from m3lm.layers.quantized import keep_as_stored_
from m3lm.loader import kept_weights, model_args, plan, resolve_quant, weight_files
from m3lm.model_dir import check_dir
from m3lm.models.minimax_m3 import MiniMaxM3

# Activations, workspace, CUDA context and decode graphs: an allowance. The engine measures its
# own peak activation at start and sizes the pool from what is really left.
RESERVE_BYTES = 8 * 10**9


def rank_model(args: ModelArgs, pc: ParallelConfig, quant: str | None = None) -> MiniMaxM3:
    """Rank `pc.rank`'s shard on the meta device, in bf16 (8-bit where `quant` is "mxfp8")."""
    with torch.device("meta"):
        return MiniMaxM3(args, dtype=torch.bfloat16, quant=quant, parallel=pc)


def rank_bytes(
    args: ModelArgs, pc: ParallelConfig, quant: str | None, index_fp8: bool = False, kept: dict | None = None
) -> tuple[int, int]:
    """(resident weight bytes, KV + index-key bytes per cached token) of one rank; `kept`: the
    weights held as the checkpoint stores them (`loader.kept_weights`, one GPU)."""
    model = rank_model(args, pc, None if quant == "keep" else quant)
    if kept:
        keep_as_stored_(model, kept)
    kv_heads = model.model.layers[0].self_attn.n_kv if args.num_hidden_layers else args.num_key_value_heads
    per_page = KVCache.bytes_per_page(args, torch.bfloat16, index_fp8, kv_heads)
    return sum(weight_bytes(model).values()), per_page // args.index_block_size


@dataclass(frozen=True)
class MemoryPlan:
    gpus: int
    expert_parallel: bool
    quant: str | None  # "mxfp8": 8-bit weights kept; "keep": as stored; None: bf16
    scheme: str  # the checkpoint's quantisation scheme ("none", "mxfp8", "mlx", ...)
    checkpoint_bytes: int  # the safetensors files on disk (vision tower and all)
    weight_bytes: int  # resident on the fullest GPU
    kv_bytes_per_token: int  # on the fullest GPU
    page_size: int
    max_model_len: int
    gpu_bytes: int
    utilization: float
    reserve_bytes: int

    @property
    def kv_bytes(self) -> int:
        """What a GPU has left for the KV cache: its share minus the weights and the reserve."""
        return max(0, int(self.gpu_bytes * self.utilization) - self.weight_bytes - self.reserve_bytes)

    @property
    def kv_tokens(self) -> int:
        """Cached tokens, as the engine sizes its pool from these figures (whole pages; 0: none fit)."""
        try:
            pool = plan_pool(
                bytes_per_page=self.kv_bytes_per_token * self.page_size,
                page_size=self.page_size,
                max_positions=self.max_model_len,
                max_num_seqs=1,
                total_bytes=self.gpu_bytes,
                utilization=self.utilization,
                weight_bytes=self.weight_bytes,
                peak_activation_bytes=self.reserve_bytes,
            )
        except ConfigError:  # not one page left
            return 0
        return pool.tokens


def plan_memory(
    path: str | Path,
    gpus: int,
    gpu_bytes: int,
    expert_parallel: bool = False,
    quant: str = "auto",
    utilization: float = 0.9,
    reserve_bytes: int = RESERVE_BYTES,
    index_fp8: bool = False,
) -> MemoryPlan:
    """The plan for checkpoint folder `path` on `gpus` GPUs of `gpu_bytes` each, as `m3lm serve
    --tensor-parallel-size gpus` would load it (`quant` as its --quant); reads headers only, and
    a folder with only config.json plans from it alone."""
    path = check_dir(path)
    # config.json alone plans too (as --load-format dummy loads): the release's dimensions, say
    alone = not any((path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))
    files = [] if alone else weight_files(path)
    scheme = read_scheme(path)
    args = model_args(path, files, scheme)
    held = resolve_quant(quant, args, torch.device("cuda"), scheme)
    if held == "keep" and gpus > 1:  # as the loader: 4-bit weights are kept on one GPU only
        if quant != "auto":
            raise ValueError(
                "quant='keep' runs on one device; under parallelism 4-bit weights are dequantised"
            )
        held = None
    kept = None
    if held == "keep" and files:
        kept = kept_weights(plan(files, args, rank_model(args, ParallelConfig(1, 0, False)), scheme))
    weights = kv = 0
    for rank in sorted({0, gpus - 1}):  # ranks differ only in which KV head they keep
        pc = ParallelConfig(gpus, rank, expert_parallel)
        rank_quant = None if held == "mxfp8" and quant == "auto" and mxfp8_split_errors(args, pc) else held
        w, t = rank_bytes(args, pc, rank_quant, index_fp8, kept)
        weights, kv = max(weights, w), max(kv, t)
    return MemoryPlan(
        gpus=gpus,
        expert_parallel=expert_parallel,
        quant=held,
        scheme=scheme.name,
        checkpoint_bytes=sum(f.stat().st_size for f in files),
        weight_bytes=weights,
        kv_bytes_per_token=kv,
        page_size=args.index_block_size,
        max_model_len=args.max_position_embeddings,
        gpu_bytes=gpu_bytes,
        utilization=utilization,
        reserve_bytes=reserve_bytes,
    )


def _size(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def describe(plan: MemoryPlan) -> str:
    """The plan as `m3lm plan` prints it."""
    how = f"{plan.gpus} GPU" + ("s, tensor parallel" if plan.gpus > 1 else "")
    how += ", expert parallel" if plan.expert_parallel and plan.gpus > 1 else ""
    held = {"mxfp8": "MXFP8 kept in 8 bits", "keep": "MXFP8 and 4-bit weights as stored, the rest bf16"}.get(
        plan.quant or "", "bf16"
    )
    if plan.scheme not in ("none", "mxfp8") and plan.quant != "keep":
        held += " (the checkpoint's 4- and 8-bit weights are dequantised at load)"
    budget = plan.gpu_bytes * plan.utilization
    lines = [
        f"checkpoint: {_size(plan.checkpoint_bytes) + ' on disk' if plan.checkpoint_bytes else 'config.json alone'}, "
        f"quantisation: {plan.scheme}",
        f"weights: {_size(plan.weight_bytes)} per GPU on {how}, held as {held}",
        f"KV cache: {_size(plan.gpu_bytes)} x {plan.utilization:g} = {_size(budget)}, less the weights and "
        f"{_size(plan.reserve_bytes)} for activations: {_size(plan.kv_bytes)} per GPU",
    ]
    if plan.kv_tokens == 0:
        lines.append("  = no room for a KV cache: more GPUs (or GPUs with more memory) are needed")
    else:
        lines.append(
            f"  = {plan.kv_tokens:,} tokens at {plan.kv_bytes_per_token:,} B each (KV and index keys), "
            f"{plan.kv_tokens / plan.max_model_len:.2f} sequences of the full {plan.max_model_len:,}"
        )
    return "\n".join(lines)
