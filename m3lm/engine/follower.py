"""A follower rank of a tensor-parallel group: run rank 0's steps on this rank's shard.

Rank 0 schedules and samples; a follower only mirrors the forward passes, because every layer
ends in a collective that needs all ranks. It keeps its own KV pool (its KV heads only), sized
by each engine's INIT message; the block tables come with every step.
"""

from __future__ import annotations

import torch

from m3lm.cache.kv_cache import KVCache
from m3lm.distributed import steps
from m3lm.engine.runner import forward_step
from m3lm.models.minimax_m3 import MiniMaxM3


@torch.inference_mode()
def follow(model: MiniMaxM3) -> int:
    """Serve rank 0's messages until STOP; returns the number of steps run."""
    pc, cache, window, width, done = model.parallel, None, None, 0, 0
    weight = model.lm_head.weight
    kv_heads = model.model.layers[0].self_attn.n_kv
    while (msg := steps.receive(pc)) is not None:
        if isinstance(msg, steps.Init):
            cache = None  # free the previous engine's pool first
            cache = KVCache(model.args, msg.num_pages, weight.device, weight.dtype, msg.index_fp8, kv_heads)
            window, width = msg.msa_dense_window, msg.table_width
            continue
        assert cache is not None, "a step before any engine was created"
        forward_step(model, cache, msg, window, width)
        done += 1
    return done
