"""Unit tests of the building blocks against closed forms and brute force."""

import itertools
import math

import pytest
import torch

from m3lm.kernels.fp8 import dequant_mxfp8, quantize_mxfp8
from m3lm.kernels.moe import (
    experts_by_expert,
    experts_by_pair,
    experts_gathered,
    moe,
    moe_experts_ref,
    route,
    split_bf16,
)
from m3lm.kernels.msa import index_block_scores_ref, msa_attention_ref, msa_select_ref, select_blocks_ref
from m3lm.layers.linear import MXFP8Linear, pack_rows_, packed_linear
from m3lm.layers.mlp import swiglu_oai
from m3lm.layers.norm import RMSNorm, rms_norm
from m3lm.layers.rotary import apply_rope, rope_cos_sin, rope_rows


def test_router_bias_changes_choice_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w0, ids0 = route(logits, torch.zeros(4), 2)
    assert sorted(ids0[0].tolist()) == [0, 1]
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    w1, ids1 = route(logits, bias, 2)
    assert ids1[0].tolist() == [3, 0]
    s = torch.sigmoid(logits[0])
    assert torch.allclose(w1[0], torch.stack([s[3], s[0]]) / (s[3] + s[0]))  # unbiased scores
    assert torch.allclose(w0.sum(-1), torch.ones(1))


def test_router_ties_go_to_lower_expert():
    logits = torch.zeros(3, 6)
    _, ids = route(logits, torch.zeros(6), 3)
    assert ids.tolist() == [[0, 1, 2]] * 3


def test_router_weight_splits_into_exact_bf16_slices():
    # Weights across many binades, the router's scale among them: the three bf16 slices sum back
    # to the fp32 weight bit for bit, and each product with a bf16 activation is exact in fp64.
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen) * torch.logspace(-8, 8, 96, base=2.0)
    parts = split_bf16(w)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, 64, 96)
    assert torch.equal(parts[0].float() + parts[1].float() + parts[2].float(), w)
    x = torch.randn(5, 96, generator=gen).bfloat16()
    want = x.double() @ w.double().T
    got = sum(x.double() @ p.double().T for p in parts)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
def test_packed_rows_share_storage_with_the_layers(kind):
    torch.manual_seed(0)
    widths = (24, 40, 8)
    if kind == "bf16":
        layers = [torch.nn.Linear(64, w, bias=False) for w in widths]
    else:
        layers = [MXFP8Linear(64, w) for w in widths]
        for m in layers:
            m.weight.copy_(torch.randn(m.weight.shape).to(torch.float8_e4m3fn))
            m.weight_scale.copy_(torch.randint(120, 130, m.weight_scale.shape, dtype=torch.uint8))
    names = ["weight"] + (["weight_scale"] if kind == "mxfp8" else [])
    before = {n: [getattr(m, n).clone() for m in layers] for n in names}
    packed = pack_rows_(*layers)
    assert len(packed) == len(names)
    for p, n in zip(packed, names, strict=True):
        assert torch.equal(p.float(), torch.cat(before[n]).float())
        for m, old in zip(layers, before[n], strict=True):
            assert torch.equal(getattr(m, n).float(), old.float())
    # One product over the packed weight gives each layer's output as a column slice.
    x = torch.randn(5, 64)
    outs = packed_linear(x, packed).split(widths, dim=-1)
    for m, y in zip(layers, outs, strict=True):
        assert torch.allclose(y, m(x), rtol=1e-5, atol=1e-5)
    # The layers' parameters are views of the packed buffer: loading into them updates it, and
    # packing again finds them in place (no copy).
    with torch.no_grad():
        layers[1].weight.copy_(torch.ones_like(layers[1].weight))
    assert torch.equal(packed[0][24:64].float(), torch.ones(40, 64))
    again = pack_rows_(*layers)
    assert again[0].data_ptr() == packed[0].data_ptr()
    assert pack_rows_(layers[0], torch.nn.Linear(32, 8, bias=False)) is None
    assert pack_rows_(layers[0]) is None
    # A parameter replaced by a new tensor (a reload with assign=True, say) is packed anew.
    new = getattr(layers[2], names[0]).detach().clone()
    setattr(layers[2], names[0], torch.nn.Parameter(new, requires_grad=False))
    fresh = pack_rows_(*layers)
    assert fresh[0].data_ptr() != packed[0].data_ptr()
    assert torch.equal(fresh[0][64:].float(), new.float())
    assert getattr(layers[2], names[0]).data_ptr() == fresh[0][64:].data_ptr()


