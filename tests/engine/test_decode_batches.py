"""A step's decodes batched over sequences (`decode_rows`, `DecodeBatch`: on CPU tensors through
`msa_paged`, the GPU kernels' twin) against the per-sequence path: the same logits and cache
contents, on full-attention and MSA layers, with and without FP8 index keys."""

import copy

import torch

from m3lm.cache.kv_cache import KVCache
from m3lm.config import ModelArgs
from m3lm.distributed.steps import Step
from m3lm.engine.runner import forward_step
from m3lm.layers.batch import DecodeBatch
from m3lm.models.minimax_m3 import MiniMaxM3, random_init_
from tests.support.checkpoints import Spec, release_config


def close(a, b, tol=1e-4):
    err = float((a - b).abs().max())
    assert err < tol, err


def test_a_mixed_steps_batched_decodes_match_the_per_sequence_path():
    """A step of two decodes and a prefill chunk: the decodes batched through the decode kernels
    (`decode_rows`; CPU tensors take `msa_paged`, the Triton kernels' CPU twin) give the
    per-sequence path's logits and cache contents."""
    args = ModelArgs.from_dict(release_config(Spec(block=4, topk_blocks=2)))
    model = random_init_(MiniMaxM3(args), seed=2)
    for index_fp8 in (False, True):
        cache = KVCache(args, 16, "cpu", torch.float32, index_fp8)
        tables = [[0, 1, 2, 3], [7, 5], [8, 9, 10]]  # the second not consecutive: gathered
        prompts = [[(3 * i + 1) % 90 for i in range(13)], [(5 * i + 2) % 90 for i in range(6)]]
        with torch.inference_mode():
            forward_step(
                model, cache, Step(prompts[0] + prompts[1], [13, 6], [0, 0], [12, 18], tables[:2]), None
            )
            # sequence 0 decodes at 13 (4 blocks > top-k 2: a selection), 1 at 6, 2 prefills 9 tokens
            step = Step([4, 9, *range(20, 29)], [1, 1, 9], [13, 6, 0], [0, 1, 10], tables)
            plain = copy.deepcopy(cache)
            want = forward_step(model, plain, step, None, batch_decodes=False)
            got = forward_step(model, cache, step, None, table_width=6, batch_decodes=True)
        close(got, want)
        pools = [(cache.k, plain.k), (cache.v, plain.v), (list(cache.ik.values()), list(plain.ik.values()))]
        for a, b in (pair for ours, theirs in pools for pair in zip(ours, theirs, strict=True)):
            close(a.float(), b.float(), 1e-5)  # later layers' keys carry the attention's rounding


def test_a_decode_batch_matches_the_per_sequence_path():
    """A decode step over a `DecodeBatch` (what CUDA graphs capture) gives the per-sequence path's
    logits and cache contents, on full-attention and MSA layers, with and without FP8 index keys."""
    args = ModelArgs.from_dict(release_config(Spec(block=4, topk_blocks=2)))
    model = random_init_(MiniMaxM3(args), seed=3)
    for index_fp8 in (False, True):
        cache = KVCache(args, 16, "cpu", torch.float32, index_fp8)
        tables = [[0, 1, 2, 3], [7, 5], [8, 9, 10, 11]]
        prompts = [[(3 * i + 1) % 90 for i in range(13)], [(5 * i + 2) % 90 for i in range(6)], [4] * 9]
        with torch.inference_mode():
            q_lens = [len(p) for p in prompts]
            forward_step(
                model, cache, Step([t for p in prompts for t in p], q_lens, [0] * 3, [27], tables), None
            )
            plain = copy.deepcopy(cache)
            # 13 positions of blocks of 4 exceed the top-k 2 blocks: sequence 0 selects
            step = Step([4, 9, 11], [1] * 3, q_lens, [0, 1, 2], tables)
            want = forward_step(model, plain, step, None, batch_decodes=False)
            table = torch.tensor([t + [15] * (4 - len(t)) for t in tables], dtype=torch.int32)
            dec = DecodeBatch.build(torch.tensor(q_lens), table, cache, cache.page_size)
            got = model.forward_batch(torch.tensor([4, 9, 11]), dec)
        close(got, want)
        pools = [(cache.k, plain.k), (cache.v, plain.v), (list(cache.ik.values()), list(plain.ik.values()))]
        for a, b in (pair for ours, theirs in pools for pair in zip(ours, theirs, strict=True)):
            close(a.float(), b.float(), 1e-5)  # later layers' keys carry the attention's rounding
