"""The tensor-parallel benchmarks' slices (`benchmarks/tp_bench.py`, `tp_check.py`, `multi_gpu_plan.py`):
slice configs, seeded shard fill, projections.

A rank's shard of a slice is built on the meta device with its `ParallelConfig`, moved to its
device and filled from seeds, so no rank ever holds the full weights. Two fills:

- `full`: every parameter is drawn at its full (unsharded) shape from a generator seeded by its
  name, and the rank keeps its slice (`param_shard`). Every rank agrees on replicated weights and
  the shards join into exactly the weights a single-device build of the same seed gets (same
  device type). Peak extra memory: the largest full tensor (an MoE layer's w1: 4.8 GB in bf16).
- `shard`: replicated parameters are seeded by name, sharded ones by (name, rank), drawn at the
  local shape. Faster; outputs match no single-device run (timing only).
"""

from __future__ import annotations

import os
import zlib

import torch
from torch import nn

from m3lm.bench.slice import RELEASE_DENSE, RELEASE_SPARSE, release_slice_config
from m3lm.config import ModelArgs, parse_config, release_config
from m3lm.distributed.parallel import ParallelConfig
from m3lm.distributed.shard import param_shard
from m3lm.models.minimax_m3 import MiniMaxM3

RELEASE_LAYERS = RELEASE_DENSE + RELEASE_SPARSE
# Published serving figures for the full model (../shared/docs/performance.md): vLLM, MXFP8 weights,
# TP 8 on 8 x H200, 1k in / 1k out; ms per output token by concurrency.
VLLM_TPOT_MS = {4: 8.4, 64: 27.0}


def tiny_slice_config(layers: int) -> dict:
    """A CPU-sized slice with the release's structure: 8 query heads over 2 KV heads, 8 experts,
    MSA blocks of 4 with top-2 (sizes divide by 8 ranks; an expert's width stays a multiple of 32
    on 8 ranks, so its MXFP8 shards hold whole 32-blocks as the release's do)."""
    return release_config(
        vocab_size=256, hidden_size=64, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, rotary_dim=8, rope_theta=10000.0,
        max_position_embeddings=4096, dense_layers=1, dense_intermediate_size=128,
        intermediate_size=256, shared_intermediate_size=64, num_local_experts=8,
        num_experts_per_tok=2, index_head_dim=16, block_size=4, topk_blocks=2, local_blocks=1,
    )["text_config"]  # fmt: skip


def slice_args(layers: int, tiny: bool = False, dense_layers: int = 1) -> ModelArgs:
    """The first `dense_layers` layers dense MLP + full attention, the rest MoE + MSA: 1 for the
    slices `m3lm bench` builds, 3 for the release (`slice_args(60, dense_layers=3)`)."""
    text = tiny_slice_config(layers) if tiny else release_slice_config(layers)
    kinds = [0] * dense_layers + [1] * (layers - dense_layers)
    text["moe_layer_freq"] = kinds
    sparse = text["sparse_attention_config"]
    sparse["sparse_attention_freq"] = sparse["sparse_disable_index_value"] = kinds
    return parse_config(text)


def require_nvls_off() -> None:
    """NCCL_NVLS_ENABLE must be 0 (NVLink multicast off, as the H200 machines require): set it
    when unset, refuse any other value."""
    value = os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if value != "0":
        raise SystemExit(f"NCCL_NVLS_ENABLE={value}: this machine needs NCCL_NVLS_ENABLE=0")


def param_seed(name: str, seed: int, rank: int | None = None) -> int:
    """A stable 31-bit seed for a parameter (and a rank, for rank-local draws)."""
    return zlib.crc32(f"{seed}/{name}/{'' if rank is None else rank}".encode()) & 0x7FFFFFFF


def _std(p: torch.Tensor) -> float:
    return 0.1 if p.dim() == 1 else 0.02  # as `m3lm.loader.random_weights_`


def full_shapes(args: ModelArgs, dtype: torch.dtype) -> dict[str, tuple[int, ...]]:
    """Parameter name -> full (unsharded) shape, from a meta-device model."""
    with torch.device("meta"):
        model = MiniMaxM3(args, dtype=dtype)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


