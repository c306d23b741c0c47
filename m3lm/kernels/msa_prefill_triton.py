"""Block-sparse MSA prefill attention (Triton, flash-style), next to `msa.msa_attention_ref`.

One program takes BQ consecutive queries of one KV group (BQ x G rows: every query head of the
group, about 64 rows) and walks only the union of the key blocks its queries selected, listed
ahead of time per tile (`tile_blocks`: sorted, deduplicated). Rows whose query did not select a
block, and keys in a query's future, are masked. Softmax is online in fp32, as in flash
attention, so nothing of size [T, Tk] exists. Adjacent queries select mostly the same blocks, so
the union stays close to k blocks and the work close to the exact sparse product. Without a
selection every visible block is taken: plain causal flash attention.

Shapes: T queries at consecutive positions q_pos, Tk keys at positions 0..Tk-1, H = K x G query
heads, D head dim, S block size, k selected blocks per query and group, NT = ceil(T / BQ) tiles,
U = BQ x k union slots per tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3lm.kernels.host import interpreted, pad, precision

ROWS = 64  # query rows (queries x heads of a group) per program
_NONE = 1 << 30  # padding of the union lists
SCORE_BUDGET = 1 << 26  # fp32 block scores held at once by `msa_select`


@triton.jit
def _attend_block(
    i, count, q, sel, blocks_ptr, k_ptr, v_ptr, kh, s_kt, s_kh, row_ok, pos, tk, qk_scale, m_i, l_i, acc,
    offs_d, D: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, SPARSE: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One key block (the i-th of the tile's list) into the online softmax of every row."""
    live = i < count
    if SPARSE:
        blk = tl.load(blocks_ptr + i, mask=live, other=0)
        take = tl.sum((sel == blk).to(tl.int32), axis=1) > 0  # [RP] rows whose query chose blk
    else:
        blk = i
        take = row_ok
    offs_s = tl.arange(0, SP)
    key_pos = blk * S + offs_s
    key_ok = live & (offs_s < S) & (key_pos < tk)
    d_ok = offs_d[None, :] < D
    kv = key_pos[:, None] * s_kt + kh * s_kh + offs_d[None, :]
    kb = tl.load(k_ptr + kv, mask=key_ok[:, None] & d_ok, other=0.0)
    vb = tl.load(v_ptr + kv, mask=key_ok[:, None] & d_ok, other=0.0)
    s = tl.dot(q, tl.trans(kb), out_dtype=tl.float32, input_precision=PREC) * qk_scale  # [RP, SP]
    keep = take[:, None] & key_ok[None, :] & (key_pos[None, :] <= pos[:, None])
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, out_dtype=tl.float32, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, sel_ptr, blocks_ptr, count_ptr, out_ptr,
    first_pos, t_len, tk, qk_scale,
    s_qt, s_qh, s_kt, s_kh, s_sk, s_st, s_bk, s_bt, s_ck, s_ot, s_oh,
    G: tl.constexpr, BQ: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    S: tl.constexpr, SP: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, SPARSE: tl.constexpr,
    MAX_ITERS: tl.constexpr, DYNAMIC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kh = tl.program_id(1)
    rows = tl.arange(0, RP)
    t = tile * BQ + rows // G  # the query of each row
    row_ok = (rows < BQ * G) & (t < t_len)
    head = kh * G + rows % G
    pos = first_pos + t
    offs_d = tl.arange(0, DP)
    d_ok = offs_d[None, :] < D
    q = tl.load(
        q_ptr + t[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok,
        other=0.0,
    )
    last = tl.minimum(first_pos + tile * BQ + BQ - 1, first_pos + t_len - 1)  # the tile's last query
    if SPARSE:
        offs_k = tl.arange(0, KP)
        sel = tl.load(
            sel_ptr + kh * s_sk + t[:, None] * s_st + offs_k[None, :],
            mask=row_ok[:, None] & (offs_k[None, :] < TOPK),
            other=-1,
        )  # [RP, KP] each row's selected blocks
        count = tl.load(count_ptr + kh * s_ck + tile)
    else:
        count = last // S + 1  # every visible block
        sel = row_ok  # unused
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, DP], tl.float32)
    # Compiled, the loop runs `count` times; Triton's interpreter needs a constant bound, so there
    # it runs MAX_ITERS times with the surplus iterations masked out.
    if DYNAMIC:
        for i in range(0, count):
            m_i, l_i, acc = _attend_block(
                i, count, q, sel, blocks_ptr + kh * s_bk + tile * s_bt, k_ptr, v_ptr, kh, s_kt, s_kh,
                row_ok, pos, tk, qk_scale, m_i, l_i, acc, offs_d, D, S, SP, SPARSE, PREC,
            )  # fmt: skip
    else:
        for i in range(0, MAX_ITERS):
            m_i, l_i, acc = _attend_block(
                i, count, q, sel, blocks_ptr + kh * s_bk + tile * s_bt, k_ptr, v_ptr, kh, s_kt, s_kh,
                row_ok, pos, tk, qk_scale, m_i, l_i, acc, offs_d, D, S, SP, SPARSE, PREC,
            )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padding rows saw no key
    tl.store(
        out_ptr + t[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok,
    )


@triton.jit
def _tile_blocks_kernel(
    sel_ptr, blocks_ptr, count_ptr, t_len, n_blocks, s_sk, s_st, s_bk, s_bt, s_ck,
    BQ: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, CH: tl.constexpr, N_CHUNKS: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kh = tl.program_id(1)
    rows = tl.arange(0, BQ * KP)  # (query, slot) pairs of the tile
    t = tile * BQ + rows // KP
    slot = rows % KP
    sel = tl.load(sel_ptr + kh * s_sk + t * s_st + slot, mask=(t < t_len) & (slot < TOPK), other=-1)
    count = 0
    for c in range(N_CHUNKS):  # blocks c*CH .. c*CH+CH-1: which of them some query of the tile chose
        ids = c * CH + tl.arange(0, CH)
        present = tl.max((sel[:, None] == ids[None, :]).to(tl.int32), axis=0)  # [CH]
        at = count + tl.cumsum(present, axis=0) - 1  # ascending positions in the union list
        tl.store(blocks_ptr + kh * s_bk + tile * s_bt + at, ids, mask=(present > 0) & (ids < n_blocks))
        count += tl.sum(present, axis=0)
    tl.store(count_ptr + kh * s_ck + tile, count)


def tile_blocks(block_ids: torch.Tensor, bq: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of the selected blocks of each tile of `bq` queries, per group.

    block_ids [K, T, k] (-1 = unused), ids below `n_blocks` -> (blocks [K, NT, U] int32
    ascending, padded with a large id; count [K, NT] int32). One Triton launch, no host
    synchronisation; `tile_blocks_ref` is the reference.
    """
    kh, t, k = block_ids.shape
    nt = -(-t // bq)
    sel = block_ids.to(torch.int32).contiguous()
    blocks = torch.full((kh, nt, bq * k), _NONE, device=sel.device, dtype=torch.int32)
    count = torch.empty(kh, nt, device=sel.device, dtype=torch.int32)
    ch = 256
    _tile_blocks_kernel[(nt, kh)](
        sel, blocks, count, t, n_blocks, sel.stride(0), sel.stride(1), blocks.stride(0), blocks.stride(1),
        count.stride(0), BQ=bq, TOPK=k, KP=pad(k), CH=ch, N_CHUNKS=triton.cdiv(n_blocks, ch),
    )  # fmt: skip
    return blocks, count


def tile_blocks_ref(block_ids: torch.Tensor, bq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`tile_blocks` with PyTorch sorts (the reference)."""
    kh, t, k = block_ids.shape
    nt = -(-t // bq)
    ids = torch.nn.functional.pad(block_ids, (0, 0, 0, nt * bq - t), value=-1).reshape(kh, nt, bq * k)
    ids = torch.where(ids < 0, _NONE, ids).sort(dim=-1).values
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids = torch.where(repeat, _NONE, ids).sort(dim=-1).values
    return ids.to(torch.int32), (ids < _NONE).sum(-1).to(torch.int32)


def msa_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    block_ids: torch.Tensor | None = None,
    block_size: int = 128,
    first_pos: int | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Same contract as `msa_attention_ref` for consecutive query positions: [T, H, D] -> [T, H, D].

    `first_pos` (q_pos[0]) may be passed to spare a device read. `block_size` tiles the keys when
    there is no selection (it need not match the MSA block then). `config` is (query rows per
    program, warps, pipeline stages); `benchmarks/prefill_configs.py` picks the default (fp32
    tiles take one stage fewer to fit in shared memory).
    """
    rows, warps, stages = config or ((ROWS, 4, 2) if q.dtype == torch.float32 else (ROWS, 4, 3))
    t_len, n_heads, d = q.shape
    tk, n_kv = k.shape[0], k.shape[1]
    g = n_heads // n_kv
    bq = max(1, rows // g)
    nt = triton.cdiv(t_len, bq)
    first = int(q_pos[0]) if first_pos is None else first_pos
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    sparse = block_ids is not None
    if sparse:
        sel = block_ids.to(torch.int32).contiguous()
        blocks, count = tile_blocks(sel, bq, triton.cdiv(tk, block_size))
        topk, max_iters = sel.shape[-1], blocks.shape[-1]
    else:
        sel = blocks = count = q  # unused pointers
        topk, max_iters = 1, triton.cdiv(first + t_len, block_size)
    strides = (
        (sel.stride(0), sel.stride(1), blocks.stride(0), blocks.stride(1), count.stride(0))
        if sparse
        else (0, 0, 0, 0, 0)
    )
    _prefill_kernel[(nt, n_kv)](
        q, k, v, sel, blocks, count, out, first, t_len, tk, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), *strides, out.stride(0), out.stride(1),
        G=g, BQ=bq, RP=max(16, triton.next_power_of_2(bq * g)), D=d, DP=max(16, triton.next_power_of_2(d)),
        S=block_size, SP=max(16, triton.next_power_of_2(block_size)), TOPK=topk,
        KP=max(2, triton.next_power_of_2(topk)), SPARSE=sparse, MAX_ITERS=max_iters,
        DYNAMIC=not interpreted(),
        PREC=precision(q), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@triton.jit
def _score_block(
    j, count, iq, ik_ptr, s_ikt, tk, pos, out_ptrs, row_ok, offs_d,
    DI: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Max over block j's visible keys of iq . ik for every query of the tile, stored at column j."""
    offs_s = tl.arange(0, SP)
    key_pos = j * S + offs_s
    key_ok = (j < count) & (offs_s < S) & (key_pos < tk)
    ik = tl.load(
        ik_ptr + key_pos[:, None] * s_ikt + offs_d[None, :],
        mask=key_ok[:, None] & (offs_d[None, :] < DI),
        other=0.0,
    )
    s = tl.dot(iq, tl.trans(ik), out_dtype=tl.float32, input_precision=PREC)  # [BT, SP]
    s = tl.where(key_ok[None, :] & (key_pos[None, :] <= pos[:, None]), s, float("-inf"))
    tl.store(out_ptrs + j, tl.max(s, axis=1), mask=row_ok & (j < count))


@triton.jit
def _index_scores_kernel(
    iq_ptr, ik_ptr, out_ptr, first_pos, t_len, tk,
    s_iqt, s_iqh, s_ikt, s_oh, s_ot,
    DI: tl.constexpr, DIP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, BT: tl.constexpr,
    MAX_BLOCKS: tl.constexpr, DYNAMIC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    h = tl.program_id(1)
    t = tile * BT + tl.arange(0, BT)
    row_ok = t < t_len
    pos = first_pos + t
    offs_d = tl.arange(0, DIP)
    iq = tl.load(
        iq_ptr + t[:, None] * s_iqt + h * s_iqh + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d[None, :] < DI),
        other=0.0,
    )
    count = tl.minimum(first_pos + tile * BT + BT - 1, first_pos + t_len - 1) // S + 1
    out_ptrs = out_ptr + h * s_oh + t * s_ot
    if DYNAMIC:  # as in _prefill_kernel: a constant bound in the interpreter
        for j in range(0, count):
            _score_block(j, count, iq, ik_ptr, s_ikt, tk, pos, out_ptrs, row_ok, offs_d, DI, S, SP, PREC)
    else:
        for j in range(0, MAX_BLOCKS):
            _score_block(j, count, iq, ik_ptr, s_ikt, tk, pos, out_ptrs, row_ok, offs_d, DI, S, SP, PREC)


def index_block_scores(iq: torch.Tensor, ik: torch.Tensor, first_pos: int, block_size: int) -> torch.Tensor:
    """`msa.index_block_scores_ref` for consecutive query positions from `first_pos`: [K, T, N] fp32.

    iq [T, K, Di], ik [Tk, Di]; blocks a query cannot see score -inf.
    """
    t_len, n_kv, di = iq.shape
    tk = ik.shape[0]
    n_blocks = triton.cdiv(tk, block_size)
    out = torch.full((n_kv, t_len, n_blocks), float("-inf"), device=iq.device, dtype=torch.float32)
    iq, ik = iq.contiguous(), ik.contiguous()
    bt = 64
    _index_scores_kernel[(triton.cdiv(t_len, bt), n_kv)](
        iq, ik, out, first_pos, t_len, tk, iq.stride(0), iq.stride(1), ik.stride(0), out.stride(0), out.stride(1),
        DI=di, DIP=max(16, triton.next_power_of_2(di)), S=block_size, SP=max(16, triton.next_power_of_2(block_size)),
        BT=bt, MAX_BLOCKS=triton.cdiv(first_pos + t_len, block_size), DYNAMIC=not interpreted(),
        PREC=precision(iq), num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


@triton.jit
def _select_kernel(
    scores_ptr, out_ptr, first_pos, t_len, n_blocks, local, init, s_sk, s_st, s_ok, s_ot,
    S: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """`select_blocks_ref` for BT consecutive queries of one group: top-k by repeated argmax."""
    tile = tl.program_id(0)
    kh = tl.program_id(1)
    t = tile * BT + tl.arange(0, BT)
    row_ok = t < t_len
    qb = (first_pos + t) // S  # [BT] each query's own block
    ids = tl.arange(0, NP)
    visible = (ids[None, :] <= qb[:, None]) & (ids[None, :] < n_blocks) & row_ok[:, None]  # [BT, NP]
    score = tl.load(scores_ptr + kh * s_sk + t[:, None] * s_st + ids[None, :], mask=visible, other=0.0)
    forced = (ids[None, :] > qb[:, None] - local) | (ids[None, :] < init)
    key = tl.where(visible, tl.where(forced, float("inf"), score), float("-inf"))
    taken = tl.zeros([BT, NP], tl.int32)
    for i in range(TOPK):  # the best remaining block of each query; ties to the lower id
        best = tl.argmax(key, axis=1, tie_break_left=True)  # [BT]
        hit = (ids[None, :] == best[:, None]) & (i <= qb[:, None])  # only while blocks are left
        taken = tl.where(hit, 1, taken)
        key = tl.where(hit, float("-inf"), key)
    slots = tl.arange(0, KP)
    out = out_ptr + kh * s_ok + t * s_ot
    tl.store(
        out[:, None] + slots[None, :],
        tl.full([BT, KP], -1, tl.int32),
        mask=row_ok[:, None] & (slots[None, :] < TOPK),
    )
    tl.debug_barrier()
    at = tl.cumsum(taken, axis=1) - 1  # ascending: a block's place among the query's chosen ones
    tl.store(
        out[:, None] + at, ids[None, :] + tl.zeros([BT, NP], tl.int32), mask=(taken > 0) & row_ok[:, None]
    )


def select_blocks(
    scores: torch.Tensor, first_pos: int, block_size: int, topk: int, local: int, init: int
) -> torch.Tensor:
    """`msa.select_blocks_ref` for queries at consecutive positions from `first_pos`, one launch:
    scores [K, T, N] -> block ids [K, T, k] ascending, -1 in unused slots."""
    kh, t_len, n_blocks = scores.shape
    out = torch.empty(kh, t_len, topk, device=scores.device, dtype=torch.int32)
    np_ = pad(n_blocks)
    bt = max(1, min(32, 2048 // np_))
    _select_kernel[(triton.cdiv(t_len, bt), kh)](
        scores, out, first_pos, t_len, n_blocks, local, init, scores.stride(0), scores.stride(1),
        out.stride(0), out.stride(1), S=block_size, TOPK=topk, KP=pad(topk), NP=np_, BT=bt,
        num_warps=4 if np_ * bt <= 4096 else 8,
    )  # fmt: skip
    return out


def msa_select(
    iq: torch.Tensor,
    ik: torch.Tensor,
    q_pos: torch.Tensor,
    block_size: int,
    topk: int,
    local: int,
    init: int,
    first_pos: int | None = None,
) -> torch.Tensor | None:
    """`msa.msa_select_ref` for consecutive query positions, scoring with the Triton kernel."""
    first = int(q_pos[0]) if first_pos is None else first_pos
    if first + iq.shape[0] - 1 < topk * block_size:
        return None
    n_blocks = triton.cdiv(ik.shape[0], block_size)
    step = max(bq := 64, (SCORE_BUDGET // (iq.shape[1] * n_blocks)) // bq * bq)
    out = []
    for s in range(0, iq.shape[0], step):
        scores = index_block_scores(iq[s : s + step], ik, first + s, block_size)  # [K, Tc, N]
        out.append(select_blocks(scores, first + s, block_size, topk, local, init))  # [K, Tc, k]
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)
