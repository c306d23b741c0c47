"""The figures the KV pool is sized from: the peak activation of the largest step, measured.

Before the pool exists, one forward of `max_num_batched_tokens` prompt tokens (and, when it is
larger, of a `max_num_seqs` decode-sized batch) runs on a small temporary cache; the rise of
`torch.cuda.max_memory_allocated` over it, less that cache, is the step's peak activation.
Under tensor parallelism the followers run the same steps on their shards (the collectives
need every rank), on a temporary pool of their own that the engine's real INIT replaces.
"""

from __future__ import annotations

import logging
import time

import torch

from m3lm.cache.kv_cache import KVCache
from m3lm.distributed import steps
from m3lm.engine.runner import forward_step
from m3lm.models.minimax_m3 import MiniMaxM3

log = logging.getLogger("m3lm.engine")


def profile_batches(num_tokens: int, num_seqs: int, max_len: int) -> list[list[int]]:
    """The q_lens of the profiled steps: `num_tokens` prompt tokens in sequences of at most
    `max_len`, then `num_seqs` one-token rows when that batch is larger."""
    n = min(num_tokens, max_len)
    prefill = [n] * (num_tokens // n) + ([num_tokens % n] if num_tokens % n else [])
    return [prefill, [1] * num_seqs] if num_seqs > num_tokens else [prefill]


@torch.inference_mode()
def peak_activation_bytes(
    model: MiniMaxM3, batches: list[list[int]], index_fp8: bool, msa_dense_window: float | None
) -> int:
    """Bytes allocated beyond the weights at the peak of the largest of `batches` (q_lens of
    fresh sequences), measured on the model's CUDA device."""
    args, dev = model.args, model.lm_head.weight.device
    page = args.index_block_size
    kv_heads = model.model.layers[0].self_attn.n_kv
    t0 = time.perf_counter()
    peak = 0
    for q_lens in batches:
        sizes = [-(-n // page) for n in q_lens]
        firsts = [sum(sizes[:i]) for i in range(len(sizes))]
        tables = [list(range(f, f + s)) for f, s in zip(firsts, sizes, strict=True)]
        rows = [sum(q_lens[: i + 1]) - 1 for i in range(len(q_lens))]
        tokens = [i % args.vocab_size for i in range(sum(q_lens))]
        step = steps.Step(tokens, q_lens, [0] * len(q_lens), rows, tables)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        cache = KVCache(args, sum(sizes), dev, model.lm_head.weight.dtype, index_fp8, kv_heads)
        steps.send(model.parallel, steps.Init(sum(sizes), msa_dense_window, index_fp8))
        steps.send(model.parallel, step)
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
        forward_step(model, cache, step, msa_dense_window)
        torch.cuda.synchronize(dev)
        peak = max(peak, torch.cuda.max_memory_allocated(dev) - start)
        del cache
    torch.cuda.empty_cache()
    log.info(
        "profiled the largest step (%s) in %.1f s: peak activation %.2f GiB",
        " and ".join(f"{len(q)} x {q[0]} tokens" for q in batches),
        time.perf_counter() - t0,
        peak / (1 << 30),
    )
    return peak
