"""Block-sparse MSA prefill attention (Triton, flash-style), next to `msa.msa_attention_ref`.

One program takes BQ consecutive queries of one KV group (BQ x G rows: every query head of the
group) and walks the key blocks visible to its last query. A block is computed only when at
least one of its queries selected it; rows whose query did not select it, and keys in a query's
future, are masked. Softmax is online in fp32, as in flash attention, so nothing of size
[T, Tk] exists. Without a selection (dense layers, or the exact dense shortcut) every visible
block is taken: plain causal flash attention.

Shapes: T queries at positions q_pos (consecutive), Tk keys at positions 0..Tk-1, H = K x G
query heads, D head dim, S block size, k selected blocks per query and group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, sel_ptr, out_ptr,
    first_pos, t_len, scale,
    s_qt, s_qh, s_kt, s_kh, s_sk, s_st, s_ot, s_oh,
    G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, TOPK: tl.constexpr,
    KP: tl.constexpr, BQ: tl.constexpr, SPARSE: tl.constexpr, PREC: tl.constexpr, NBLK: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kh = tl.program_id(1)
    rows = tl.arange(0, BQ * G)
    t_local = rows // G  # query of each row
    t = tile * BQ + t_local
    row_ok = t < t_len
    head = kh * G + rows % G
    pos = first_pos + t  # absolute position of each row's query
    offs_d = tl.arange(0, DP)
    d_ok = offs_d[None, :] < D
    q = tl.load(
        q_ptr + t[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok,
        other=0.0,
    )
    if SPARSE:
        offs_k = tl.arange(0, KP)
        sel = tl.load(
            sel_ptr + kh * s_sk + t[:, None] * s_st + offs_k[None, :],
            mask=row_ok[:, None] & (offs_k[None, :] < TOPK),
            other=-1,
        )  # [BQ*G, KP] block ids of each row's query
    m_i = tl.full([BQ * G], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ * G], tl.float32)
    acc = tl.zeros([BQ * G, DP], tl.float32)
    last = tl.minimum(first_pos + tile * BQ + BQ - 1, first_pos + t_len - 1)
    offs_s = tl.arange(0, SP)
    # NBLK (a power of two, so few variants compile) bounds the loop; blocks past the tile's
    # last query are skipped.
    for blk in range(0, NBLK):
        if SPARSE:
            take = tl.sum((sel == blk).to(tl.int32), axis=1) > 0  # [rows]
            any_row = tl.max(take.to(tl.int32), axis=0) > 0
        else:
            take = row_ok
            any_row = blk * S <= last
        if any_row & (blk * S <= last):
            key_pos = blk * S + offs_s
            kv = key_pos[:, None] * s_kt + kh * s_kh + offs_d[None, :]
            kv_ok = (offs_s[:, None] < S) & (key_pos[:, None] <= last) & d_ok
            kb = tl.load(k_ptr + kv, mask=kv_ok, other=0.0)
            vb = tl.load(v_ptr + kv, mask=kv_ok, other=0.0)
            s = tl.dot(q, tl.trans(kb), out_dtype=tl.float32, input_precision=PREC) * scale  # [rows, S]
            keep = take[:, None] & (offs_s[None, :] < S) & (key_pos[None, :] <= pos[:, None])
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(
                p.to(vb.dtype), vb, out_dtype=tl.float32, input_precision=PREC
            )
            m_i = m_new
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
) -> torch.Tensor:
    """Same contract as `msa_attention_ref` for consecutive query positions: [T, H, D] -> [T, H, D].

    `block_size` tiles the keys when there is no selection (it need not match the MSA block then).
    """
    t_len, n_heads, d = q.shape
    n_kv = k.shape[1]
    g = n_heads // n_kv
    bq = max(1, 128 // g)  # about 128 rows per program
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    sparse = block_ids is not None
    sel = block_ids.to(torch.int32).contiguous() if sparse else q  # dummy pointer when dense
    topk = block_ids.shape[-1] if sparse else 1
    first = int(q_pos[0])
    _prefill_kernel[(triton.cdiv(t_len, bq), n_kv)](
        q, k, v, sel, out, first, t_len, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        sel.stride(0) if sparse else 0, sel.stride(1) if sparse else 0, out.stride(0), out.stride(1),
        G=g, D=d, DP=max(16, triton.next_power_of_2(d)), S=block_size, SP=max(16, triton.next_power_of_2(block_size)), TOPK=topk,
        KP=max(2, triton.next_power_of_2(topk)), BQ=bq, SPARSE=sparse,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        NBLK=triton.next_power_of_2(int(q_pos[-1]) // block_size + 1),
    )  # fmt: skip
    return out