def test_swiglu_oai_closed_form():
    gate = torch.tensor([-10.0, -1.0, 0.5, 9.0])
    up = torch.tensor([-9.0, 0.3, 2.0, 8.0])
    out = swiglu_oai(gate, up, 1.702, 7.0)
    for g, u, o in zip(gate.tolist(), up.tolist(), out.tolist(), strict=True):
        g, u = min(g, 7.0), max(-7.0, min(u, 7.0))
        assert o == pytest.approx(g / (1 + math.exp(-1.702 * g)) * (u + 1.0), rel=1e-6)


def test_gemma_rms_norm_closed_form():
    x = torch.tensor([[3.0, -4.0]], dtype=torch.bfloat16)
    w = torch.tensor([0.0, 1.0])
    out = rms_norm(x, w, 0.0)
    rms = math.sqrt((9 + 16) / 2)
    assert out.dtype == torch.bfloat16
    assert out.float().tolist()[0] == pytest.approx([3 / rms, 2 * -4 / rms], rel=1e-2)


def test_norm_with_the_residual_stream_adds_then_normalises():
    """`x, residual = norm(x, residual)`: the stream grows by x, and x becomes its norm."""
    norm = RMSNorm(2, 0.0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.0, 1.0]))
    residual, x = torch.tensor([[1.0, -1.0]]), torch.tensor([[2.0, -3.0]])
    y, stream = norm(x, residual)
    assert stream.tolist() == [[3.0, -4.0]]
    rms = math.sqrt((9 + 16) / 2)
    assert y.tolist()[0] == pytest.approx([3 / rms, 2 * -4 / rms], rel=1e-6)
    assert torch.equal(norm(stream), y)  # without a residual: the norm of x alone


def test_moe_of_experts_split_over_ranks_sums_to_the_whole():
    """Expert parallelism: each rank's experts (`first`) see only their pairs; the ranks' routed
    parts sum to the single-device output."""
    gen = torch.Generator().manual_seed(5)
    t_len, c, e, i = 7, 8, 6, 4
    x = torch.randn(t_len, c, generator=gen)
    w1, w3 = torch.randn(e, i, c, generator=gen), torch.randn(e, i, c, generator=gen)
    w2 = torch.randn(e, c, i, generator=gen)
    weights, ids = route(torch.randn(t_len, e, generator=gen), torch.zeros(e), 2)

    def none(x):
        return torch.zeros_like(x)

    whole = moe(x, weights, ids, (w1, w3, w2), none, 1.702, 7.0, 2.0)
    assert torch.allclose(whole, 2.0 * moe_experts_ref(x, weights, ids, w1, w3, w2, 1.702, 7.0))
    parts = [
        moe(x, weights, ids, (w1[a:b], w3[a:b], w2[a:b]), none, 1.702, 7.0, 2.0, first=a)
        for a, b in ((0, 2), (2, 6))
    ]
    assert not torch.allclose(parts[0], whole) and not torch.allclose(parts[1], whole)
    assert torch.allclose(parts[0] + parts[1], whole, atol=1e-5)


