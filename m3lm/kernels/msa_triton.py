"""Triton kernels for MSA decode over the paged caches (GPU), next to `msa.py`'s references.

Shapes: B sequences decoding one token each, H query heads, K KV heads (= index heads),
G = H / K, D head dim, Di index head dim, S page size (= MSA block), P pages, MAXP pages per
sequence in the block table, k selected blocks. A sequence's keys are positions 0..len-1;
its page i holds positions S*i .. S*i+S-1.

- `index_block_scores`: [B, K, MAXP] max over each page's visible keys of iq . ik (fp32);
  pages past the sequence are -inf.
- `select_blocks`: per-KV-group top-k of those scores with the forced local/init blocks, the same
  rule as `select_blocks_ref` (ties to the lower block id, -1 in unused slots; ids not sorted),
  in one launch.
- `paged_attention`: one query per sequence over the selected pages (or all of them: dense),
  split over blocks for parallelism, online softmax in fp32, then a combine kernel.
Everything takes device tensors and does no host synchronisation (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3lm.kernels.host import pad, precision, sm_count


@triton.jit
def _index_scores_kernel(
    iq_ptr, ik_ptr, iks_ptr, tables_ptr, lens_ptr, out_ptr,
    s_iqb, s_iqh, s_ikp, s_iks, s_tb, s_ob, s_oh,
    K: tl.constexpr, KP: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
    PREC: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    blk = tl.program_id(1)
    length = tl.load(lens_ptr + b)
    offs_h = tl.arange(0, KP)
    offs_d = tl.arange(0, DIP)
    offs_s = tl.arange(0, SP)
    if blk * S < length:
        page = tl.load(tables_ptr + b * s_tb + blk).to(tl.int64)  # page x stride passes 2^31 in big pools
        d_ok = offs_d[None, :] < DI
        iq = tl.load(
            iq_ptr + b * s_iqb + offs_h[:, None] * s_iqh + offs_d[None, :],
            mask=(offs_h[:, None] < K) & d_ok,
            other=0.0,
        )
        ik = tl.load(
            ik_ptr + page * s_ikp + offs_s[:, None] * s_iks + offs_d[None, :],
            mask=(offs_s[:, None] < S) & d_ok,
            other=0.0,
        )
        if FP8:  # e4m3 keys: exact in iq's dtype; their per-position scale multiplies the scores
            ik = ik.to(iq.dtype)
        s = tl.dot(iq, tl.trans(ik), out_dtype=tl.float32, input_precision=PREC)  # [KP, SP]
        if FP8:
            s = s * tl.load(iks_ptr + page * S + offs_s, mask=offs_s < S, other=0.0)[None, :]
        s = tl.where((offs_s[None, :] < S) & ((blk * S + offs_s)[None, :] < length), s, float("-inf"))
        best = tl.max(s, axis=1)
    else:
        best = tl.full([KP], float("-inf"), tl.float32)
    tl.store(out_ptr + b * s_ob + offs_h * s_oh + blk, best, mask=offs_h < K)


def index_block_scores(
    iq: torch.Tensor,
    ik_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    ik_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """iq [B, K, Di], ik_pool [P, S, Di], tables [B, MAXP] int32, lens [B] int32 -> [B, K, MAXP] fp32.

    With ik_scale [P, S] fp32 (contiguous) the pool holds e4m3 keys, key = pool * scale."""
    b, k, di = iq.shape
    maxp = tables.shape[1]
    out = torch.empty(b, k, maxp, device=iq.device, dtype=torch.float32)
    iq = iq.contiguous()
    _index_scores_kernel[(b, maxp)](
        iq, ik_pool, ik_scale if ik_scale is not None else out, tables, lens, out,
        iq.stride(0), iq.stride(1), ik_pool.stride(0), ik_pool.stride(1), tables.stride(0), out.stride(0), out.stride(1),
        K=k, KP=max(16, triton.next_power_of_2(k)), DI=di, DIP=pad(di), S=ik_pool.shape[1],
        SP=pad(ik_pool.shape[1]), PREC=precision(iq), FP8=ik_scale is not None,
    )  # fmt: skip
    return out


@triton.jit
def _select_kernel(
    scores_ptr, lens_ptr, out_ptr, maxp, local, init,
    s_sb, s_sk, s_ob, s_ok,
    S: tl.constexpr, TOPK: tl.constexpr, KOUT: tl.constexpr, NP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kh = tl.program_id(1)
    qb = (tl.load(lens_ptr + b) - 1) // S  # the query's own block
    ids = tl.arange(0, NP)
    visible = (ids <= qb) & (ids < maxp)
    score = tl.load(scores_ptr + b * s_sb + kh * s_sk + ids, mask=ids < maxp, other=float("-inf"))
    forced = ((ids > qb - local) | (ids < init)) & visible
    key = tl.where(forced, float("inf"), tl.where(visible, score, float("-inf")))
    n_visible = tl.minimum(qb + 1, maxp)
    offs = tl.arange(0, KOUT)
    chosen = tl.full([KOUT], -1, tl.int32)
    for i in range(TOPK):  # the best remaining block; ties to the lower id, as a stable sort
        best = tl.argmax(key, axis=0, tie_break_left=True).to(tl.int32)
        chosen = tl.where((offs == i) & (i < n_visible), best, chosen)
        key = tl.where(ids == best, float("-inf"), key)
    tl.store(out_ptr + b * s_ob + kh * s_ok + offs, chosen, mask=offs < TOPK)


def select_blocks(
    scores: torch.Tensor, lens: torch.Tensor, block_size: int, topk: int, local: int, init: int
) -> torch.Tensor:
    """Per-group block selection [B, K, topk] from scores [B, K, MAXP] (-1 = unused slot), one launch."""
    b, k, maxp = scores.shape
    out = torch.empty(b, k, topk, device=scores.device, dtype=torch.int32)
    _select_kernel[(b, k)](
        scores, lens, out, maxp, local, init, scores.stride(0), scores.stride(1), out.stride(0), out.stride(1),
        S=block_size, TOPK=topk, KOUT=max(2, triton.next_power_of_2(topk)), NP=max(16, triton.next_power_of_2(maxp)),
    )  # fmt: skip
    return out


@triton.jit
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, blocks_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr,
    scale,
    s_qb, s_qh, s_kp, s_ks, s_kh, s_tb, s_bb, s_bk,
    s_mb, s_mk, s_ms, s_ab, s_ak, s_as, s_ag,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
    PER_SPLIT: tl.constexpr, DENSE: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + b)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)
    offs_s = tl.arange(0, SP)
    d_ok = offs_d[None, :] < D
    q = tl.load(
        q_ptr + b * s_qb + (kh * G + offs_g)[:, None] * s_qh + offs_d[None, :],
        mask=(offs_g[:, None] < G) & d_ok,
        other=0.0,
    )
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for j in range(PER_SPLIT):
        slot = split * PER_SPLIT + j
        if DENSE:
            blk = slot
            valid = blk * S < length
        else:
            blk = tl.load(blocks_ptr + b * s_bb + kh * s_bk + slot)
            valid = blk >= 0
        if valid:
            page = tl.load(tables_ptr + b * s_tb + blk).to(tl.int64)  # page x stride passes 2^31 in big pools
            base = page * s_kp + offs_s[:, None] * s_ks + kh * s_kh + offs_d[None, :]
            kv_ok = (offs_s[:, None] < S) & d_ok
            kb = tl.load(k_ptr + base, mask=kv_ok, other=0.0)  # [SP, DP]
            s = tl.dot(q, tl.trans(kb), out_dtype=tl.float32, input_precision=PREC) * scale  # [GP, SP]
            s = tl.where((offs_s[None, :] < S) & ((blk * S + offs_s)[None, :] < length), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            vb = tl.load(v_ptr + base, mask=kv_ok, other=0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(
                p.to(vb.dtype), vb, out_dtype=tl.float32, input_precision=PREC
            )
            m_i = m_new
    row = b * s_mb + kh * s_mk + split * s_ms + offs_g
    tl.store(m_ptr + row, m_i, mask=offs_g < G)
    tl.store(l_ptr + row, l_i, mask=offs_g < G)
    out = acc_ptr + b * s_ab + kh * s_ak + split * s_as + offs_g[:, None] * s_ag + offs_d[None, :]
    tl.store(out, acc, mask=(offs_g[:, None] < G) & d_ok)


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr,
    s_mb, s_mk, s_ms, s_ab, s_ak, s_as, s_ag, s_ob, s_oh,
    SPLITS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
):  # fmt: skip
    """Merge the splits' partial softmax states of one (sequence, group) into the output rows."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)
    g_ok = offs_g < G
    top = tl.full([GP], float("-inf"), tl.float32)
    for sp in range(SPLITS):
        top = tl.maximum(
            top, tl.load(m_ptr + b * s_mb + kh * s_mk + sp * s_ms + offs_g, mask=g_ok, other=0.0)
        )
    top = tl.where(top == float("-inf"), 0.0, top)
    den = tl.zeros([GP], tl.float32)
    num = tl.zeros([GP, DP], tl.float32)
    for sp in range(SPLITS):
        row = b * s_mb + kh * s_mk + sp * s_ms + offs_g
        w = tl.exp(tl.load(m_ptr + row, mask=g_ok, other=float("-inf")) - top)  # splits with no key weigh 0
        den += tl.load(l_ptr + row, mask=g_ok, other=0.0) * w
        acc = tl.load(
            acc_ptr + b * s_ab + kh * s_ak + sp * s_as + offs_g[:, None] * s_ag + offs_d[None, :],
            mask=g_ok[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        num += acc * w[:, None]
    out = num / tl.where(den == 0.0, 1.0, den)[:, None]
    tl.store(
        out_ptr + b * s_ob + (kh * G + offs_g)[:, None] * s_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & (offs_d[None, :] < D),
    )


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    block_ids: torch.Tensor | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Decode attention: q [B, H, D] over pools [P, S, K, D] -> [B, H, D] in q's dtype.

    With block_ids [B, K, k] only those pages (per KV group); without, every page of the sequence.
    """
    b, h, d = q.shape
    n_kv = k_pool.shape[2]
    g = h // n_kv
    slots = block_ids.shape[-1] if block_ids is not None else tables.shape[1]
    if splits is None:  # enough programs to fill the GPU: about two per multiprocessor, for
        # B's power-of-two bucket, so that any B launches one of the variants a warm-up compiles
        splits = -(-2 * sm_count(q.device) // (triton.next_power_of_2(b) * n_kv))
    splits = max(1, min(splits, slots))
    per_split = -(-slots // splits)
    splits = -(-slots // per_split)
    if block_ids is not None and per_split * splits != slots:
        block_ids = torch.nn.functional.pad(block_ids, (0, per_split * splits - slots), value=-1)
    m = torch.empty(b, n_kv, splits, g, device=q.device, dtype=torch.float32)
    l_ = torch.empty_like(m)
    acc = torch.empty(b, n_kv, splits, g, d, device=q.device, dtype=torch.float32)
    blocks = block_ids if block_ids is not None else tables
    q = q.contiguous()
    _paged_attn_kernel[(b, n_kv, splits)](
        q, k_pool, v_pool, tables, blocks, lens, m, l_, acc, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), tables.stride(0),
        blocks.stride(0), blocks.stride(1) if block_ids is not None else 0,
        m.stride(0), m.stride(1), m.stride(2), acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3),
        G=g, GP=pad(g), D=d, DP=pad(d), S=k_pool.shape[1], SP=pad(k_pool.shape[1]), PER_SPLIT=per_split,
        DENSE=block_ids is None, PREC=precision(q),
    )  # fmt: skip
    out = torch.empty_like(q)
    _combine_kernel[(b, n_kv)](
        m, l_, acc, out, m.stride(0), m.stride(1), m.stride(2), acc.stride(0), acc.stride(1), acc.stride(2),
        acc.stride(3), out.stride(0), out.stride(1), SPLITS=splits, G=g, GP=pad(g), D=d, DP=pad(d),
    )  # fmt: skip
    return out
