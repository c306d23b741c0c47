"""Which slice of each parameter a rank owns: one pure plan used by the model and the loader.

A shard is a tuple of `slice`s over the full parameter's dims (empty: replicated). Attention
splits query heads; KV heads are split too, or replicated when there are more ranks than KV
heads (each rank then keeps the one KV head its query heads read). Index-query heads follow
their KV group; the single index-key head, norms and the fp32 router are replicated. Dense MLP
and shared expert: gate/up rows split, down columns split. Routed experts: whole experts per
rank with expert parallelism, else each expert's width split. Embedding and lm_head: vocab rows.

An 8-bit weight's E8M0 scales [.., O, In/32] follow it: the same rows (and experts), and its
input columns in whole 32-blocks, so a row-parallel split must put every rank's slice of the
input on block boundaries (`check_mxfp8_split`).
"""

from __future__ import annotations

from m3lm.config import ModelArgs
from m3lm.distributed.parallel import ParallelConfig
from m3lm.errors import ConfigError
from m3lm.kernels.fp8 import MX_BLOCK


def part(n: int, pc: ParallelConfig, what: str) -> tuple[int, int]:
    """[lo, hi) of rank pc.rank when n is split evenly; ConfigError when it does not divide."""
    if n % pc.world:
        raise ConfigError(f"{what} = {n} is not divisible by the tensor-parallel size {pc.world}")
    size = n // pc.world
    return pc.rank * size, (pc.rank + 1) * size


def head_ranges(args: ModelArgs, pc: ParallelConfig) -> tuple[range, range]:
    """The query heads and KV heads (= index heads) of this rank."""
    h, k, w = args.num_attention_heads, args.num_key_value_heads, pc.world
    q = range(*part(h, pc, "num_attention_heads"))
    if k >= w:
        return q, range(*part(k, pc, "num_key_value_heads"))
    if w % k:
        raise ConfigError(f"tensor-parallel size {w} must divide or be a multiple of {k} KV heads")
    first = q.start // args.kv_groups  # ranks > KV heads: each keeps the KV head of its query heads
    return q, range(first, first + 1)


def param_shard(name: str, shape: tuple[int, ...], args: ModelArgs, pc: ParallelConfig) -> tuple[slice, ...]:
    """This rank's slice of parameter `name` of full shape `shape` (m3lm names); () = replicated."""
    if pc.world == 1:
        return ()
    if name.endswith("_scale"):  # `<weight>_scale` [..., O, In/32] of an 8-bit weight [..., O, In]
        weight = name.removesuffix("_scale")
        return scale_shard(param_shard(weight, (*shape[:-1], shape[-1] * MX_BLOCK), args, pc), weight)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _cut(shape, 0, *part(shape[0], pc, "vocab_size"))
    leaf = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    cut = _attention_cut(leaf, args, pc) if leaf.startswith("self_attn.") else _mlp_cut(leaf, shape, pc)
    return () if cut is None else _cut(shape, *cut)


def _cut(shape: tuple[int, ...], dim: int, lo: int, hi: int) -> tuple[slice, ...]:
    """The whole of `shape`, but only [lo, hi) along `dim`."""
    whole = [slice(0, n) for n in shape]
    whole[dim] = slice(lo, hi)
    return tuple(whole)


def _attention_cut(leaf: str, args: ModelArgs, pc: ParallelConfig) -> tuple[int, int, int] | None:
    """(dim, lo, hi) of this rank's heads in an attention weight: rows of the projections in,
    columns of o_proj; None for the replicated ones (q/k norms, the single index-key head and
    the index norms)."""
    q, kv = head_ranges(args, pc)
    d, di = args.head_dim, args.index_head_dim
    return {
        "self_attn.q_proj.weight": (0, q.start * d, q.stop * d),
        "self_attn.k_proj.weight": (0, kv.start * d, kv.stop * d),
        "self_attn.v_proj.weight": (0, kv.start * d, kv.stop * d),
        "self_attn.index_q_proj.weight": (0, kv.start * di, kv.stop * di),
        "self_attn.o_proj.weight": (1, q.start * d, q.stop * d),
    }.get(leaf)