def test_partial_rope_closed_form():
    d, r, theta = 8, 4, 100.0
    x = torch.randn(5, 3, d)
    pos = torch.tensor([0, 1, 7, 100, 4095])
    cos, sin = rope_cos_sin(pos, r, theta)
    out = apply_rope(x, cos, sin)
    for t, p in enumerate(pos.tolist()):
        for i in range(r // 2):
            a = p * theta ** (-2 * i / r)
            x1, x2 = x[t, :, i], x[t, :, i + r // 2]
            assert torch.allclose(out[t, :, i], x1 * math.cos(a) - x2 * math.sin(a), atol=1e-4)
            assert torch.allclose(out[t, :, i + r // 2], x2 * math.cos(a) + x1 * math.sin(a), atol=1e-4)
    assert torch.equal(out[..., r:], x[..., r:])  # channels past the rotary dim pass through
    assert torch.equal(out[0], x[0])  # position 0 is the identity


def test_qk_norm_is_per_head():
    """One weight vector shared by all heads, each head normalised on its own."""
    from m3lm.layers.norm import RMSNorm

    norm = RMSNorm(4, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.5, 0.0, -0.5, 1.0]))
    x = torch.randn(2, 3, 4)
    x[:, 1] *= 100  # a loud head must not change the others
    out = norm(x)
    for h in range(3):
        assert torch.allclose(out[:, h], rms_norm(x[:, h], norm.weight, 1e-6))
    assert out[:, 1].abs().max() < 10


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 8), (16, 16), (64, 32)])
def test_cpu_norm_and_rope_over_whole_heads_are_the_references(head_dim, rotary_dim):
    from m3lm.layers.norm import rms_norm_cpu, rms_norm_ref
    from m3lm.layers.rotary import apply_rope_ref, apply_rope_rows

    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    x = torch.randn(5, 3, head_dim, generator=gen) * 4
    w = torch.randn(3, head_dim, generator=gen)  # a norm weight per head
    want = torch.stack([rms_norm_ref(x[:, h], w[h], 1e-6) for h in range(3)], 1)
    torch.testing.assert_close(rms_norm_cpu(x, w, 1e-6), want, rtol=1e-6, atol=1e-6)
    cos, sin = rope_cos_sin(torch.arange(40, 45), rotary_dim, 10000.0)
    got = apply_rope_rows(x, rope_rows(cos, sin, head_dim))
    torch.testing.assert_close(got, apply_rope_ref(x, cos, sin), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("wide", [False, True])
def test_packed_heads_are_the_heads_of_each_kind(wide):
    # The prepared CPU forward norms and rotates every head of the packed product in one pass
    # (v's rows included, then dropped): the same heads as a norm and a rotation per kind
    # (`project` of the unprepared layer).
    from m3lm.config import ModelArgs
    from m3lm.layers.batch import ForwardBatch
    from m3lm.layers.heads import packed_heads
    from m3lm.models.minimax_m3 import MiniMaxM3, random_init_
    from tests.support.checkpoints import Spec, release_config

    spec = Spec(heads=8, kv_heads=4, head_dim=32, rotary_dim=16, index_dim=32) if wide else Spec()
    args = ModelArgs.from_dict(release_config(spec))
    model = random_init_(MiniMaxM3(args), seed=4)
    x = torch.randn(5, args.hidden_size, generator=torch.Generator().manual_seed(5))
    cos, sin = rope_cos_sin(torch.arange(5), args.rotary_dim, args.rope_theta)
    rope = ForwardBatch.full(1, 5).rope_rows(args.rotary_dim, args.rope_theta, args.head_dim)
    kinds = set()
    for layer in model.model.layers:
        attn = layer.self_attn
        kinds.add(attn.sparse)
        want = attn.project(x, cos, sin)
        attn.prepare_()
        y, _ = attn._products(x)
        got = packed_heads(y, attn.stacked_norms, attn.dims, rope, attn.q_norm.eps)
        for a, b in zip(got, want, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert kinds == {False, True}


def brute_force_select(scores, q_pos, block, topk, local, init):
    """Per group and query, enumerate the rule of the model contract."""
    k, t_len, _ = scores.shape
    out = []
    for h in range(k):
        rows = []
        for t in range(t_len):
            qb = int(q_pos[t]) // block
            visible = list(range(qb + 1))
            if len(visible) <= topk:
                rows.append(set(visible))
                continue
            forced = {b for b in visible if b > qb - local or b < init}
            rest = sorted((b for b in visible if b not in forced), key=lambda b: (-float(scores[h, t, b]), b))
            rows.append(forced | set(rest[: topk - len(forced)]))
        out.append(rows)
    return out


@pytest.mark.parametrize(
    ("block", "topk", "local", "init"), [(4, 3, 1, 0), (2, 4, 2, 1), (3, 2, 0, 0), (5, 5, 1, 2), (1, 6, 3, 0)]
)
def test_block_selection_matches_brute_force(block, topk, local, init):
    gen = torch.Generator().manual_seed(block * 100 + topk)
    t_len, k = 40, 3
    q_pos = torch.arange(t_len) + 3
    n_blocks = -(-(t_len + 3) // block)
    # Integer scores so ties happen often.
    scores = torch.randint(0, 4, (k, t_len, n_blocks), generator=gen).float()
    chosen = select_blocks_ref(scores, q_pos, block, topk, local, init)
    assert chosen.shape == (k, t_len, topk)
    want = brute_force_select(scores, q_pos, block, topk, local, init)
    for h, t in itertools.product(range(k), range(t_len)):
        row = chosen[h, t].tolist()
        got = [b for b in row if b >= 0]
        assert row == got + [-1] * (topk - len(got))  # ascending, -1 padded on the right
        assert got == sorted(want[h][t]), (h, t)


def test_index_scores_pool_visible_keys_only():
    iq = torch.randn(6, 2, 8)
    ik = torch.randn(6, 8)
    pos = torch.arange(6)
    scores = index_block_scores_ref(iq, ik, pos, 4)  # [K, T, 2]
    full = torch.einsum("thd,jd->htj", iq, ik)
    assert torch.allclose(scores[:, 5, 1], full[:, 5, 4:6].amax(-1))
    assert torch.allclose(scores[:, 4, 1], full[:, 4, 4])  # key 5 is in the future of query 4
    assert torch.isinf(scores[:, 3, 1]).all()


@pytest.mark.parametrize("start", [0, 7, 13])
def test_index_scores_after_cached_keys_are_each_querys_visible_maxima(start):
    gen = torch.Generator().manual_seed(start)
    tk, bs = 23, 4
    iq, ik = torch.randn(tk - start, 2, 8, generator=gen), torch.randn(tk, 8, generator=gen)
    pos = torch.arange(start, tk)
    scores = index_block_scores_ref(iq, ik, pos, bs)  # [K, T, 6]
    for t, p in enumerate(pos.tolist()):
        for b in range(-(-tk // bs)):
            keys = range(b * bs, min((b + 1) * bs, p + 1))
            want = (iq[t] @ ik[list(keys)].T).amax(-1) if keys else torch.full((2,), float("-inf"))
            torch.testing.assert_close(scores[:, t, b], want)


@pytest.mark.parametrize("local", [0, 1, 2])
def test_selection_needs_no_own_block_score_when_it_forces_that_block(local):
    gen = torch.Generator().manual_seed(20 + local)
    tk, start = 61, 17
    iq, ik = torch.randn(tk - start, 2, 8, generator=gen), torch.randn(tk, 8, generator=gen)
    pos = torch.arange(start, tk)
    whole = select_blocks_ref(index_block_scores_ref(iq, ik, pos, 4), pos, 4, 3, local, 1)
    assert torch.equal(msa_select_ref(iq, ik, pos, 4, 3, local, 1), whole)


def test_block_choice_is_a_stable_sorts_first_k():
    """Ties (equal scores, several forced or invisible blocks, -0.0 against 0.0) go to the lower
    block id, as a stable descending sort puts them."""
    from m3lm.kernels.msa import _top

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 50, 20, generator=gen).round(decimals=1)  # many equal values
    x[0, :, ::3] = float("inf")
    x[1, :, 5:] = float("-inf")
    x[2, :, 1], x[2, :, 2] = -0.0, 0.0
    for k in (1, 4, 8, 20, 25):
        want = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
        assert torch.equal(_top(x, k), want)


def test_indexer_degenerates_to_dense_attention():
    """With a top-k covering every block, MSA attention equals dense causal attention."""
    gen = torch.Generator().manual_seed(0)
    t_len, h, k, d = 37, 4, 2, 8
    q, kk, v = (torch.randn(t_len, n, d, generator=gen) for n in (h, k, k))
    iq, ik = torch.randn(t_len, k, d, generator=gen), torch.randn(t_len, d, generator=gen)
    pos = torch.arange(t_len)
    assert msa_select_ref(iq, ik, pos, 4, 10, 1, 0) is None  # 10 blocks cover 37 tokens: exact shortcut
    block_ids = select_blocks_ref(index_block_scores_ref(iq, ik, pos, 4), pos, 4, 10, 1, 0)
    sparse = msa_attention_ref(q, kk, v, pos, 0.3, block_ids, 4)
    dense = msa_attention_ref(q, kk, v, pos, 0.3)
    ref = torch.softmax(
        (torch.einsum("thd,jhd->htj", q, kk.repeat_interleave(2, 1)) * 0.3).masked_fill(
            torch.ones(t_len, t_len).triu(1).bool(), float("-inf")
        ),
        -1,
    )
    ref = torch.einsum("htj,jhd->thd", ref, v.repeat_interleave(2, 1))
    assert torch.allclose(dense, ref, atol=1e-5)
    assert torch.allclose(sparse, dense, atol=1e-6)


def test_sparse_attention_masks_unselected_blocks():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, 2, 4, generator=gen),
        torch.randn(12, 1, 4, generator=gen),
        torch.randn(12, 1, 4, generator=gen),
    )
    pos = torch.tensor([10])
    block_ids = torch.tensor([[[0, 2]]])  # blocks of 4: keys 0-3 and 8-10 (11 is in the future)
    out = msa_attention_ref(q, k, v, pos, 0.5, block_ids, 4)
    keys = [0, 1, 2, 3, 8, 9, 10]
    p = torch.softmax((q[0] @ k[keys, 0].T) * 0.5, -1)
    assert torch.allclose(out[0], p @ v[keys, 0], atol=1e-6)


def test_attention_chunking_is_invisible(monkeypatch):
    import m3lm.kernels.msa as msa

    gen = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(50, 4, 8, generator=gen),
        torch.randn(50, 2, 8, generator=gen),
        torch.randn(50, 2, 8, generator=gen),
    )
    iq, ik = torch.randn(50, 2, 8, generator=gen), torch.randn(50, 8, generator=gen)
    pos = torch.arange(50)
    sel = msa_select_ref(iq, ik, pos, 4, 3, 1, 0)
    whole = msa_attention_ref(q, k, v, pos, 0.3, sel, 4)
    monkeypatch.setattr(msa, "SCORE_BUDGET", 7 * 4 * 50)  # 7 queries per chunk
    assert torch.equal(msa_select_ref(iq, ik, pos, 4, 3, 1, 0), sel)
    assert torch.allclose(msa_attention_ref(q, k, v, pos, 0.3, sel, 4), whole, atol=1e-6)


def test_moe_dispatch_matches_per_token_loop():
    gen = torch.Generator().manual_seed(3)
    t_len, c, e, i, a = 9, 8, 5, 6, 2
    x = torch.randn(t_len, c, generator=gen)
    w1, w3 = torch.randn(e, i, c, generator=gen), torch.randn(e, i, c, generator=gen)
    w2 = torch.randn(e, c, i, generator=gen)
    weights, ids = route(torch.randn(t_len, e, generator=gen), torch.zeros(e), a)
    out = moe_experts_ref(x, weights, ids, w1, w3, w2, 1.702, 7.0)
    for t in range(t_len):
        want = sum(
            weights[t, j]
            * (w2[ids[t, j]] @ swiglu_oai(w1[ids[t, j]] @ x[t], w3[ids[t, j]] @ x[t], 1.702, 7.0))
            for j in range(a)
        )
        assert torch.allclose(out[t], want, atol=1e-4)


@pytest.mark.parametrize(
    ("t_len", "e", "a", "dtype"),
    [(40, 8, 2, torch.float32), (33, 16, 4, torch.float32), (40, 8, 2, torch.bfloat16)],
)
def test_experts_over_their_tokens_match_each_token_alone(t_len, e, a, dtype):
    # Unequal groups, an expert no token chose, and each token's pairs out of id order.
    gen = torch.Generator().manual_seed(t_len + e)
    c, i = 32, 24
    x = torch.randn(t_len, c, generator=gen).to(dtype)
    w1, w3 = (torch.randn(e, i, c, generator=gen).div(4).to(dtype) for _ in range(2))
    w2 = torch.randn(e, c, i, generator=gen).div(4).to(dtype)
    logits = torch.randn(t_len, e, generator=gen)
    logits[:, 3] = -9.0  # nobody picks expert 3
    weights, ids = route(logits, torch.zeros(e), a)
    assert (ids[:, 0] > ids[:, 1]).any() and not (ids == 3).any()
    out = experts_by_expert(x, weights, ids, w1, w3, w2, 1.702, 7.0)
    assert out.dtype == torch.float32
    for t in range(t_len):
        want = torch.zeros(c)
        for j in ids[t].argsort().tolist():  # in expert id order, each product in x's dtype
            ex = int(ids[t, j])
            h = swiglu_oai(x[t : t + 1] @ w1[ex].T, x[t : t + 1] @ w3[ex].T, 1.702, 7.0)
            want = want + (h @ w2[ex].T)[0].float() * weights[t, j]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[t], want, rtol=tol, atol=tol)


