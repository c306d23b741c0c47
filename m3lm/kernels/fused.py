"""Fused elementwise kernels for the GPU (Triton), each the same function as its reference in
`m3lm/layers/`: Gemma RMSNorm, partial NeoX RoPE and the clamped SwiGLU. One launch replaces
the handful of small PyTorch ops of the reference, which matters in a decode step where launches,
not bytes, dominate, and saves whole passes over [T, C] activations in a prefill. fp32 math
throughout; every intermediate the reference rounds to the activation dtype is rounded here too,
so the fused result is the composition of the references; outputs in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_norm(y_ptr, row, x, w_ptr, offs, mask, n, eps):
    """y[row] = x * rsqrt(mean(x^2) + eps) * (1 + w) of one fp32 row x [BLOCK] (n used), cast to y's dtype."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    tl.store(y_ptr + row * n + offs, (x * inv * (1.0 + w)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_row_and_norm(s_ptr, y_ptr, row, v, w_ptr, offs, mask, n, eps):
    """s[row] = v (a row in s's dtype), y[row] = its norm (`_store_norm`)."""
    tl.store(s_ptr + row * n + offs, v, mask=mask)
    _store_norm(y_ptr, row, v.to(tl.float32), w_ptr, offs, mask, n, eps)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
    _store_norm(y_ptr, row, x, w_ptr, offs, mask, n, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm over the last dim of a contiguous x (any leading shape)."""
    x = x.contiguous()
    n = x.shape[-1]
    y = torch.empty_like(x)
    _rms_norm_kernel[(x.numel() // n,)](x, weight, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return y


@triton.jit
def _embed_rms_norm_kernel(ids_ptr, table_ptr, w_ptr, h_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(table_ptr + tl.load(ids_ptr + row).to(tl.int64) * n + offs, mask=mask, other=0.0)
    _store_row_and_norm(h_ptr, y_ptr, row, e, w_ptr, offs, mask, n, eps)


def embed_rms_norm(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) with h = table[ids]: the embedding and the first layer's norm in one pass
    (ids [T] within the table's rows, as the engine and server check)."""
    n = table.shape[-1]
    h = torch.empty(ids.shape[0], n, device=table.device, dtype=table.dtype)
    y = torch.empty_like(h)
    _embed_rms_norm_kernel[(ids.shape[0],)](ids, table, weight, h, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return h, y


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, s_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
    s = (h + d).to(s_ptr.dtype.element_ty)  # the residual sum, rounded as `h + d` rounds it
    _store_row_and_norm(s_ptr, y_ptr, row, s, w_ptr, offs, mask, n, eps)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) with s = h + delta (h's dtype): a residual add and the next norm in one pass."""
    h, delta = h.contiguous(), delta.contiguous()
    n = h.shape[-1]
    s, y = torch.empty_like(h), torch.empty_like(h)
    _add_rms_norm_kernel[(h.numel() // n,)](h, delta, weight, s, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return s, y


@triton.jit
def _rope_lanes(HALF: tl.constexpr, DP: tl.constexpr):
    """Channels [DP]: offsets, which rotate (the first 2 * HALF), which are in the first half, and
    each one's rotation partner."""
    offs = tl.arange(0, DP)
    first = offs < HALF
    return offs, offs < 2 * HALF, first, tl.where(first, offs + HALF, offs - HALF)


@triton.jit
def _norm_rope_rows(
    x, xp, w, wp, dim, cos_ptr, sin_ptr, t, p_ok, offs, rot, first, eps, act: tl.constexpr, HALF: tl.constexpr
):  # fmt: skip
    """Rows x [BR, DP] (xp: each channel's partner) normed over `dim` channels with weights w, wp
    (times 1 + w), then rotated by token t's cos/sin: fp32 [BR, DP]. The norm's output is rounded
    to the activation dtype `act` before the rotation, as the reference's two steps round it."""
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / dim + eps)  # [BR]
    y = (x * inv[:, None] * (1.0 + w)).to(act).to(tl.float32)
    yp = (xp * inv[:, None] * (1.0 + wp)).to(act).to(tl.float32)
    j = tl.where(first, offs, offs - HALF)
    c = tl.load(cos_ptr + t[:, None] * HALF + j[None, :], mask=p_ok, other=1.0)
    s = tl.load(sin_ptr + t[:, None] * HALF + j[None, :], mask=p_ok, other=0.0)
    out = tl.where(first[None, :], y * c - yp * s, y * c + yp * s)
    return tl.where(rot[None, :], out, y)


@triton.jit(do_not_specialize=["n_rows"])
def _norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, n_rows, heads, s_xt, s_xh, eps,
    D: tl.constexpr, HALF: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BR + tl.arange(0, BR)  # (token, head) rows
    row_ok = rows < n_rows
    t = (rows // heads).to(tl.int64)
    base = x_ptr + t[:, None] * s_xt + (rows % heads)[:, None] * s_xh  # [BR, 1]
    offs, rot, first, partner = _rope_lanes(HALF, DP)
    ok = row_ok[:, None] & (offs[None, :] < D)
    p_ok = row_ok[:, None] & rot[None, :]
    x = tl.load(base + offs[None, :], mask=ok, other=0.0).to(tl.float32)  # [BR, DP]
    xp = tl.load(base + partner[None, :], mask=p_ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs < D, other=0.0).to(tl.float32)[None, :]
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)[None, :]
    out = _norm_rope_rows(
        x, xp, w, wp, D, cos_ptr, sin_ptr, t, p_ok, offs, rot, first, eps, y_ptr.dtype.element_ty, HALF
    )
    tl.store(y_ptr + rows[:, None].to(tl.int64) * D + offs[None, :], out.to(y_ptr.dtype.element_ty), mask=ok)


def norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Per-head RMSNorm (one weight for all heads) then partial RoPE: x [T, n, D] -> [T, n, D] contiguous.

    x may be a strided view (a slice of a wider projection's output); its last dim must be dense.
    """
    t, heads, d = x.shape
    assert x.stride(2) == 1
    y = torch.empty(t, heads, d, device=x.device, dtype=x.dtype)
    br = 16
    _norm_rope_kernel[(triton.cdiv(t * heads, br),)](
        x, weight, cos.contiguous(), sin.contiguous(), y, t * heads, heads, x.stride(0), x.stride(1), eps,
        D=d, HALF=cos.shape[-1], DP=triton.next_power_of_2(d), BR=br,
    )  # fmt: skip
    return y


@triton.jit(do_not_specialize=["n_rows"])
def _decode_heads_kernel(
    y_ptr, qw_ptr, kw_ptr, iqw_ptr, ikw_ptr, cos_ptr, sin_ptr, q_ptr, iq_ptr, kc_ptr, vc_ptr, ikc_ptr,
    pages_ptr, slots_ptr, n_rows, s_yt, s_kp, s_ks, s_ip, s_is, eps,
    H: tl.constexpr, K: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, INDEX: tl.constexpr,
    HALF: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    """Every head of the packed attention input [B, H*D | K*D | K*D | K*DI | DI] of a decode step:
    (token, head) rows, each normed and rotated as `_norm_rope_kernel` does (v: copied), then
    stored where it goes: q and the index queries to their outputs, k, v and the index key into the
    paged caches at the token's (page, slot)."""
    per = H + 2 * K + (K + 1 if INDEX else 0)  # head rows per token
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < n_rows
    t = (rows // per).to(tl.int64)
    hh = rows % per
    seg = (hh >= H).to(tl.int32) + (hh >= H + K) + (hh >= H + 2 * K) + (hh >= H + 3 * K)  # q k v iq ik
    head = hh - tl.where(seg == 0, 0, tl.where(seg == 1, H, tl.where(seg == 2, H + K, H + 2 * K)))
    head = tl.where(seg == 4, 0, head)
    dim = tl.where(seg >= 3, DI, D)  # [BR]
    col = tl.where(seg < 3, hh * D, (H + 2 * K) * D + head * DI + (seg == 4).to(tl.int32) * K * DI)
    base = y_ptr + t[:, None] * s_yt + col[:, None]
    offs, rot, first, partner = _rope_lanes(HALF, DP)
    ok = row_ok[:, None] & (offs[None, :] < dim[:, None])
    p_ok = row_ok[:, None] & rot[None, :]
    x = tl.load(base + offs[None, :], mask=ok, other=0.0).to(tl.float32)  # [BR, DP]
    xp = tl.load(base + partner[None, :], mask=p_ok, other=0.0).to(tl.float32)
    w_ptr = tl.where(seg == 0, qw_ptr, tl.where(seg == 1, kw_ptr, tl.where(seg == 3, iqw_ptr, ikw_ptr)))
    w = tl.load(w_ptr[:, None] + offs[None, :], mask=ok & (seg != 2)[:, None], other=0.0).to(tl.float32)
    wp = tl.load(w_ptr[:, None] + partner[None, :], mask=p_ok & (seg != 2)[:, None], other=0.0).to(tl.float32)
    act = y_ptr.dtype.element_ty
    out = _norm_rope_rows(x, xp, w, wp, dim, cos_ptr, sin_ptr, t, p_ok, offs, rot, first, eps, act, HALF)
    out = tl.where((seg == 2)[:, None], x, out).to(act)  # v: as projected
    page = tl.load(pages_ptr + t, mask=row_ok, other=0).to(tl.int64)  # page x stride passes 2^31
    slot = tl.load(slots_ptr + t, mask=row_ok, other=0)
    kv_at = page * s_kp + slot * s_ks + head * D  # [BR] into k/v caches [P, S, K, D]
    dst = tl.where(
        seg == 0,
        q_ptr + t * (H * D) + head * D,
        tl.where(
            seg == 1,
            kc_ptr + kv_at,
            tl.where(
                seg == 2,
                vc_ptr + kv_at,
                tl.where(seg == 3, iq_ptr + t * (K * DI) + head * DI, ikc_ptr + page * s_ip + slot * s_is),
            ),
        ),
    )
    tl.store(dst[:, None] + offs[None, :], out, mask=ok)


def decode_heads(
    y: torch.Tensor, dims: tuple[int, int, int, int], norms: tuple, eps: float, cos: torch.Tensor,
    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ik_cache: torch.Tensor | None,
    pages: torch.Tensor, slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """One launch for what a decode step does between the packed input projection and attention.

    y [B, H*D + 2*K*D (+ K*Di + Di with an index)] the packed q | k | v | index q | index k;
    dims (H, K, D, Di); norms the q, k (and index q, index k) norm weights. Writes k, v [B, K, D]
    and the index key [B, Di] into the caches k_cache/v_cache [P, S, K, D] and ik_cache [P, S, Di]
    at (pages, slots) [B]; returns q [B, H, D] and the index queries [B, K, Di] (or None), each
    head normed and rotated as `norm_rope` does. Caches in y's dtype.
    """
    h, k, d, di = dims
    index = ik_cache is not None
    b = y.shape[0]
    assert y.stride(1) == 1 and k_cache.dtype == v_cache.dtype == y.dtype
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == d and v_cache.stride() == k_cache.stride()
    q = torch.empty(b, h, d, device=y.device, dtype=y.dtype)
    iq = torch.empty(b, k, di, device=y.device, dtype=y.dtype) if index else None
    ikc = ik_cache if index else k_cache
    if index:
        assert ik_cache.dtype == y.dtype and ik_cache.stride(2) == 1
    qw, kw, iqw, ikw = (*norms, norms[1], norms[1]) if not index else norms
    n_rows = b * (h + 2 * k + (k + 1 if index else 0))
    br = 16
    _decode_heads_kernel[(triton.cdiv(n_rows, br),)](
        y, qw, kw, iqw, ikw, cos.contiguous(), sin.contiguous(), q, iq if index else q, k_cache, v_cache, ikc,
        pages, slots, n_rows, y.stride(0), k_cache.stride(0), k_cache.stride(1), ikc.stride(0), ikc.stride(1), eps,
        H=h, K=k, D=d, DI=di if index else d, INDEX=index, HALF=cos.shape[-1],
        DP=triton.next_power_of_2(max(d, di if index else d)), BR=br,
    )  # fmt: skip
    return q, iq


@triton.jit
def _combine_row(
    p_ptr, row_ptr, w_ptr, sh_ptr, t, offs, mask, n, scaling,
    A: tl.constexpr, ROWS: tl.constexpr, WEIGHTS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Token t's MoE output at offs [BLOCK]: sum_a w[t, a] * pairs[row(t, a)] * scaling + shared[t], fp32."""
    acc = tl.zeros([BLOCK], tl.float32)
    for a in range(A):  # in slot order, as the reference's sum
        row = t * A + a
        if ROWS:
            row = tl.load(row_ptr + row).to(tl.int64)
        y = tl.load(p_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTS:
            y = y * tl.load(w_ptr + t * A + a)
        acc += y
    shared = tl.load(sh_ptr + t * n + offs, mask=mask, other=0.0).to(tl.float32)
    return acc * scaling + shared


@triton.jit
def _moe_combine_kernel(
    p_ptr, row_ptr, w_ptr, sh_ptr, y_ptr, n, scaling,
    A: tl.constexpr, ROWS: tl.constexpr, WEIGHTS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = _combine_row(p_ptr, row_ptr, w_ptr, sh_ptr, t, offs, mask, n, scaling, A, ROWS, WEIGHTS, BLOCK)
    tl.store(y_ptr + t * n + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _combine_args(pairs, shared, rows, weights, fill):
    """(pairs, rows, weights, shared, A) as the combine kernels take them; `fill` stands in for absent inputs."""
    a = pairs.shape[1] if rows is None else rows.shape[1]
    rows = rows.contiguous() if rows is not None else fill
    weights = weights.float().contiguous() if weights is not None else fill
    return pairs.contiguous(), rows, weights, shared.contiguous(), a


def moe_combine(
    pairs: torch.Tensor,
    shared: torch.Tensor,
    scaling: float,
    rows: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_a w[t, a] * pairs[row(t, a)] * scaling + shared[t], in shared's dtype, summed in fp32.

    pairs [T, A, C] in pair order (row(t, a) = t*A + a), or [M, C] with `rows` [T, A] giving each
    pair's row; `weights` [T, A] fp32 when the pairs are not weighted yet. One pass instead of a
    sum, a scale, a cast, an add and a cast.
    """
    t, n = shared.shape
    y = torch.empty_like(shared)
    p, r, w, sh, a = _combine_args(pairs, shared, rows, weights, y)
    block = 1024
    _moe_combine_kernel[(t, triton.cdiv(n, block))](
        p, r, w, sh, y, n, scaling, A=a, ROWS=rows is not None, WEIGHTS=weights is not None, BLOCK=block
    )
    return y


@triton.jit
def _moe_add_rms_norm_kernel(
    p_ptr, row_ptr, w_ptr, sh_ptr, h_ptr, nw_ptr, s_ptr, y_ptr, n, scaling, eps,
    A: tl.constexpr, ROWS: tl.constexpr, WEIGHTS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    d = _combine_row(p_ptr, row_ptr, w_ptr, sh_ptr, t, offs, mask, n, scaling, A, ROWS, WEIGHTS, BLOCK)
    d = d.to(sh_ptr.dtype.element_ty).to(tl.float32)  # the MoE output, rounded as `moe_combine` stores it
    h = tl.load(h_ptr + t * n + offs, mask=mask, other=0.0).to(tl.float32)
    s = (h + d).to(s_ptr.dtype.element_ty)  # the residual sum, rounded as `h + d` rounds it
    _store_row_and_norm(s_ptr, y_ptr, t, s, nw_ptr, offs, mask, n, eps)


def moe_add_rms_norm(
    h: torch.Tensor,
    pairs: torch.Tensor,
    shared: torch.Tensor,
    scaling: float,
    weight: torch.Tensor,
    eps: float,
    rows: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm(h, moe_combine(pairs, shared, scaling, rows, weights), weight, eps)` in one pass,
    bit for bit: the MoE output [T, C] is neither written nor read again."""
    h = h.contiguous()
    t, n = h.shape
    s, y = torch.empty_like(h), torch.empty_like(h)
    p, r, w, sh, a = _combine_args(pairs, shared, rows, weights, s)
    _moe_add_rms_norm_kernel[(t,)](
        p, r, w, sh, h, weight, s, y, n, scaling, eps,
        A=a, ROWS=rows is not None, WEIGHTS=weights is not None, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return s, y


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr, heads, D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)  # one (token, head) row of D channels
    t = row // heads
    offs = tl.arange(0, BLOCK)
    base = x_ptr + row * D
    x = tl.load(base + offs, mask=offs < D, other=0.0)
    rot = offs < 2 * HALF
    first = offs < HALF
    j = tl.where(first, offs, offs - HALF)
    c = tl.load(cos_ptr + t * HALF + j, mask=rot, other=1.0)
    s = tl.load(sin_ptr + t * HALF + j, mask=rot, other=0.0)
    partner = tl.load(base + tl.where(first, offs + HALF, offs - HALF), mask=rot, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    out = tl.where(first, xf * c - partner * s, xf * c + partner * s)
    out = tl.where(rot, out, xf)
    tl.store(y_ptr + row * D + offs, out.to(y_ptr.dtype.element_ty), mask=offs < D)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary embedding of x [T, n, D] with cos/sin [T, R/2] fp32."""
    x = x.contiguous()
    t, n, d = x.shape
    y = torch.empty_like(x)
    _rope_kernel[(t * n,)](
        x, cos.contiguous(), sin.contiguous(), y, n, D=d, HALF=cos.shape[-1], BLOCK=triton.next_power_of_2(d)
    )
    return y


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, numel, width, stride, alpha, limit, BLOCK: tl.constexpr):
    """y[r, c] = swiglu(g[r * stride + c], u[r * stride + c]) over rows of `width` outputs."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    src = (offs // width) * stride + offs % width
    g = tl.minimum(tl.load(g_ptr + src, mask=mask, other=0.0).to(tl.float32), limit)
    u = tl.load(u_ptr + src, mask=mask, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    y = g * tl.sigmoid(alpha * g) * (u + 1.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n, width = gate.numel(), max(gate.shape[-1], 1)  # rows of the fixed width: no per-batch int but numel
    _swiglu_kernel[(triton.cdiv(n, 1024),)](gate, up, y, n, width, width, alpha, limit, BLOCK=1024)
    return y


def swiglu_packed(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """`swiglu_oai` of a packed product h [..., 2I] (gate columns, then up columns) -> [..., I]."""
    h = h.contiguous()
    width = h.shape[-1] // 2
    y = torch.empty(*h.shape[:-1], width, device=h.device, dtype=h.dtype)
    n = y.numel()
    _swiglu_kernel[(triton.cdiv(n, 1024),)](
        h, h[..., width:], y, n, width, 2 * width, alpha, limit, BLOCK=1024
    )
    return y
