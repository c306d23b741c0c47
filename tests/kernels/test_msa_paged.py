"""The CPU's batched paged decode (`kernels/msa_paged.py`) against the per-sequence references."""

import pytest
import torch

from m3lm.kernels import msa_paged
from m3lm.kernels.fp8 import dequant_rows_fp8, quantize_rows_fp8
from m3lm.kernels.msa import index_block_scores_ref, msa_attention_ref, select_blocks_ref


def paged_case(h, k, d, di, s, lens, seed=0):
    """Pools holding each row's pages in shuffled order, tables padded past each row with page 0
    (another row's page: only the lengths keep a row off it)."""
    gen = torch.Generator().manual_seed(seed)
    maxp = max(-(-n // s) for n in lens) + 2
    pool = sum(-(-n // s) for n in lens) + 1
    perm = torch.randperm(pool, generator=gen)
    tables = torch.zeros(len(lens), maxp, dtype=torch.int32)
    c = 0
    for i, n in enumerate(lens):
        m = -(-n // s)
        tables[i, :m] = perm[c : c + m].int()
        c += m
    mk = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    pools = mk(pool, s, k, d), mk(pool, s, k, d), mk(pool, s, di)
    return (*pools, mk(len(lens), h, d), mk(len(lens), k, di), tables, torch.tensor(lens, dtype=torch.int32))


def row_keys(pool, tables, i, n, s):
    return pool[tables[i, : -(-n // s)].long()].flatten(0, 1)[:n]


@pytest.mark.parametrize(
    ("h", "k", "d", "di", "s", "lens", "topk", "local", "init"),
    [
        (8, 2, 16, 16, 4, [5, 33, 70], 3, 1, 0),
        (4, 2, 64, 64, 16, [1, 16, 17, 129, 300], 8, 1, 0),
        (6, 3, 8, 8, 4, [40, 9, 64], 4, 2, 1),
    ],
)
def test_paged_decode_matches_references(h, k, d, di, s, lens, topk, local, init):
    kp, vp, ikp, q, iq, tables, lt = paged_case(h, k, d, di, s, lens)
    scores = msa_paged.index_block_scores(iq, ikp, tables, lt)
    sel = msa_paged.select_blocks(scores, lt, s, topk, local, init)
    dense = msa_paged.paged_attention(q, kp, vp, tables, lt, d**-0.5)
    sparse = msa_paged.paged_attention(q, kp, vp, tables, lt, d**-0.5, sel)
    assert scores.shape == (len(lens), k, tables.shape[1]) and sel.shape == (len(lens), k, topk)
    for i, n in enumerate(lens):
        kk, vv, ik = (row_keys(p, tables, i, n, s) for p in (kp, vp, ikp))
        pos = torch.tensor([n - 1])
        ref_scores = index_block_scores_ref(iq[i : i + 1], ik, pos, s)[:, 0]  # [K, N]
        nb = ref_scores.shape[-1]
        torch.testing.assert_close(scores[i, :, :nb], ref_scores, rtol=1e-5, atol=1e-5)
        assert torch.isneginf(scores[i, :, nb:]).all()  # pages past the row
        ref_sel = select_blocks_ref(ref_scores[:, None], pos, s, topk, local, init)[:, 0]
        assert torch.equal(sel[i], ref_sel)
        ref_dense = msa_attention_ref(q[i : i + 1], kk, vv, pos, d**-0.5)[0]
        torch.testing.assert_close(dense[i], ref_dense, rtol=1e-5, atol=1e-5)
        ref_sparse = msa_attention_ref(q[i : i + 1], kk, vv, pos, d**-0.5, ref_sel[:, None], s)[0]
        torch.testing.assert_close(sparse[i], ref_sparse, rtol=1e-5, atol=1e-5)
        if n > topk * s:  # the selection leaves keys out: sparse and dense differ
            assert (sparse[i] - dense[i]).abs().max() > 1e-3


def test_fp8_index_keys_score_as_their_dequantised_values():
    *_, ikp, _q, iq, tables, lt = paged_case(4, 2, 16, 16, 4, [7, 50])
    keys, scale = quantize_rows_fp8(ikp)
    got = msa_paged.index_block_scores(iq, keys, tables, lt, scale)
    want = msa_paged.index_block_scores(iq, dequant_rows_fp8(keys, scale), tables, lt)
    torch.testing.assert_close(got, want)
    assert (got - msa_paged.index_block_scores(iq, ikp, tables, lt)).abs().nan_to_num(0).max() > 0


def test_bf16_pools_give_bf16_outputs_computed_in_fp32():
    kp, vp, _ikp, q, _iq, tables, lt = paged_case(4, 2, 16, 16, 4, [7, 50])
    b16 = [t.bfloat16() for t in (kp, vp, q)]
    out = msa_paged.paged_attention(b16[2], b16[0], b16[1], tables, lt, 0.25)
    ref = msa_paged.paged_attention(*(t.float() for t in (b16[2], b16[0], b16[1])), tables, lt, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.bfloat16())


@pytest.mark.parametrize("index_fp8", [False, True])
def test_batched_decodes_give_the_per_sequence_logits(index_fp8):
    """A step of three decodes (one past top-k blocks: a selection; one on pages out of order) and
    a prefill chunk: the decodes batched over the paged caches give the per-sequence reference's
    logits and cache contents."""
    import copy

    from m3lm.cache.kv_cache import KVCache
    from m3lm.config import ModelArgs
    from m3lm.distributed.steps import Step
    from m3lm.engine.runner import forward_step
    from m3lm.models.minimax_m3 import MiniMaxM3, random_init_
    from tests.support.checkpoints import Spec, release_config

    args = ModelArgs.from_dict(release_config(Spec(block=4, topk_blocks=2)))
    model = random_init_(MiniMaxM3(args), seed=2)
    cache = KVCache(args, 20, "cpu", torch.float32, index_fp8)
    tables = [[0, 1, 2, 3], [7, 5], [12, 13], [8, 9, 10]]
    prompts = [[(3 * i + 1) % 90 for i in range(13)], [(5 * i + 2) % 90 for i in range(6)], [7, 8, 9]]
    with torch.inference_mode():
        prefill = Step([t for p in prompts for t in p], [13, 6, 3], [0, 0, 0], [12, 18, 21], tables[:3])
        forward_step(model, cache, prefill, None, batch_decodes=False)
        step = Step([4, 9, 11, *range(20, 29)], [1, 1, 1, 9], [13, 6, 3, 0], [0, 1, 2, 11], tables)
        plain = copy.deepcopy(cache)
        want = forward_step(model, plain, step, None, batch_decodes=False)
        got = forward_step(model, cache, step, None, batch_decodes=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for ours, theirs in [
        (cache.k, plain.k),
        (cache.v, plain.v),
        (list(cache.ik.values()), list(plain.ik.values())),
    ]:
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5)
