"""Memory plan of a tensor-parallel MiniMax-M3 from the model definition alone (meta device).

For the 16-layer slice `tp_bench.py` builds (layer 0 dense, 15 MoE + MSA) and the 60-layer
release (3 dense + 57 MoE + MSA), at TP 4 and 8 with and without expert parallelism: each
rank's resident weight bytes in bf16 and in MXFP8 (`keep_mxfp8_` on the rank's meta shard, and
the same counted from the shapes: e4m3 values plus one uint8 scale per 32 inputs for the weights
the release stores so), the KV + index-key cache bytes per token on a rank, and the tokens of
cache that fit a GPU's budget. No weights, no device:

    python benchmarks/multi_gpu_plan.py --out benchmarks/results/multi_gpu_plan.md
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from m3lm.bench.report import machine, write_section
from m3lm.bench.tp_slice import slice_args
from m3lm.config import ModelArgs
from m3lm.distributed.parallel import ParallelConfig
from m3lm.kernels.fp8 import MX_BLOCK
from m3lm.layers.linear import weight_bytes
from m3lm.memory_plan import rank_bytes as plan_rank_bytes
from m3lm.memory_plan import rank_model
from m3lm.models.minimax_m3 import MXFP8_LINEARS, MiniMaxM3, keep_mxfp8_

GPU_BYTES = 141e9  # H200 HBM as specified; torch reports about 140 GiB (about 150e9 B): conservative
GPU_REPORTED = 150e9
WORKSPACE = 8e9  # activations, workspace, CUDA context, allocator slack (decode and chunked prefill)
HAND_TEXT_BF16 = 852_437_266_944  # the release's text decoder in bf16, counted by hand (report)
_8BIT = tuple(f"{p}.{n}.weight" for p, names in MXFP8_LINEARS for n in names) + tuple(
    f"block_sparse_moe.experts.{w}" for w in ("w1", "w2", "w3")
)


def mxfp8_from_shapes(model: MiniMaxM3) -> int:
    """Bytes with the release's 8-bit weights as e4m3 [O, In] + uint8 scales [O, In / 32]."""
    total = 0
    for name, p in model.named_parameters():
        held = name.endswith(_8BIT) and p.shape[-1] % MX_BLOCK == 0
        total += p.numel() + p.numel() // MX_BLOCK if held else p.numel() * p.element_size()
    return total


def rank_bytes(args: ModelArgs, pc: ParallelConfig) -> dict[str, int]:
    """One rank's weights: bf16, MXFP8 through keep_mxfp8_, MXFP8 from shapes; KV per token."""
    model = rank_model(args, pc)
    out = {"bf16": sum(weight_bytes(model).values()), "mxfp8_shapes": mxfp8_from_shapes(model)}
    out["mxfp8"] = sum(weight_bytes(keep_mxfp8_(model)).values())
    for key, fp8 in (("kv_token", False), ("kv_token_fp8ik", True)):
        out[key] = plan_rank_bytes(args, pc, None, fp8)[1]
    out["kv_heads"] = model.model.layers[0].self_attn.n_kv
    return out


def plan(args: ModelArgs, world: int, ep: bool) -> dict[str, int]:
    """The largest rank's figures (ranks differ only in which KV head they keep)."""
    per_rank = [rank_bytes(args, ParallelConfig(world, r, ep)) for r in (0, world - 1)]
    return {k: max(r[k] for r in per_rank) for k in per_rank[0]}


def fit(weights: int, per_token: int) -> str:
    free = GPU_BYTES - WORKSPACE - weights
    return f"{free / per_token / 1e3:,.0f}k" if free > 0 else f"does not fit ({free / 1e9:,.1f} GB)"