def _mlp_cut(leaf: str, shape: tuple[int, ...], pc: ParallelConfig) -> tuple[int, int, int] | None:
    """(dim, lo, hi) of this rank's part of an MLP or expert weight: gate/up rows, down columns,
    whole experts with expert parallelism, else each expert's width; None: replicated."""
    if leaf.endswith(("gate_proj.weight", "up_proj.weight")):
        return 0, *part(shape[0], pc, "intermediate width")
    if leaf.endswith("down_proj.weight"):
        return 1, *part(shape[1], pc, "intermediate width")
    if leaf.endswith(("experts.w1", "experts.w3", "experts.w2")):
        if pc.ep:
            return 0, *part(shape[0], pc, "num_local_experts")
        dim = 2 if leaf.endswith("w2") else 1
        return dim, *part(shape[dim], pc, "intermediate_size")
    return None


def scale_shard(shard: tuple[slice, ...], weight: str) -> tuple[slice, ...]:
    """The slice of an 8-bit weight's scales [..., O, In/32] that goes with its `shard`."""
    if not shard:
        return ()
    lo, hi = shard[-1].start, shard[-1].stop
    if lo % MX_BLOCK or hi % MX_BLOCK:
        raise ConfigError(
            f"{weight}: this rank's input columns [{lo}, {hi}) do not fall on whole {MX_BLOCK}-element "
            "MXFP8 blocks, so its 8-bit shard cannot be cut from the checkpoint"
        )
    return (*shard[:-1], slice(lo // MX_BLOCK, hi // MX_BLOCK))


def mxfp8_split_errors(args: ModelArgs, pc: ParallelConfig) -> list[str]:
    """The row-parallel input widths (held in 8 bits, i.e. multiples of 32) whose per-rank slices
    are not whole 32-blocks; empty when every 8-bit shard is aligned (always on one process)."""
    widths = [("num_attention_heads x head_dim", args.num_attention_heads * args.head_dim)]  # o_proj
    if not all(args.moe_layers):
        widths.append(("dense_intermediate_size", args.dense_intermediate_size))  # down_proj
    if any(args.moe_layers):
        widths.append(("shared_intermediate_size", args.shared_intermediate_size))
        if not pc.ep:
            widths.append(("intermediate_size", args.intermediate_size))  # w2 (EP keeps whole experts)
    w = pc.world
    return [
        f"{what} = {n} over {w} ranks gives {n // w} per rank"
        for what, n in widths
        if w > 1 and n % MX_BLOCK == 0 and n % w == 0 and (n // w) % MX_BLOCK
    ]


def check_mxfp8_split(args: ModelArgs, pc: ParallelConfig) -> None:
    """ConfigError unless every rank's 8-bit shard starts and ends on a 32-element input block."""
    errors = mxfp8_split_errors(args, pc)
    if errors:
        raise ConfigError(
            f"8-bit (MXFP8) weights at tensor-parallel size {pc.world} need each rank's input slice "
            f"to be a multiple of {MX_BLOCK}: {'; '.join(errors)} (load with quant='none' to "
            "dequantise the shards, or pick another tensor-parallel size)"
        )


def local_shape(shape: tuple[int, ...], shard: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in shard) if shard else tuple(shape)


def _bounds(ix: slice, size: int) -> tuple[int, int]:
    lo, hi, step = ix.indices(size)
    assert step == 1, "pieces are contiguous"
    return lo, hi


def localize(
    index: tuple, slot: int | None, src_shape: tuple[int, ...], shard: tuple[slice, ...]
) -> tuple[tuple, int | None] | None:
    """Compose a checkpoint piece with a rank's shard: what to read from the source tensor and
    which local slot it fills, or None when the rank owns none of it.

    `index` selects the piece from the source tensor (ints and slices, as in `Piece`); the piece
    fills the full parameter, or its entry `slot` along dim 0 (stacked experts). `shard` is the
    rank's slice of that full parameter. The result indexes every source dim.
    """
    if shard and slot is not None:
        lo, hi = shard[0].start, shard[0].stop
        if not lo <= slot < hi:
            return None
        slot, shard = slot - lo, shard[1:]
    rest = list(shard)
    out: list = []
    for d, size in enumerate(src_shape):
        ix = index[d] if d < len(index) else slice(None)
        if isinstance(ix, int):
            out.append(ix)
            continue
        lo, hi = _bounds(ix, size)
        if rest:
            a, b = _bounds(rest.pop(0), hi - lo)
            lo, hi = lo + a, lo + b
        out.append(slice(lo, hi))
    assert not rest, "a shard has more dims than its piece"
    return tuple(out), slot