@pytest.mark.parametrize("t_len", [1, 2, 3])
def test_moe_pairs_one_at_a_time_match_experts_over_their_tokens(t_len):
    # A decode step's few pairs take `experts_by_pair`; both ways give the same sums.
    gen = torch.Generator().manual_seed(t_len)
    c, e, i, a = 16, 8, 12, 2
    x = torch.randn(t_len, c, generator=gen)
    w1, w3 = torch.randn(e, i, c, generator=gen), torch.randn(e, i, c, generator=gen)
    w2 = torch.randn(e, c, i, generator=gen)
    weights, ids = route(torch.randn(t_len, e, generator=gen), torch.zeros(e), a)
    assert ids.numel() < e  # moe_experts_ref takes the pair path
    whole = experts_by_expert(x, weights, ids, w1, w3, w2, 1.702, 7.0)
    torch.testing.assert_close(moe_experts_ref(x, weights, ids, w1, w3, w2, 1.702, 7.0), whole)
    torch.testing.assert_close(experts_by_pair(x, weights, ids, w1, w3, w2, 1.702, 7.0), whole)


@pytest.mark.parametrize("t_len", [1, 3, 16])
def test_moe_pairs_gathered_in_one_graph_match_experts_over_their_tokens(t_len):
    # A compiled decode step gathers every pair's weights (no host read of the ids).
    gen = torch.Generator().manual_seed(10 + t_len)
    c, e, i, a = 16, 8, 12, 2
    x = torch.randn(t_len, c, generator=gen)
    w1, w3 = torch.randn(e, i, c, generator=gen), torch.randn(e, i, c, generator=gen)
    w2 = torch.randn(e, c, i, generator=gen)
    weights, ids = route(torch.randn(t_len, e, generator=gen), torch.zeros(e), a)
    whole = experts_by_expert(x, weights, ids, w1, w3, w2, 1.702, 7.0)
    torch.testing.assert_close(experts_gathered(x, weights, ids, w1, w3, w2, 1.702, 7.0), whole)


