"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step (one new token for each of B sequences: `MiniMaxM3.forward_batch` over a
`DecodeBatch`) has static shapes on the GPU, so it is captured once per bucket (1, 2, 4, ..., max)
and replayed: the step costs one graph launch instead of hundreds of kernel launches. Inputs are
copied into static buffers from pinned host memory; rows past B point at a spare page the block
manager never hands out. A verification step is such a step too: a sequence's last token and its
drafts are rows at consecutive positions over its one table (`DecodeBatch`). With `capture`
(`layers`: those an EAGLE-3 drafter reads) each graph also writes the residual stream entering
those layers [B, len(layers) * C] into a static buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from m3lm.cache.kv_cache import KVCache
from m3lm.layers.batch import DecodeBatch
from m3lm.models.minimax_m3 import MiniMaxM3


def capture_graph(fn: Callable[[], object], pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """(the CUDA graph of fn(), its output): fn runs twice on a side stream first, so that its
    kernels compile and the allocator settles outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class DecodeGraphs:
    def __init__(
        self,
        model: MiniMaxM3,
        cache: KVCache,
        max_batch: int,
        max_pages: int,
        spare_page: int,
        capture: tuple[int, ...] = (),
    ):
        self.model, self.cache, self.layers = model, cache, capture
        self.page_size = cache.page_size
        self.buckets = sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})
        dev = model.lm_head.weight.device
        self.max_batch, self.max_pages, self.spare = max_batch, max_pages, spare_page
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.tables = torch.full((max_batch, max_pages), spare_page, dtype=torch.int32, device=dev)
        self._host = torch.empty(max_batch, 2 + max_pages, dtype=torch.int64, pin_memory=True)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def _step(self, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        capture = dict.fromkeys(self.layers) if self.layers else None
        dec = DecodeBatch.build(self.positions[:b], self.tables[:b], self.cache, self.page_size, capture)
        logits = self.model.forward_batch(self.tokens[:b], dec)  # [b, V]
        return logits, torch.cat([capture[i] for i in self.layers], -1) if capture else None

    @torch.inference_mode()
    def capture(self, b: int) -> None:
        graph, (out, hidden) = capture_graph(lambda: self._step(b), self._pool)
        self._graphs[b] = (graph, out, hidden)

    def capture_all(self, each: Callable[[int], None] | None = None) -> list[int]:
        """Capture every bucket not captured yet (the warm-up does, so that no request waits for a
        capture), calling each(b) after bucket b; returns the buckets captured now."""
        new = [b for b in self.buckets if b not in self._graphs]
        for b in new:
            self.capture(b)
            if each is not None:
                each(b)
        return new

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def run(
        self, tokens: list[int], positions: list[int], tables: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 logits [B, V] for one new token per row (B <= max_batch), and the captured states
        [B, len(layers) * C] (None without `layers`)."""
        n = len(tokens)
        b = self.bucket(n)
        if b not in self._graphs:
            self.capture(b)
        host = self._host[:b].numpy()
        host[:, 0], host[:, 1], host[:, 2:] = 0, 0, self.spare
        host[:n, 0], host[:n, 1] = tokens, positions
        for i, table in enumerate(tables):
            if i and table is tables[i - 1]:  # a sequence's rows share its table
                host[i, 2:] = host[i - 1, 2:]
            else:
                host[i, 2 : 2 + len(table)] = table
        staged = self._host[:b].to(self.tokens.device, non_blocking=True)
        self.tokens[:b].copy_(staged[:, 0])
        self.positions[:b].copy_(staged[:, 1])
        self.tables[:b].copy_(staged[:, 2:])
        graph, out, hidden = self._graphs[b]
        graph.replay()
        return out[:n], None if hidden is None else hidden[:n]
