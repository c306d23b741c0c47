"""MSA: lightning-indexer block selection and block-sparse attention: the plain PyTorch
references and `msa_select` / `msa_attention`, which take the Triton kernels on the GPU.

Shapes: T queries, Tk keys of one sequence (positions 0..Tk-1), H query heads, K KV heads
(= index heads), G = H / K, D head dim, Di index head dim, S block size, N = ceil(Tk / S) blocks,
k = top-k blocks. Work is split into query chunks so nothing of size [T, Tk] is ever held whole.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# Elements of fp32 scores one query chunk may hold; bounds memory for long sequences.
SCORE_BUDGET = 1 << 24
# Queries per chunk on the CPU, whose chunks read only the keys up to their last query: causal
# attention and selection then cost about half of a square's work.
CPU_QUERY_CHUNK = 256


def _query_chunk(rows_per_query: int, tk: int, device: torch.device | None = None) -> int:
    # A GPU affords 16x larger chunks (256 MiB of fp32 scores): fewer, larger launches.
    if device is not None and device.type == "cuda":
        return max(1, 16 * SCORE_BUDGET // max(1, rows_per_query * tk))
    return max(1, min(CPU_QUERY_CHUNK, SCORE_BUDGET // max(1, rows_per_query * tk)))


def _seen_by_all(q_pos: torch.Tensor, keys: torch.Tensor) -> int:
    """How many leading keys every query sees (none of them masked as its future): up to the
    first position on the CPU, none on the GPU (where a host read would stall the stream)."""
    if keys.is_cuda:
        return 0
    return min(keys.shape[0], int(q_pos.min()))


def _keys_seen(q_pos: torch.Tensor, keys: torch.Tensor) -> int:
    """How many leading keys a chunk of queries can see: up to its last position on the CPU (a
    cheap host read there), all of them on the GPU (where a read would stall the stream)."""
    if keys.is_cuda:
        return keys.shape[0]
    return min(keys.shape[0], int(q_pos.max()) + 1)


def index_block_scores_ref(
    iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, block_size: int, own_block: bool = True
) -> torch.Tensor:
    """Block scores [K, T, N] fp32: max over visible keys j <= t of block b of iq[t, h] . ik[j].

    iq [T, K, Di], ik [Tk, Di], q_pos [T]. Blocks with no visible key score -inf. Without
    `own_block`, the scores of each query's own and later blocks are left as they come (over
    every key): for a selection that forces its own block and never takes a later one.
    """
    tk = ik.shape[0]
    n_blocks = -(-tk // block_size)
    s = torch.einsum("thd,jd->htj", iq.float(), ik.float())  # [K, T, Tk], a new tensor
    if own_block:
        lo = _seen_by_all(q_pos, ik)  # keys before it are no query's future
        future = torch.arange(lo, tk, device=ik.device)[None, :] > q_pos[:, None]  # [T, Tk - lo]
        s[..., lo:].masked_fill_(future[None], float("-inf"))
    if tk % block_size:
        s = torch.nn.functional.pad(s, (0, n_blocks * block_size - tk), value=float("-inf"))
    return s.unflatten(-1, (n_blocks, block_size)).amax(-1)  # [K, T, N]


def select_blocks_ref(
    block_scores: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk: int, local: int, init: int
) -> torch.Tensor:
    """Selected block ids [K, T, k], ascending, -1 in unused slots.

    Visible blocks are 0..t // S. When at most `topk` are visible they are all selected (dense
    causal attention). Otherwise the `local` most recent and the first `init` blocks are forced
    and the other slots go to the best-scoring blocks, ties to the lower block id.
    """
    n_blocks = block_scores.shape[-1]
    ids = torch.arange(n_blocks, device=block_scores.device)
    qb = (q_pos // block_size)[:, None]  # [T, 1]
    visible = ids[None, :] <= qb  # [T, N]
    forced = (ids[None, :] > qb - local) | (ids[None, :] < init)
    key = block_scores.float().masked_fill(forced[None], float("inf"))
    key = key.masked_fill(~visible[None], float("-inf"))  # [K, T, N]
    order = _top(key, topk)  # [K, T, k']
    valid = visible[None].expand_as(key).gather(-1, order)
    chosen = torch.where(valid, order, n_blocks).sort(dim=-1).values
    chosen = chosen.masked_fill(chosen == n_blocks, -1)
    if chosen.shape[-1] < topk:
        chosen = torch.nn.functional.pad(chosen, (0, topk - chosen.shape[-1]), value=-1)
    return chosen


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of fp32 x along its last dim, ties to the lower index: a stable
    descending sort's first k, found by `topk` on int64 keys that order as the values and then
    by index (a sort of every block costs several times more)."""
    n = x.shape[-1]
    bits = (x + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes 0.0, equal as floats
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # as ints, in the order of the floats
    ids = torch.arange(n - 1, -1, -1, device=x.device)  # the lower index, the larger key
    return (ordered.long() * n + ids).topk(min(k, n), dim=-1).indices


def msa_select(
    iq: torch.Tensor,
    ik: torch.Tensor,
    q_pos: torch.Tensor,
    block_size: int,
    topk: int,
    local: int,
    init: int,
    first: int | None = None,
) -> torch.Tensor | None:
    """`msa_select_ref`, scored by a Triton kernel on the GPU (`first`: q_pos[0], known on the host)."""
    if not iq.is_cuda:
        return msa_select_ref(iq, ik, q_pos, block_size, topk, local, init)
    from m3lm.kernels.msa_prefill_triton import msa_select as msa_select_triton

    return msa_select_triton(iq, ik, q_pos, block_size, topk, local, init, first)


def msa_select_ref(
    iq: torch.Tensor,
    ik: torch.Tensor,
    q_pos: torch.Tensor,
    block_size: int,
    topk: int,
    local: int,
    init: int,
) -> torch.Tensor | None:
    """Per-KV-group block selection [K, T, k] for queries iq [T, K, Di] over index keys ik [Tk, Di].

    Returns None when every query sees at most `topk` blocks: attention is then exactly dense.
    """
    if int(q_pos.max()) < topk * block_size:
        return None
    step = _query_chunk(iq.shape[1], ik.shape[0], iq.device)
    out = []
    for s in range(0, iq.shape[0], step):
        pos = q_pos[s : s + step]
        # With a local block the selection forces a query's own block: its score is not needed.
        scores = index_block_scores_ref(
            iq[s : s + step], ik[: _keys_seen(pos, ik)], pos, block_size, local == 0
        )
        out.append(select_blocks_ref(scores, pos, block_size, topk, local, init))
    return torch.cat(out, dim=1)


def msa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    block_ids: torch.Tensor | None = None,
    block_size: int = 0,
    first: int | None = None,
) -> torch.Tensor:
    """Attention of one sequence's queries (`msa_attention_ref`'s function) on fused kernels.

    On the CPU PyTorch's fused attention (`msa_attention_sdpa`). On the GPU a whole sequence with
    no selection takes PyTorch's causal flash kernel; anything else (block-sparse, or a chunk
    after cached keys) the block-sparse Triton kernel.
    """
    if not q.is_cuda:
        return msa_attention_sdpa(q, k, v, q_pos, scale, block_ids, block_size)
    if block_ids is None and k.shape[0] == q.shape[0]:
        return msa_attention_sdpa(q, k, v, q_pos, scale)
    from m3lm.kernels.msa_prefill_triton import msa_prefill_attention

    return msa_prefill_attention(q, k, v, q_pos, scale, block_ids, block_size or 128, first)