@torch.no_grad()
def fill_(model: MiniMaxM3, shapes: dict, pc: ParallelConfig, seed: int, mode: str = "full") -> None:
    """Fill this rank's parameters in place (see the module docstring for `full` and `shard`)."""
    if mode not in ("full", "shard"):
        raise ValueError(f"fill mode {mode!r}: expected full or shard")
    for name, p in model.named_parameters():
        shard = param_shard(name, shapes[name], model.args, pc)
        rank = pc.rank if (shard and mode == "shard") else None
        gen = torch.Generator(device=p.device).manual_seed(param_seed(name, seed, rank))
        if mode == "full" and shard:
            whole = torch.empty(shapes[name], dtype=p.dtype, device=p.device)
            p.copy_(whole.normal_(0.0, _std(p), generator=gen)[shard])
            del whole
        else:
            p.normal_(0.0, _std(p), generator=gen)
        if name.endswith("e_score_correction_bias"):
            p.mul_(0.01)


def build_shard(
    args: ModelArgs, pc: ParallelConfig, device: torch.device, dtype: torch.dtype, seed: int, mode: str
) -> MiniMaxM3:
    """This rank's shard of the slice, built on the meta device, filled on `device` and prepared
    (a caller that quantises it prepares it again)."""
    with torch.device("meta"):
        model = MiniMaxM3(args, dtype=dtype, parallel=pc)
    model = model.to_empty(device=device).eval().requires_grad_(False)
    fill_(model, full_shapes(args, dtype), pc, seed, mode)
    return model.prepare_()


class Depth:
    """Run a model on its first `k` layers only (restored on exit): 0 = embedding + lm_head."""

    def __init__(self, model: MiniMaxM3, k: int):
        self.model, self.k, self.layers = model, k, model.model.layers

    def __enter__(self) -> MiniMaxM3:
        self.model.model.layers = nn.ModuleList(list(self.layers)[: self.k])
        return self.model

    def __exit__(self, *exc) -> None:
        self.model.model.layers = self.layers


def per_layer(t0: float, t1: float, tn: float, n: int) -> dict[str, float]:
    """Times at depth 0, 1 and n (layer 0 dense, 1..n-1 MoE + MSA) -> the head, one dense layer,
    one MoE + MSA layer, and the release's 60 layers: head + 3 dense + 57 MoE + MSA."""
    assert n >= 2, "the projection needs at least one MoE + MSA layer"
    head, dense, sparse = t0, t1 - t0, (tn - t1) / (n - 1)
    return {
        "head": head,
        "dense": dense,
        "sparse": sparse,
        "release": head + RELEASE_DENSE * dense + RELEASE_SPARSE * sparse,
    }


def vllm_cell(batch: int | None) -> str:
    """The published vLLM figure set beside a decode batch (prefill rows get none)."""
    if batch is None:
        return "-"
    if batch in VLLM_TPOT_MS:
        return f"{VLLM_TPOT_MS[batch]} ms/token (concurrency {batch})"
    return ", ".join(f"{ms} ms at {c}" for c, ms in VLLM_TPOT_MS.items())


def table(rows: list[dict], layers: int) -> str:
    """Markdown table of timed rows: case, quant, path, ms, tok/s, per-layer parts, projection."""
    head = [
        "case", "weights", "path", f"{layers}-layer ms", "tok/s", "head ms", "dense layer ms",
        "MoE+MSA layer ms", "60-layer projection ms", "projected tok/s", "vLLM MXFP8 TP8 (published)",
    ]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(out + ["| " + " | ".join(cells(r)) + " |" for r in rows])


def cells(r: dict) -> list[str]:
    """One row: r has case, quant, path, ms, tokens, parts (`per_layer`) and batch (decode)."""
    p, tps = r["parts"], r["tokens"] * 1e3
    return [
        r["case"], r["quant"], r["path"], f"{r['ms']:.3f}", f"{tps / r['ms']:,.0f}", f"{p['head']:.3f}",
        f"{p['dense']:.3f}", f"{p['sparse']:.3f}", f"{p['release']:.2f}", f"{tps / p['release']:,.0f}",
        vllm_cell(r.get("batch")),
    ]  # fmt: skip


def parse_decode(spec: str) -> list[tuple[int, int]]:
    """'1x2048,64x2048' -> [(batch, context)]."""
    return [tuple(int(x) for x in s.split("x")) for s in spec.split(",") if s]


def parse_ints(spec: str) -> list[int]:
    return [int(s) for s in spec.split(",") if s]