def test_mxfp8_dequant_hand_values():
    q = torch.tensor([[1.0, -2.0, 0.5, 448.0] + [0.0] * 28 + [3.0] + [0.0] * 31]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[127, 130]], dtype=torch.uint8)  # 2^0 for the first 32, 2^3 for the next
    w = dequant_mxfp8(q, scale)
    assert w[0, :4].tolist() == [1.0, -2.0, 0.5, 448.0]
    assert w[0, 32].item() == 24.0
    small = dequant_mxfp8(q[:, :32], torch.tensor([[120]], dtype=torch.uint8))
    assert small[0, 1].item() == -2.0 * 2.0**-7
    nan = dequant_mxfp8(q[:, :32], torch.tensor([[255]], dtype=torch.uint8))
    assert torch.isnan(nan).all()


def test_mxfp8_quantize_roundtrip_is_close():
    w = torch.randn(4, 64) * torch.logspace(-3, 2, 64)
    q, scale = quantize_mxfp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4, 2)
    assert (
        (dequant_mxfp8(q, scale) - w).abs()
        <= w.abs().unflatten(-1, (2, 32)).amax(-1).repeat_interleave(32, -1) / 8
    ).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_attention_matches_reference(dtype):
    """The fused-kernel path (used on the GPU) computes the reference's function; checked on the CPU."""
    from m3lm.kernels.msa import msa_attention_sdpa

    gen = torch.Generator().manual_seed(4)
    t_len, tk = 23, 61
    q = torch.randn(t_len, 8, 16, generator=gen).to(dtype)
    k, v = (torch.randn(tk, 2, 16, generator=gen).to(dtype) for _ in range(2))
    iq, ik = torch.randn(t_len, 2, 16, generator=gen), torch.randn(tk, 16, generator=gen)
    pos = torch.arange(tk - t_len, tk)  # a chunk at the end of a longer sequence
    sel = msa_select_ref(iq, ik, pos, 4, 3, 1, 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for block_ids in (None, sel):
        ref = msa_attention_ref(q, k, v, pos, 0.25, block_ids, 4)
        assert torch.allclose(
            msa_attention_sdpa(q, k, v, pos, 0.25, block_ids, 4).float(), ref.float(), atol=tol
        )
    full = torch.arange(tk)
    q2 = torch.randn(tk, 8, 16, generator=gen).to(dtype)
    ref = msa_attention_ref(q2, k, v, full, 0.25)
    assert torch.allclose(msa_attention_sdpa(q2, k, v, full, 0.25).float(), ref.float(), atol=tol)


@pytest.mark.parametrize("start", [0, 9])
def test_cpu_query_chunks_read_only_the_keys_they_see(monkeypatch, start):
    """Chunks of 5 queries, each reading the keys up to its last one: the selection and the
    fused attention of one chunk holding every query (all keys read), from position 0 and after
    cached keys."""
    import m3lm.kernels.msa as msa

    gen = torch.Generator().manual_seed(5 + start)
    tk = 47
    t_len = tk - start
    q = torch.randn(t_len, 4, 8, generator=gen)
    k, v = (torch.randn(tk, 2, 8, generator=gen) for _ in range(2))
    iq, ik = torch.randn(t_len, 2, 8, generator=gen), torch.randn(tk, 8, generator=gen)
    pos = torch.arange(start, tk)
    monkeypatch.setattr(msa, "CPU_QUERY_CHUNK", t_len)
    sel = msa_select_ref(iq, ik, pos, 4, 3, 1, 0)
    whole = msa.msa_attention_sdpa(q, k, v, pos, 0.3, sel, 4)
    monkeypatch.setattr(msa, "CPU_QUERY_CHUNK", 5)
    seen, keys_seen = [], msa._keys_seen
    monkeypatch.setattr(msa, "_keys_seen", lambda p, keys: seen.append(keys_seen(p, keys)) or seen[-1])
    assert torch.equal(msa_select_ref(iq, ik, pos, 4, 3, 1, 0), sel)
    torch.testing.assert_close(msa.msa_attention_sdpa(q, k, v, pos, 0.3, sel, 4), whole, rtol=1e-6, atol=1e-6)
    assert seen[: -(-t_len // 5)] == [min(tk, start + s + 5) for s in range(0, t_len, 5)]
    torch.testing.assert_close(whole, msa_attention_ref(q, k, v, pos, 0.3, sel, 4), rtol=1e-5, atol=1e-5)


def test_batch_rope_table_is_made_once_and_is_the_positions_table():
    from m3lm.layers.batch import ForwardBatch

    pos = torch.tensor([5, 0, 13, 4095])
    batch = ForwardBatch(pos, [4])
    cos, sin = batch.rope(8, 1e4)
    want_cos, want_sin = rope_cos_sin(pos, 8, 1e4)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    again = batch.rope(8, 1e4)
    assert again[0] is cos and again[1] is sin  # shared by every layer of the pass
    assert torch.equal(batch.rope(4, 1e4)[0], rope_cos_sin(pos, 4, 1e4)[0])  # another width: its own table


@pytest.mark.parametrize("table", [[3, 0, 4], [1, 2, 3]])  # scattered pages; consecutive ones (views)
def test_paged_writes_land_on_each_position_page_and_slot(table):
    import m3lm
    from m3lm.cache.kv_cache import KVCache, PagedKV

    args = m3lm.ModelArgs.from_file(m3lm.DEFAULT_MODEL / "config.json")
    s = args.index_block_size
    cache = KVCache(args, 5, "cpu", torch.float32)
    start, n = s + 2, s  # positions s+2 .. 2s+1: the end of the second page, the start of the third
    k = torch.randn(n, args.num_key_value_heads, args.head_dim)
    v = torch.randn_like(k)
    layer = args.sparse_layers.index(True)
    ik = torch.randn(n, args.index_head_dim)
    kv = PagedKV(cache, [table], [start], [n])
    keys, values = kv.update(layer, 0, k, v)
    index_keys = kv.update_index(layer, 0, ik)
    for i in range(n):
        p = start + i
        assert torch.equal(cache.k[layer][table[p // s], p % s], k[i])
        assert torch.equal(cache.v[layer][table[p // s], p % s], v[i])
        assert torch.equal(cache.ik[layer][table[p // s], p % s], ik[i])
    assert keys.shape[0] == start + n and torch.equal(keys[start:], k) and torch.equal(values[start:], v)
    assert index_keys.shape[0] == start + n and torch.equal(index_keys[start:], ik)
    # Consecutive pages are read in place; others are gathered.
    in_place = keys.untyped_storage().data_ptr() == cache.k[layer].untyped_storage().data_ptr()
    assert in_place == (table == [1, 2, 3])