def msa_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    block_ids: torch.Tensor | None = None,
    block_size: int = 0,
) -> torch.Tensor:
    """Causal GQA attention, restricted to the selected blocks when `block_ids` is given.

    q [T, H, D], k/v [Tk, K, D], q_pos [T], block_ids [K, T, k] (-1 = unused) -> [T, H, D].
    Query t attends key j when j <= t and (no selection, or block(j) is selected for t's group).
    Softmax and accumulation in fp32.
    """
    t_len, n_heads, _ = q.shape
    tk, n_kv, _ = k.shape
    groups = n_heads // n_kv
    key_pos = torch.arange(tk, device=q.device)
    kf, vf = k.float(), v.float()
    out = torch.empty_like(q)
    step = _query_chunk(n_heads, tk)
    for s in range(0, t_len, step):
        qc = q[s : s + step].float().unflatten(1, (n_kv, groups))  # [Tc, K, G, D]
        scores = torch.einsum("tkgd,jkd->kgtj", qc, kf) * scale  # [K, G, Tc, Tk]
        keep = (key_pos[None, :] <= q_pos[s : s + step, None])[None]  # [1, Tc, Tk]
        if block_ids is not None:
            keep = keep & _block_keep(block_ids[:, s : s + step], tk, block_size)  # [K, Tc, Tk]
        scores = scores.masked_fill(~keep[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        oc = torch.einsum("kgtj,jkd->tkgd", probs, vf)  # [Tc, K, G, D]
        out[s : s + step] = oc.flatten(1, 2).to(q.dtype)
    return out


def _block_keep(block_ids: torch.Tensor, tk: int, block_size: int) -> torch.Tensor:
    """Key mask [K, Tc, Tk] from block ids [K, Tc, k]."""
    return _by_block(block_ids, tk, block_size, True, False, torch.bool)


def _block_bias(block_ids: torch.Tensor, tk: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """`_block_keep` as an additive mask (0 or -inf), as the fused kernel takes it."""
    return _by_block(block_ids, tk, block_size, 0.0, float("-inf"), dtype)


def _by_block(block_ids: torch.Tensor, tk: int, block_size: int, selected, other, dtype) -> torch.Tensor:
    """A new [K, Tc, Tk] from block ids [K, Tc, k] (-1 = unused): `selected` on the keys of each
    query's selected blocks, `other` elsewhere."""
    n_blocks = -(-tk // block_size)
    safe = block_ids.masked_fill(block_ids < 0, n_blocks)  # unused slots: a spare block
    per_block = torch.full((*block_ids.shape[:2], n_blocks + 1), other, dtype=dtype, device=block_ids.device)
    per_block.scatter_(-1, safe, selected)
    # Each block's value repeated over its keys (one copy, not a gather by key).
    keys = per_block[..., :n_blocks, None].expand(*per_block.shape[:2], n_blocks, block_size)
    return keys.reshape(*per_block.shape[:2], -1)[..., :tk]  # [K, Tc, Tk]


# cuDNN's fused attention builds a plan on the host for each new shape (about 10 ms, inside a
# serving step); flash and memory-efficient kernels take any length as a runtime argument.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def msa_attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    block_ids: torch.Tensor | None = None,
    block_size: int = 0,
) -> torch.Tensor:
    """`msa_attention_ref` on PyTorch's fused attention (flash / memory-efficient kernels, never cuDNN's).

    Each KV group is one batch entry of G query heads; the causal and block masks are built per
    query chunk ([K, 1, Tc, Tk] booleans), so memory stays bounded. A prefill from position 0
    with no block selection takes the causal flash path with no mask at all.
    """
    t_len, n_heads, d = q.shape
    tk, n_kv, _ = k.shape
    g = n_heads // n_kv
    qg = q.view(t_len, n_kv, g, d).permute(1, 2, 0, 3)  # [K, G, T, D]
    kg = k.permute(1, 0, 2)[:, None].expand(n_kv, g, tk, d)  # [K, G, Tk, D]
    vg = v.permute(1, 0, 2)[:, None].expand(n_kv, g, tk, d)
    with sdpa_kernel(SDPA_BACKENDS):
        return (
            _sdpa(qg, kg, vg, q_pos, scale, block_ids, block_size)
            .permute(2, 0, 1, 3)
            .reshape(t_len, n_heads, d)
        )


def _sdpa(qg, kg, vg, q_pos, scale, block_ids, block_size) -> torch.Tensor:
    """`msa_attention_sdpa` on grouped heads: qg [K, G, T, D], kg and vg [K, G, Tk, D] -> [K, G, T, D]."""
    n_kv, _, t_len, _ = qg.shape
    tk = kg.shape[2]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if block_ids is None and tk == t_len:
        return sdpa(qg, kg, vg, is_causal=True, scale=scale)  # positions 0..T-1 against themselves
    key_pos = torch.arange(tk, device=qg.device)
    out = torch.empty_like(qg)
    step = max(1, (1 << 28) // max(1, n_kv * tk)) if qg.is_cuda else _query_chunk(n_kv, tk)
    for s in range(0, t_len, step):
        pos = q_pos[s : s + step]
        end = _keys_seen(pos, key_pos)  # the keys past the chunk's last query are masked: left out
        # An additive mask (0 or -inf), which the fused kernel reads as it is (a boolean one it
        # converts first).
        if block_ids is None:
            bias = qg.new_zeros(1, pos.shape[0], end)
        else:
            bias = _block_bias(block_ids[:, s : s + step], end, block_size, qg.dtype)  # [K, Tc, end]
        lo = _seen_by_all(pos, key_pos)  # only from there may a key be past a query
        bias[..., lo:end].masked_fill_((key_pos[None, lo:end] > pos[:, None])[None], float("-inf"))
        mask = bias.expand(n_kv, -1, -1)[:, None]  # [K, 1, Tc, end]
        kc, vc = kg[:, :, :end], vg[:, :, :end]
        out[:, :, s : s + step] = sdpa(qg[:, :, s : s + step], kc, vc, attn_mask=mask, scale=scale)
    return out
