"""Block-sparse MSA prefill attention (Triton, flash-style), next to `msa.msa_attention_ref`.

One program takes BQ queries of one KV group (BQ x G rows: every query head of the group, about
64 rows; queries whose selections overlap, `msa_tiles.group_queries`) and walks only the union of
the key blocks its queries selected, listed ahead of time per tile (`msa_tiles.tile_blocks`:
sorted, deduplicated, with a bit per query and union slot), BN keys a step (64: half a block, so
that two programs share an SM and one's softmax runs under the other's matrix products). Rows
whose query did not select a block, and keys in a query's future, are masked: by row (a bias in
the exponent) on steps before the tile's first query, by score on the others; the last block's
steps past the tile's last query are skipped. Softmax is online in fp32, as in flash attention,
so nothing of size [T, Tk] exists. Adjacent queries of a trained model select mostly the same
blocks, so the union stays close to k blocks and the work close to the exact sparse product.
Without a selection every visible block is taken: plain causal flash attention. On Hopper GPUs
each step's K and V rows come by tensor-memory (TMA) copies (`tma_ok`), which spares the
registers and instructions of per-thread loads.

Shapes: T queries at consecutive positions q_pos, Tk keys at positions 0..Tk-1, H = K x G query
heads, D head dim, S block size, k selected blocks per query and group, NT = ceil(T / BQ) tiles,
U = BQ x k union slots per tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3lm.kernels.host import interpreted, pad, precision
from m3lm.kernels.msa_tiles import group_queries, tile_blocks

ROWS = 64  # query rows (queries x heads of a group) per program
# (query rows, warps, pipeline stages, keys per step): 64 keys a step keep two programs on an SM
CONFIG = (ROWS, 4, 3, 64)
CONFIG_FP32 = (ROWS, 4, 2, 64)
_FAR = tl.constexpr(1 << 30)  # a key position past every query (masked keys)
SCORE_BUDGET = 1 << 26  # fp32 block scores held at once by `msa_select`


@triton.jit
def _attend_block(
    j, n_iter, q, bits, blocks_ptr, k_ptr, v_ptr, k_desc, v_desc, kh, s_kt, s_kh, row_ok, pos, pos_min, tk,
    qk_scale, m_i, l_i, acc, offs_d, D: tl.constexpr, S: tl.constexpr, BN: tl.constexpr, NSUB: tl.constexpr,
    SPARSE: tl.constexpr, W: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr, ROW_MASKS: tl.constexpr,
):  # fmt: skip
    """Keys BN at a time: sub-block j % NSUB of the (j // NSUB)-th block of the tile's list, into
    the online softmax of every row. `bits`: each row's word of `tile_blocks`' bits (W = 1) or
    pointers to its words. TMA: K and V rows come by tensor-memory copies ([Tk, K*D] descriptors;
    rows past Tk read as zeros) instead of per-thread loads. ROW_MASKS: a step whose keys every
    row sees up to its own position (all but a tile's last blocks) masks whole rows, by a bias of
    0 or -inf folded into the exponent's multiply-add, instead of a compare and select per score;
    the outputs are the same bit for bit while q and k are finite (a NaN or inf key would reach
    the rows of its tile that did not choose its block, which the compare keeps from it)."""
    i = j // NSUB
    live = j < n_iter
    if SPARSE:
        blk = tl.load(blocks_ptr + i, mask=live, other=0)
        word = bits if W == 1 else tl.load(bits + i // 64, mask=row_ok, other=0)
        take = ((word >> (i % 64).to(tl.int64)) & 1) != 0  # [RP] rows whose query chose blk
    else:
        blk = i
        take = row_ok
    sub = (j % NSUB) * BN
    offs_s = sub + tl.arange(0, BN)  # offsets inside the block
    key_pos = blk * S + offs_s
    key_ok = live & (offs_s < S) & (key_pos < tk)
    d_ok = offs_d[None, :] < D
    if TMA:
        row = blk * S + (j % NSUB) * BN
        kb = k_desc.load([row, kh * D])
        vb = v_desc.load([row, kh * D])
    else:
        kv = key_pos[:, None] * s_kt + kh * s_kh + offs_d[None, :]
        kb = tl.load(k_ptr + kv, mask=key_ok[:, None] & d_ok, other=0.0)
        vb = tl.load(v_ptr + kv, mask=key_ok[:, None] & d_ok, other=0.0)
    s = tl.dot(q, tl.trans(kb), out_dtype=tl.float32, input_precision=PREC)  # [RP, BN]
    bias = tl.where(take, 0.0, float("-inf"))  # [RP]
    last_key = blk * S + sub + BN - 1
    edge = ~live | (sub + BN > S) | (last_key >= tk) | (last_key > pos_min)
    if edge or not ROW_MASKS:
        # A row keeps the keys it chose, up to its own position: one compare per score.
        lim = tl.where(take, pos, -1)  # [RP] the last key each row keeps
        s = tl.where(tl.where(key_ok, key_pos, _FAR)[None, :] <= lim[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale + bias)  # running max, in log2 units
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * qk_scale + (bias - m_safe)[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, out_dtype=tl.float32, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["first_pos", "t_len", "tk", "s_rk", "s_wk", "s_bk", "s_ck"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, order_ptr, bits_ptr, blocks_ptr, count_ptr, out_ptr,
    first_pos, t_len, tk, qk_scale,
    s_qt, s_qh, s_kt, s_kh, s_rk, s_wk, s_wt, s_bk, s_bt, s_ck, s_ot, s_oh,
    G: tl.constexpr, BQ: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    S: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, SPARSE: tl.constexpr, ORDERED: tl.constexpr,
    MAX_ITERS: tl.constexpr, DYNAMIC: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    ROW_MASKS: tl.constexpr,
):  # fmt: skip
    NSUB: tl.constexpr = (S + BN - 1) // BN  # key sub-blocks per block
    tile = tl.program_id(0)
    kh = tl.program_id(1)
    rows = tl.arange(0, RP)
    at_q = tile * BQ + rows // G  # each row's query's place in the order
    row_ok = (rows < BQ * G) & (at_q < t_len)
    # the query of each row (the tile's queries from `group_queries`, or consecutive ones)
    t = tl.load(order_ptr + kh * s_rk + at_q, mask=row_ok, other=0) if ORDERED else at_q
    head = kh * G + rows % G
    pos = first_pos + t
    offs_d = tl.arange(0, DP)
    d_ok = offs_d[None, :] < D
    q = tl.load(
        q_ptr + t[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok,
        other=0.0,
    )
    if ORDERED:
        last = tl.max(tl.where(row_ok, pos, 0), axis=0)  # the tile's last query
    else:
        last = tl.minimum(first_pos + tile * BQ + BQ - 1, first_pos + t_len - 1)
    if SPARSE:
        bits = bits_ptr + kh * s_wk + tile * s_wt + (rows // G) * W  # [RP] each row's query's words
        if W == 1:
            bits = tl.load(bits, mask=row_ok, other=0)
        count = tl.load(count_ptr + kh * s_ck + tile)
        top = tl.load(
            blocks_ptr + kh * s_bk + tile * s_bt + count - 1, mask=count > 0, other=0
        )  # the last block
    else:
        count = last // S + 1  # every visible block
        top = count - 1
        bits = row_ok  # unused
    # The last block's sub-blocks past the tile's last query are skipped.
    n_iter = tl.where(count > 0, (count - 1) * NSUB + tl.minimum((last - top * S) // BN + 1, NSUB), 0)
    pos_min = tl.min(tl.where(row_ok, pos, _FAR), axis=0)  # the tile's first query
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, DP], tl.float32)
    # Compiled, the loop runs `n_iter` times; Triton's interpreter needs a constant bound, so there
    # it runs MAX_ITERS times with the surplus iterations masked out.
    for j in range(0, n_iter if DYNAMIC else MAX_ITERS):
        m_i, l_i, acc = _attend_block(
            j, n_iter, q, bits, blocks_ptr + kh * s_bk + tile * s_bt, k_ptr, v_ptr, k_desc, v_desc, kh, s_kt,
            s_kh, row_ok, pos, pos_min, tk, qk_scale, m_i, l_i, acc, offs_d, D, S, BN, NSUB, SPARSE, W, PREC,
            TMA, ROW_MASKS,
        )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padding rows saw no key
    tl.store(
        out_ptr + t[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok,
    )


def msa_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    block_ids: torch.Tensor | None = None,
    block_size: int = 128,
    first_pos: int | None = None,
    config: tuple[int, int, int, int] | None = None,
    tma: bool | None = None,
    grouped: bool = True,
    row_masks: bool = True,
) -> torch.Tensor:
    """Same contract as `msa_attention_ref` for consecutive query positions: [T, H, D] -> [T, H, D].

    `first_pos` (q_pos[0]) may be passed to spare a device read. `block_size` tiles the keys when
    there is no selection (it need not match the MSA block then). `config` is (query rows per
    program, warps, pipeline stages, keys per step); `benchmarks/tune/prefill_configs.py` picks the
    default (fp32 tiles take one stage fewer to fit in shared memory). `tma`: K and V by
    tensor-memory copies (default: where `tma_ok`); the products are the same bit for bit, and
    the kernel holds fewer registers and issues fewer instructions than with per-thread loads.
    `grouped`: a selection's tiles take queries with overlapping blocks (`group_queries`) rather
    than consecutive ones; the outputs are the same. `row_masks`: steps that every row sees whole
    mask by row, not by score (`_attend_block`); the outputs are the same bit for bit (for finite
    q and k).
    """
    rows, warps, stages, keys = config or (CONFIG_FP32 if q.dtype == torch.float32 else CONFIG)
    t_len, n_heads, d = q.shape
    tk, n_kv = k.shape[0], k.shape[1]
    g = n_heads // n_kv
    bq = max(1, rows // g)
    nt = triton.cdiv(t_len, bq)
    first = int(q_pos[0]) if first_pos is None else first_pos
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    sparse = block_ids is not None
    order = group_queries(block_ids, bq) if sparse and grouped else None
    if sparse:
        blocks, count, bits = tile_blocks(block_ids, bq, triton.cdiv(tk, block_size), order)
        max_blocks = blocks.shape[-1]
    else:
        bits = blocks = count = q  # unused pointers
        max_blocks = triton.cdiv(first + t_len, block_size)
    bn = min(keys, max(16, triton.next_power_of_2(block_size)))
    strides = (
        (bits.stride(0), bits.stride(1), blocks.stride(0), blocks.stride(1), count.stride(0))
        if sparse
        else (0, 0, 0, 0, 0)
    )
    # Only the interpreter runs to MAX_ITERS; compiled, a length-dependent constant would build
    # one kernel per prompt length, so it is fixed there.
    max_iters = max_blocks * triton.cdiv(block_size, bn) if interpreted() else 1
    use_tma = tma_ok(k) if tma is None else tma
    k_desc, v_desc = (_kv_desc(k, bn), _kv_desc(v, bn)) if use_tma else (k, v)  # (k, v): unused
    _prefill_kernel[(nt, n_kv)](
        q, k, v, k_desc, v_desc, q if order is None else order, bits, blocks, count, out, first, t_len, tk,
        scale * 1.4426950408889634, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        0 if order is None else order.stride(0), *strides, out.stride(0), out.stride(1),
        G=g, BQ=bq, RP=max(16, triton.next_power_of_2(bq * g)), D=d, DP=max(16, triton.next_power_of_2(d)),
        S=block_size, BN=bn, W=bits.shape[-1] if sparse else 1, SPARSE=sparse, ORDERED=order is not None,
        MAX_ITERS=max_iters,
        DYNAMIC=not interpreted(),
        PREC=precision(q), TMA=use_tma, ROW_MASKS=row_masks, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def tma_ok(k: torch.Tensor) -> bool:
    """Whether K and V [Tk, K, D] can come by tensor-memory copies: 16-bit on a Hopper or later
    GPU (compiled, not interpreted), D a power of two, rows 16-byte aligned."""
    return (
        k.is_cuda
        and not interpreted()
        and k.dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(k.device)[0] >= 9
        and k.shape[-1] == pad(k.shape[-1]) <= 256  # a copy's box is at most 256 wide
        and k.data_ptr() % 16 == 0
        and k.stride(0) * k.element_size() % 16 == 0
    )


def _kv_desc(x: torch.Tensor, keys: int):
    """A [Tk, K*D] tensor-memory descriptor of contiguous x [Tk, K, D], `keys` rows x D a copy."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    tk, n_kv, d = x.shape
    return TensorDescriptor.from_tensor(x.view(tk, n_kv * d), [keys, d])


@triton.jit
def _score_block(
    j, count, iq, ik_ptr, s_ikt, tk, pos, out_ptrs, row_ok, offs_d,
    DI: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Max over block j's visible keys of iq . ik for every row of the tile, stored at column j."""
    offs_s = tl.arange(0, SP)
    key_pos = j * S + offs_s
    key_ok = (j < count) & (offs_s < S) & (key_pos < tk)
    ik = tl.load(
        ik_ptr + key_pos[:, None] * s_ikt + offs_d[None, :],
        mask=key_ok[:, None] & (offs_d[None, :] < DI),
        other=0.0,
    )
    s = tl.dot(iq, tl.trans(ik), out_dtype=tl.float32, input_precision=PREC)  # [R, SP]
    s = tl.where(key_ok[None, :] & (key_pos[None, :] <= pos[:, None]), s, float("-inf"))
    tl.store(out_ptrs + j, tl.max(s, axis=1), mask=row_ok & (j < count))


@triton.jit(do_not_specialize=["first_pos", "t_len", "tk", "s_oh", "s_ot"])
def _index_scores_kernel(
    iq_ptr, ik_ptr, out_ptr, first_pos, t_len, tk,
    s_iqt, s_iqh, s_ikt, s_oh, s_ot,
    KH: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
    BT: tl.constexpr, RP: tl.constexpr, CHUNK: tl.constexpr, DYNAMIC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """BT queries x every index head (BT x KH rows, padded to RP) against key blocks CHUNK * c ..
    CHUNK * (c + 1) - 1, c = program_id(1): each key block loaded once for all heads, and no
    program walks more than CHUNK blocks (each block's score is its own max, so the chunks need
    no merging, and the last queries' long rows do not set the kernel's time)."""
    tile = tl.program_id(0)
    first = tl.program_id(1) * CHUNK
    count = tl.minimum(first_pos + tile * BT + BT - 1, first_pos + t_len - 1) // S + 1  # blocks seen
    if first < count:
        rows = tl.arange(0, RP)
        t = tile * BT + rows // KH
        h = rows % KH
        row_ok = (rows < BT * KH) & (t < t_len)
        pos = first_pos + t
        offs_d = tl.arange(0, DIP)
        iq = tl.load(
            iq_ptr + t[:, None] * s_iqt + h[:, None] * s_iqh + offs_d[None, :],
            mask=row_ok[:, None] & (offs_d[None, :] < DI),
            other=0.0,
        )
        out_ptrs = out_ptr + h * s_oh + t * s_ot
        if DYNAMIC:  # as in _prefill_kernel: a constant bound in the interpreter
            for j in range(first, tl.minimum(count, first + CHUNK)):
                _score_block(j, count, iq, ik_ptr, s_ikt, tk, pos, out_ptrs, row_ok, offs_d, DI, S, SP, PREC)
        else:
            for jj in range(0, CHUNK):
                _score_block(
                    first + jj, count, iq, ik_ptr, s_ikt, tk, pos, out_ptrs, row_ok, offs_d, DI, S, SP, PREC
                )


# (rows: queries x index heads, warps, stages, key blocks) of a program
SCORES_CONFIG = (128, 4, 2, 16)


def index_block_scores(
    iq: torch.Tensor,
    ik: torch.Tensor,
    first_pos: int,
    block_size: int,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """`msa.index_block_scores_ref` for consecutive query positions from `first_pos`: [K, T, N] fp32.

    iq [T, K, Di], ik [Tk, Di]; blocks a query cannot see score -inf. `config`: (rows of a
    program, as queries x index heads; warps; stages; key blocks a program scores at most),
    default `SCORES_CONFIG`.
    """
    t_len, n_kv, di = iq.shape
    tk = ik.shape[0]
    n_blocks = triton.cdiv(tk, block_size)
    out = torch.full((n_kv, t_len, n_blocks), float("-inf"), device=iq.device, dtype=torch.float32)
    iq, ik = iq.contiguous(), ik.contiguous()
    rows, warps, stages, chunk = config or SCORES_CONFIG
    bt = max(1, rows // n_kv)
    _index_scores_kernel[(triton.cdiv(t_len, bt), triton.cdiv(n_blocks, chunk))](
        iq, ik, out, first_pos, t_len, tk, iq.stride(0), iq.stride(1), ik.stride(0), out.stride(0), out.stride(1),
        KH=n_kv, DI=di, DIP=max(16, triton.next_power_of_2(di)), S=block_size,
        SP=max(16, triton.next_power_of_2(block_size)), BT=bt, RP=max(16, triton.next_power_of_2(bt * n_kv)),
        CHUNK=chunk, DYNAMIC=not interpreted(), PREC=precision(iq), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["first_pos", "t_len", "n_blocks", "s_sk", "s_st", "s_ok"])
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
