"""Tiles of the MSA prefill attention: which queries share a program, and the union of the key
blocks they chose (Triton, each next to its reference).

A program of `msa_prefill_attention` holds BQ queries of one KV group (with every query head of
the group: about 64 rows, the smallest tensor-core tile) and walks the union of their selected
blocks; a row whose query did not choose a block is masked there, so the work is the union's
size times the rows. Consecutive queries of a trained model choose mostly the same blocks; on
unrelated selections (random weights, topic changes) four consecutive queries' union is 1.9x
their own blocks at 8k. `group_queries` puts queries with overlapping selections in the same
tile, greedily within windows of 128 queries: a simulation on uniformly random selections at 8k
puts the kernel's key steps at 0.85x of consecutive tiles, and at 1.0x with drifting ones
(`benchmarks/NOTES.md`). A row's arithmetic does not depend on which rows share its tile, so
the outputs do not change.

Shapes: K groups, T queries, k selected blocks per query and group, NT = ceil(T / BQ) tiles,
U = BQ x k union slots per tile.
"""

from __future__ import annotations

import functools
import itertools
import operator

import torch
import triton
import triton.language as tl

from m3lm.kernels.host import pad

_NONE = 1 << 30  # padding of the union lists
WINDOW = 128  # queries `group_queries` arranges at once (one program)


@triton.jit
def _popcount(x):
    """Set bits of each int64 (the classic bit-slicing count; wraps like unsigned arithmetic)."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    return ((x * 0x0101010101010101) >> 56) & 0xFF


@triton.jit(do_not_specialize=["t_len", "s_sk", "s_mk", "s_ok"])
def _group_queries_kernel(
    sel_ptr, mask_ptr, order_ptr, t_len, s_sk, s_st, s_mk, s_ok,
    W: tl.constexpr, BQ: tl.constexpr, TOPK: tl.constexpr,
):  # fmt: skip
    """One window of W queries of one group: tiles of BQ filled in turn, each from the first query
    left, then the query whose blocks overlap the tile's union most (ties to the earlier query).
    A selection is a 64-bit mask, block b as bit b % 64 (exact up to 64 blocks). Each pick is one
    max over the window (score and place packed in one int32) and one cached load of its mask:
    the loop is a chain of W dependent steps, so its latency is the kernel's time."""
    win = tl.program_id(0)
    kh = tl.program_id(1)
    idx = tl.arange(0, W)
    ok = win * W + idx < t_len
    # Built one slot at a time, so that each thread holds W / 32 masks (a reduction over a
    # [W, k] tile would leave them spread, and every pick would then count bits of many).
    masks = tl.zeros([W], tl.int64)
    one = tl.full([W], 1, tl.int64)
    for j in range(TOPK):
        b = tl.load(sel_ptr + kh * s_sk + (win * W + idx) * s_st + j, mask=ok, other=-1)
        masks = masks | tl.where(b >= 0, one << (b % 64).to(tl.int64), 0)
    own = mask_ptr + kh * s_mk + win * W  # this window's masks, read back one at a time
    tl.store(own + idx, masks)
    tl.debug_barrier()
    out = order_ptr + kh * s_ok + win * W
    taken = ~ok
    u = tl.sum(tl.zeros([W], tl.int64), axis=0)  # the current tile's union
    for i in range(W):
        u = tl.where(i % BQ == 0, 0, u)  # a new tile: its first query is the first one left
        score = tl.where(taken, -1, _popcount(masks & u).to(tl.int32))
        key = tl.max((score + 1) * 256 + (255 - idx), axis=0)  # best score, then the earliest
        pick = 255 - key % 256
        live = key >= 256  # some query was left
        u = u | tl.load(own + pick, mask=live, other=0)
        taken = taken | (idx == pick)
        tl.store(out + i, (win * W + pick).to(tl.int32), mask=live)


