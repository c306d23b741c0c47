"""`m3lm bench --attention T`: one sparse layer's MSA attention against dense causal flash attention.

The block-sparse Triton prefill kernel and PyTorch SDPA's flash backend run on the same q, k, v
of the release's dimensions; the selection comes from one of two kinds of index scores (see
`selection`), and each row reports the mean number of blocks a 4-query tile walks.
"""

from __future__ import annotations

import math

import torch

from m3lm.models.minimax_m3 import MiniMaxM3


def selection(kind: str, k: int, length: int, s: int, a, gen: torch.Generator) -> torch.Tensor:
    """Block selection [K, T, k] from index scores of one of two kinds.

    "random": scores drawn independently for every query, so adjacent queries share only their
    forced blocks (the worst case for a tile of queries). "drift": index queries that drift
    slowly along the sequence (a random walk), as a trained indexer's inputs do, scored against
    random index keys with the real max-over-block rule.
    """
    from m3lm.kernels.msa import select_blocks_ref
    from m3lm.kernels.msa_prefill_triton import msa_select

    pos = torch.arange(length, device="cuda")
    n_blocks = math.ceil(length / s)
    if kind == "random":
        scores = torch.randn(k, length, n_blocks, device="cuda", generator=gen)
        return select_blocks_ref(
            scores, pos, s, a.index_topk_blocks, a.index_local_blocks, a.index_init_blocks
        )
    steps = torch.randn(length, k, a.index_head_dim, device="cuda", generator=gen) * 0.05
    iq = (torch.randn(1, k, a.index_head_dim, device="cuda", generator=gen) + steps.cumsum(0)).bfloat16()
    ik = torch.randn(length, a.index_head_dim, device="cuda", generator=gen).bfloat16()
    return msa_select(iq, ik, pos, s, a.index_topk_blocks, a.index_local_blocks, a.index_init_blocks, 0)


def bench_attention(
    model: MiniMaxM3, length: int, iters: int, timer
) -> list[tuple[str, float, int, float, float]]:
    """One sparse layer's attention at `length` tokens: the block-sparse Triton prefill kernel
    against dense causal flash attention (SDPA) on the same q, k, v, for two kinds of selection.
    Rows of (case, ms, tokens, FLOPs, dense ms); `timer(fn, iters)` gives a call's median ms."""
    from m3lm.kernels.msa_prefill_triton import ROWS, msa_prefill_attention
    from m3lm.kernels.msa_tiles import group_queries, tile_blocks

    a = model.args
    gen = torch.Generator(device="cuda").manual_seed(2)
    h, k, d, s = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.index_block_size
    q = torch.randn(length, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    kk, vv = (torch.randn(length, k, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    pos = torch.arange(length, device="cuda")
    qd = q.permute(1, 0, 2)[None]
    kd, vd = (t.permute(1, 0, 2)[None].repeat_interleave(h // k, dim=1) for t in (kk, vv))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        dense_ms = timer(lambda: sdpa(qd, kd, vd, is_causal=True), iters)
    keys = sum(min(t + 1, a.dense_window) for t in range(0, length, 64)) * 64
    rows = []
    for kind in ("drift", "random"):
        sel = selection(kind, k, length, s, a, gen)
        bq = max(1, ROWS // (h // k))
        union = float(tile_blocks(sel, bq, -(-length // s), group_queries(sel, bq))[1].float().mean())
        ms = timer(lambda: msa_prefill_attention(q, kk, vv, pos, d**-0.5, sel, s, 0), iters)  # noqa: B023
        case = f"MSA attention T={length}, {kind} selection ({union:.1f} blocks per tile)"
        rows.append((case, ms, length, 4 * keys * h * d, dense_ms))
    return rows
