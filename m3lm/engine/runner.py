"""Turns a scheduled step into one packed forward pass over the paged caches.

Under tensor parallelism rank 0's runner first sends the step's inputs to the followers
(`m3lm.distributed.steps`), which run the same `forward_step` on their shards.
"""

from __future__ import annotations

import torch

from m3lm.cache.kv_cache import KVCache, PagedKV
from m3lm.core import ForwardBatch
from m3lm.distributed import steps
from m3lm.engine.sequence import Sequence
from m3lm.models.minimax_m3 import MiniMaxM3


class ModelRunner:
    def __init__(self, model: MiniMaxM3, cache: KVCache, msa_dense_window: float | None = None, graphs=None):
        self.model, self.cache, self.msa_dense_window = model, cache, msa_dense_window
        self.graphs = graphs  # DecodeGraphs on a GPU
        self.device = model.lm_head.weight.device

    @torch.inference_mode()
    def run(
        self, plan: list[tuple[Sequence, int]], tables: list[list[int]]
    ) -> tuple[list[Sequence], torch.Tensor]:
        """Compute `n` new positions of each planned sequence; returns the sequences that reached
        their last known token (they sample next) and their fp32 logits [R, V]."""
        decode_only = all(n == 1 and s.num_cached == s.num_tokens - 1 for s, n in plan)
        if self.graphs is not None and decode_only and len(plan) <= self.graphs.max_batch:
            return self._decode(plan, tables)
        tokens, q_lens, starts, rows, ready = [], [], [], [], []
        offset = 0
        for seq, n in plan:
            start = seq.num_cached
            tokens.extend(seq.tokens(start, start + n))
            q_lens.append(n)
            starts.append(start)
            offset += n
            if start + n == seq.num_tokens:
                rows.append(offset - 1)
                ready.append(seq)
        step = steps.Step(tokens, q_lens, starts, rows, tables)
        steps.send(self.model.parallel, step)
        logits = forward_step(self.model, self.cache, step, self.msa_dense_window)
        for seq, n in plan:
            seq.num_cached += n
        return ready, logits

    def _decode(self, plan, tables) -> tuple[list[Sequence], torch.Tensor]:
        """One new token per sequence: replay the captured graph of the batch's bucket."""
        ready = [s for s, _ in plan]
        last = [s.output_ids[-1] if s.output_ids else s.prompt_ids[-1] for s in ready]
        logits = self.graphs.run(last, [s.num_cached for s in ready], tables)
        for s in ready:
            s.num_cached += 1
        return ready, logits


def forward_step(
    model: MiniMaxM3, cache: KVCache, step: steps.Step, msa_dense_window: float | None
) -> torch.Tensor:
    """One packed forward of a step's tokens over the paged caches -> fp32 logits [R, V]."""
    dev = model.lm_head.weight.device
    positions = [
        p for start, n in zip(step.starts, step.q_lens, strict=True) for p in range(start, start + n)
    ]
    batch = ForwardBatch(
        positions=torch.tensor(positions, dtype=torch.long, device=dev),
        q_lens=step.q_lens,
        kv=PagedKV(cache, step.tables, step.starts, step.q_lens),
        msa_dense_window=msa_dense_window,
    )
    ids = torch.tensor(step.tokens, dtype=torch.long, device=dev)
    return model.forward_batch(ids, batch, torch.tensor(step.rows, dtype=torch.long, device=dev))