def group_queries(block_ids: torch.Tensor, bq: int) -> torch.Tensor | None:
    """Which queries share each tile: block_ids [K, T, k] (-1 = unused) -> order [K, NT * BQ]
    int32, tile i of group g holding queries order[g, i*BQ : i*BQ + BQ] (a permutation of 0..T-1
    within each window of 128, slots past T unused); None where tiles of one query (or tiles that
    do not divide the window) leave nothing to group. One Triton launch; `group_queries_ref` is
    the reference."""
    kh, t, k = block_ids.shape
    if bq < 2 or WINDOW % bq:
        return None
    sel = block_ids.to(torch.int32).contiguous()
    windows = triton.cdiv(t, WINDOW)
    masks = torch.empty(kh, windows * WINDOW, device=sel.device, dtype=torch.int64)  # scratch
    order = torch.empty(kh, -(-t // bq) * bq, device=sel.device, dtype=torch.int32)
    _group_queries_kernel[(windows, kh)](
        sel, masks, order, t, sel.stride(0), sel.stride(1), masks.stride(0), order.stride(0), W=WINDOW, BQ=bq,
        TOPK=k, num_warps=1,
    )  # fmt: skip
    return order


def group_queries_ref(block_ids: torch.Tensor, bq: int) -> torch.Tensor:
    """`group_queries` in Python, on sets of block ids (slots past T hold -1)."""
    kh, t, _ = block_ids.shape
    order = torch.full((kh, -(-t // bq) * bq), -1, dtype=torch.int32)
    for g in range(kh):
        masks = [
            functools.reduce(operator.or_, (1 << (b % 64) for b in row.tolist() if b >= 0), 0)
            for row in block_ids[g]
        ]
        slot = 0
        for w0 in range(0, t, WINDOW):
            left = list(range(w0, min(w0 + WINDOW, t)))
            while left:
                union = 0
                for _ in range(bq):
                    if not left:
                        break
                    best = max(left, key=lambda j: (bin(masks[j] & union).count("1"), -j))
                    left.remove(best)
                    union |= masks[best]
                    order[g, slot] = best
                    slot += 1
    return order


@triton.jit(do_not_specialize=["t_len", "n_blocks", "s_sk", "s_ok", "s_bk", "s_ck", "s_wk"])
def _tile_blocks_kernel(
    sel_ptr, order_ptr, blocks_ptr, count_ptr, bits_ptr, t_len, n_blocks, s_sk, s_st, s_ok, s_bk, s_bt,
    s_ck, s_wk, s_wt, BQ: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, CH: tl.constexpr,
    N_CHUNKS: tl.constexpr, W: tl.constexpr, ORDERED: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kh = tl.program_id(1)
    rows = tl.arange(0, BQ * KP)  # (query, slot) pairs of the tile
    at_q = tile * BQ + rows // KP  # the query's place in the order
    t = tl.load(order_ptr + kh * s_ok + at_q, mask=at_q < t_len, other=0) if ORDERED else at_q
    slot = rows % KP
    sel = tl.load(sel_ptr + kh * s_sk + t * s_st + slot, mask=(at_q < t_len) & (slot < TOPK), other=-1)
    count = 0
    place = tl.zeros([BQ * KP], tl.int32)  # where each pair's block lands in the union list
    for c in range(N_CHUNKS):  # blocks c*CH .. c*CH+CH-1: which of them some query of the tile chose
        ids = c * CH + tl.arange(0, CH)
        hit = sel[:, None] == ids[None, :]  # [BQ * KP, CH]
        present = tl.max(hit.to(tl.int32), axis=0)  # [CH]
        at = count + tl.cumsum(present, axis=0) - 1  # ascending positions in the union list
        tl.store(blocks_ptr + kh * s_bk + tile * s_bt + at, ids, mask=(present > 0) & (ids < n_blocks))
        place += tl.sum(tl.where(hit, at[None, :], 0), axis=1)
        count += tl.sum(present, axis=0)
    tl.store(count_ptr + kh * s_ck + tile, count)
    # Each query's chosen places as bits, 64 places a word (distinct places: the sum is an OR).
    one = tl.full([BQ * KP], 1, tl.int64)
    for w in range(W):
        bit = tl.where((sel >= 0) & (place // 64 == w), one << (place % 64).to(tl.int64), 0)
        word = tl.sum(tl.reshape(bit, (BQ, KP)), axis=1)  # [BQ]
        tl.store(bits_ptr + kh * s_wk + tile * s_wt + tl.arange(0, BQ) * W + w, word)


def tile_blocks(
    block_ids: torch.Tensor, bq: int, n_blocks: int, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The union of the selected blocks of each tile of `bq` queries, per group, and which of
    them each query chose.

    block_ids [K, T, k] (-1 = unused), ids below `n_blocks`; order: the tiles' queries
    (`group_queries`), by default consecutive -> (blocks [K, NT, U] int32 ascending, padded with
    a large id; count [K, NT] int32; bits [K, NT, bq, W] int64: bit u % 64 of word u // 64 is set
    when the tile's query of that place chose blocks[..., u]). One Triton launch, no host
    synchronisation; `tile_blocks_ref` is the reference.
    """
    kh, t, k = block_ids.shape
    nt = -(-t // bq)
    sel = block_ids.to(torch.int32).contiguous()
    blocks = torch.full((kh, nt, bq * k), _NONE, device=sel.device, dtype=torch.int32)
    count = torch.empty(kh, nt, device=sel.device, dtype=torch.int32)
    w = -(-bq * k // 64)
    bits = torch.empty(kh, nt, bq, w, device=sel.device, dtype=torch.int64)
    ch, n_chunks = chunking(n_blocks)
    _tile_blocks_kernel[(nt, kh)](
        sel, sel if order is None else order, blocks, count, bits, t, n_blocks, sel.stride(0), sel.stride(1),
        0 if order is None else order.stride(0), blocks.stride(0), blocks.stride(1), count.stride(0),
        bits.stride(0), bits.stride(1), BQ=bq, TOPK=k, KP=pad(k), CH=ch, N_CHUNKS=n_chunks, W=w,
        ORDERED=order is not None,
    )  # fmt: skip
    return blocks, count, bits


def chunking(n_blocks: int) -> tuple[int, int]:
    """(CH, N_CHUNKS) of `_tile_blocks_kernel`: block ids a step, and steps. Both come from
    `pad(n_blocks)`, so one compile serves a whole power-of-two bucket of sequence lengths; the
    steps past n_blocks match no selected block and store nothing."""
    p = pad(n_blocks)
    ch = min(256, p)
    return ch, p // ch


def tile_blocks_ref(
    block_ids: torch.Tensor, bq: int, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tile_blocks` with PyTorch sorts and loops (the reference)."""
    kh, t, k = block_ids.shape
    if order is not None:
        block_ids = torch.stack([block_ids[g, order[g, :t].long()] for g in range(kh)])
    nt = -(-t // bq)
    padded = torch.nn.functional.pad(block_ids, (0, 0, 0, nt * bq - t), value=-1).reshape(kh, nt, bq, k)
    ids = torch.where(padded < 0, _NONE, padded).reshape(kh, nt, bq * k).sort(dim=-1).values
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids = torch.where(repeat, _NONE, ids).sort(dim=-1).values
    w = -(-bq * k // 64)
    bits = torch.zeros(kh, nt, bq, w, dtype=torch.int64)
    for g, tile, query in itertools.product(range(kh), range(nt), range(bq)):
        for u, blk in enumerate(ids[g, tile].tolist()):
            if blk in padded[g, tile, query].tolist():
                bits[g, tile, query, u // 64] |= torch.tensor(1, dtype=torch.int64) << (u % 64)
    return ids.to(torch.int32), (ids < _NONE).sum(-1).to(torch.int32), bits.to(block_ids.device)
