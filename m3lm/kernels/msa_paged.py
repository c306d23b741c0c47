"""MSA decode over the paged caches in plain PyTorch: the CPU's batched decode step.

The same three calls as `msa_triton.py` (index scores, selection, attention), with the same
arguments and results, for B sequences at once: each is a few whole-batch ops, gathering only the
pages a row needs, with no loop over sequences and no host synchronisation. Each computes what
`msa.py`'s references compute for a query at position len - 1 (the same products, masks and
fp32 softmax; only the order of the sums may differ). Shapes as in `msa_triton.py`: B rows, H
query heads, K KV heads (= index heads), G = H / K, D head dim, Di index head dim, S page size,
P pages, MAXP pages per row of the block table, k selected blocks.
"""

from __future__ import annotations

import torch

from m3lm.kernels.msa import select_blocks_ref


def index_block_scores(
    iq: torch.Tensor,
    ik_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    ik_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """iq [B, K, Di], ik_pool [P, S, Di], tables [B, MAXP], lens [B] -> [B, K, MAXP] fp32: the max
    over each page's visible keys of iq . ik; pages past a row's length are -inf. With ik_scale
    [P, S] the pool holds e4m3 keys, key = pool * scale."""
    b, maxp = tables.shape
    keys = _pages(ik_pool, tables).float()  # [B, MAXP, S, Di]
    if ik_scale is not None:
        keys = keys * _pages(ik_scale, tables)[..., None]
    s = _matmul(iq.float(), keys.view(b, -1, keys.shape[-1]).transpose(1, 2))  # [B, K, MAXP*S]
    s = s.masked_fill(~_visible(lens, maxp * keys.shape[2])[:, None], float("-inf"))
    return s.view(b, -1, maxp, keys.shape[2]).amax(-1)


def select_blocks(
    scores: torch.Tensor, lens: torch.Tensor, block_size: int, topk: int, local: int, init: int
) -> torch.Tensor:
    """Per-group block selection [B, K, topk] from scores [B, K, MAXP] (-1 = unused slot): the rule
    of `select_blocks_ref` for each row's query at position len - 1 (ids ascending)."""
    pos = lens.long() - 1
    return select_blocks_ref(scores.transpose(0, 1), pos, block_size, topk, local, init).transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    block_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: q [B, H, D] over pools [P, S, K, D] -> [B, H, D] in q's dtype.

    With block_ids [B, K, k] each KV group reads only its selected pages; without, every page of
    the table (keys at or past a row's length masked). Softmax and accumulation in fp32."""
    b, h, d = q.shape
    s, n_kv = k_pool.shape[1], k_pool.shape[2]
    qg = q.float().view(b, n_kv, h // n_kv, d)  # [B, K, G, D]
    if block_ids is None:
        maxp = tables.shape[1]
        keys, values = _pages(k_pool, tables).float(), _pages(v_pool, tables).float()  # [B, MAXP, S, K, D]
        keys, values = (
            t.view(b, maxp * s, n_kv, d).transpose(1, 2) for t in (keys, values)
        )  # [B, K, MAXP*S, D]
        keep = _visible(lens, maxp * s)[:, None, None]  # [B, 1, 1, MAXP*S]
    else:
        blocks = block_ids.long()  # [B, K, k]
        pages = tables.long().gather(1, blocks.clamp(min=0).flatten(1)).view_as(blocks)
        group = torch.arange(n_kv, device=q.device)[None, :, None]  # [1, K, 1]
        keys, values = k_pool[pages, :, group].float(), v_pool[pages, :, group].float()  # [B, K, k, S, D]
        keys, values = keys.flatten(2, 3), values.flatten(2, 3)  # [B, K, k*S, D]
        at = blocks[..., None] * s + torch.arange(s, device=q.device)  # [B, K, k, S] positions
        keep = ((blocks[..., None] >= 0) & (at < lens.long()[:, None, None, None])).flatten(2)[:, :, None]
    scores = _matmul(qg, keys.transpose(-1, -2)) * scale  # [B, K, G, n]
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    return _matmul(probs, values).reshape(b, h, d).to(q.dtype)  # [B, K, G, D] -> [B, H, D]


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, N] @ b [..., N, O]. In a compiled step as products and sums: the compiler fuses
    them with the page gathers before them into one loop, where a matrix product would be a
    library call on gathered copies, slower than its arithmetic at a decode step's sizes."""
    if torch.compiler.is_compiling():
        return (a[..., :, :, None] * b[..., None, :, :]).sum(-2)
    return torch.matmul(a, b)


def _pages(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """pool [P, ...] -> [B, MAXP, ...]: the pages of each row's table (one gather of whole pages)."""
    return pool.flatten(1).index_select(0, tables.flatten()).view(*tables.shape, *pool.shape[1:])


def _visible(lens: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n]: whether each of positions 0..n-1 of each row is below its length."""
    return torch.arange(n, device=lens.device)[None] < lens[:, None]