def section(name: str, args: ModelArgs) -> list[str]:
    full = rank_model(args, ParallelConfig())
    bf16, mx = sum(weight_bytes(full).values()), sum(weight_bytes(keep_mxfp8_(full)).values())
    lines = [
        f"### {name}: {args.num_hidden_layers} layers ({sum(1 for m in args.moe_layers if not m)} dense + "
        f"{sum(args.moe_layers)} MoE + MSA), whole model {bf16 / 1e9:,.1f} GB bf16, {mx / 1e9:,.1f} GB MXFP8",
        "",
        "| TP | EP | KV heads per rank | weights per rank bf16 GB | MXFP8 GB (keep_mxfp8_ / from shapes) "
        "| KV + index keys per token per rank (bf16; fp8 index keys) | tokens of cache that fit, bf16 "
        "| tokens that fit, MXFP8 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world in (4, 8):
        for ep in (False, True):
            p = plan(args, world, ep)
            same = "=" if p["mxfp8"] == p["mxfp8_shapes"] else "!="
            lines.append(
                f"| {world} | {'yes' if ep else 'no'} | {p['kv_heads']} | {p['bf16'] / 1e9:,.2f} "
                f"| {p['mxfp8'] / 1e9:,.2f} {same} {p['mxfp8_shapes'] / 1e9:,.2f} "
                f"| {p['kv_token']:,} B; {p['kv_token_fp8ik']:,} B "
                f"| {fit(p['bf16'], p['kv_token'])} | {fit(p['mxfp8'], p['kv_token'])} |"
            )
    return lines


def hand_check(args: ModelArgs) -> list[str]:
    bf16 = sum(weight_bytes(rank_model(args, ParallelConfig())).values())
    err = abs(bf16 - HAND_TEXT_BF16) / HAND_TEXT_BF16
    assert err < 1e-5, f"model {bf16} B against the hand count {HAND_TEXT_BF16} B"
    return [
        "### Cross-check by hand: the 60-layer text decoder in bf16",
        "",
        "- embedding + lm_head: 2 x 200064 x 6144 = 2,458,386,432 parameters",
        "- attention: q and o 2 x 6144 x 64 x 128 + k and v 2 x 6144 x 4 x 128 = 106,954,752",
        "- dense layer: attention + MLP 3 x 12288 x 6144 = 333,447,168 (x 3)",
        "- MoE + MSA layer: attention + indexer (6144 x 4 x 128 + 6144 x 128 = 3,932,160) + experts "
        "3 x 128 x 3072 x 6144 = 7,247,757,312 + shared expert 3 x 3072 x 6144 = 56,623,104 "
        "= 7,415,267,328 bf16 parameters, plus the fp32 router 128 x 6144 + 128 (x 57)",
        "- bytes: 2 x (2,458,386,432 + 3 x 333,447,168 + 57 x 7,415,267,328) + 4 x 57 x 786,560 "
        f"= {HAND_TEXT_BF16:,} B = {HAND_TEXT_BF16 / 1e9:.1f} GB (norms add 1.5 MB); the meta model: "
        f"{bf16:,} B (relative difference {err:.1e})",
        "- performance.md's 854 GB (428B parameters) is the whole checkpoint; the text decoder is "
        f"{bf16 / 2e9:.1f}B parameters, the rest lies outside it (what the loader skips: vision "
        "tower, projector)",
    ]


def headline(release: ModelArgs) -> list[str]:
    out = ["### Headline", ""]
    for world, quant in ((8, "bf16"), (4, "mxfp8"), (8, "mxfp8")):
        p = plan(release, world, True)
        extra = (GPU_REPORTED - GPU_BYTES) / p["kv_token"] / 1e3
        out.append(
            f"- 60 layers, {quant}, TP {world}: {p[quant] / 1e9:.1f} GB of weights per rank "
            f"({p[quant] / 2**30:.1f} GiB), {p['kv_token']:,} B of KV + index keys per token, "
            f"{fit(p[quant], p['kv_token'])} tokens of cache ({extra:,.0f}k more with {GPU_REPORTED / 1e9:.0f}e9 B)"
        )
    tp4 = plan(release, 4, True)["bf16"]
    out.append(f"- 60 layers, bf16, TP 4: {fit(tp4, 1)} ({tp4 / 1e9:.1f} GB of weights per rank)")
    return out


def report() -> str:
    slice16, release = slice_args(16), slice_args(60, dense_layers=3)
    lines = [
        *headline(release),
        "",
        f"Budget per GPU: {GPU_BYTES / 1e9:.0f} GB (H200) minus {WORKSPACE / 1e9:.0f} GB for activations, "
        "workspace, CUDA context and allocator slack (enough for decode batches and chunked prefill; a "
        "whole 64k prefill in one pass needs more); the rest holds the KV + index-key cache. A rank keeps "
        "its KV heads of every token (the release has 4: one per rank at TP 4, shared by two ranks at "
        "TP 8) and all index keys (one replicated head per sparse layer), so the tokens that fit are the "
        "group's, not a rank's share. GB = 1e9 bytes.",
        "",
        "MXFP8: what the MXFP8 release stores in 8 bits (attention and indexer projections, dense MLP, "
        "shared and routed experts) as e4m3 plus one uint8 scale per 32 inputs; embedding, lm_head, norms "
        "and the fp32 router as stored. Every row-parallel shard's input width divides by 32 at TP 4 and 8 "
        "(o_proj 1024 or 2048, dense down_proj 1536 or 3072, expert down_proj 384 or 768 without EP), so a "
        "rank's 8-bit shard is exactly its slice of the release's blocks, and a tensor-parallel rank keeps "
        "it in 8 bits (the loader reads the e4m3 slice and its scales as stored). The whole MXFP8 "
        "text decoder is 442.0e9 B = 411.6 GiB: performance.md's '413 GB' reads as GiB of the files.",
        "",
        *section("16-layer slice (tp_bench.py --layers 16)", slice16),
        "",
        *section("60-layer release", release),
        "",
        *hand_check(release),
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write a dated section to this Markdown file (its latest run)")
    ns = p.parse_args()
    body = report()
    command = "python benchmarks/multi_gpu_plan.py " + shlex.join(sys.argv[1:])
    details = [
        f"Machine: {machine()} (meta-device models only; no weights, no GPU); torch {torch.__version__}"
    ]
    print(body)
    if ns.out:
        write_section(Path(ns.out), "Multi-GPU memory plan", command, details, body)


if __name__ == "__main__":
    main()
