"""Turns a scheduled step into one packed forward pass over the paged caches."""

from __future__ import annotations

import torch

from m3lm.cache.kv_cache import KVCache, PagedKV
from m3lm.core import ForwardBatch
from m3lm.engine.sequence import Sequence
from m3lm.models.minimax_m3 import MiniMaxM3


class ModelRunner:
    def __init__(self, model: MiniMaxM3, cache: KVCache, msa_dense_window: float | None = None):
        self.model, self.cache, self.msa_dense_window = model, cache, msa_dense_window
        self.device = model.lm_head.weight.device

    @torch.inference_mode()
    def run(
        self, plan: list[tuple[Sequence, int]], tables: list[list[int]]
    ) -> tuple[list[Sequence], torch.Tensor]:
        """Compute `n` new positions of each planned sequence; returns the sequences that reached
        their last known token (they sample next) and their fp32 logits [R, V]."""
        tokens, positions, q_lens, starts, rows, ready = [], [], [], [], [], []
        offset = 0
        for seq, n in plan:
            start = seq.num_cached
            tokens.extend(_slice(seq, start, start + n))
            positions.extend(range(start, start + n))
            q_lens.append(n)
            starts.append(start)
            offset += n
            if start + n == seq.num_tokens:
                rows.append(offset - 1)
                ready.append(seq)
        dev = self.device
        batch = ForwardBatch(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            q_lens=q_lens,
            kv=PagedKV(self.cache, tables, starts, q_lens),
            msa_dense_window=self.msa_dense_window,
        )
        ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        logits = self.model.forward_batch(ids, batch, torch.tensor(rows, dtype=torch.long, device=dev))
        for seq, n in plan:
            seq.num_cached += n
        return ready, logits


def _slice(seq: Sequence, start: int, end: int) -> list[int]:
    """token_ids[start:end] without concatenating prompt and output."""
    p = len(seq.prompt_ids)
    if end <= p:
        return seq.prompt_ids[start:end]
    if start >= p:
        return seq.output_ids[start - p : end - p]
    return seq.prompt_ids[start:] + seq.output_ids[: end - p]
