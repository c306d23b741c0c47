"""Decode steps on the CPU as one compiled program (torch.compile), the CPU's counterpart of
`cuda_graphs.DecodeGraphs`, with the same calls.

Op by op, a decode step of a small model costs the interpreter and the dispatcher more than the
arithmetic. Its graph (`MiniMaxM3.forward_batch` over a `DecodeBatch`) has no host reads, so it
compiles whole: fused C++ loops around the matrix products, the weights frozen into the
program and repacked for them. One graph serves a batch of one and one every larger batch and
table width (both symbolic), so a warm-up compiles two graphs; the batch of one's loops run on
one thread, as waking a second costs more than they take. After the warm-up a shape that
would need a new graph runs eagerly instead of compiling while serving; where compiling fails
(no C++ compiler), every step runs eagerly, with one warning. Frozen weights are copies: the
weights' memory doubles, and a change to the weights after the compile is not seen.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch._inductor import config as inductor_config
from torch.fx.experimental import _config as fx_config

from m3lm.cache.kv_cache import KVCache
from m3lm.core import DecodeBatch
from m3lm.models.minimax_m3 import MiniMaxM3

log = logging.getLogger("m3lm.engine")

# Engines made one after another in a process (tests, benchmarks) each add their graphs to the
# step's cache of compiled code; torch's default limit of 8 would send later ones to eager.
RECOMPILE_LIMIT = 64


class CompiledDecode:
    """`run(tokens, positions, tables)` -> (fp32 logits [B, V] of one new token per row, None: it
    captures no drafter states, `layers` is empty), as `DecodeGraphs.run`.

    Block tables are padded (with the spare page) wider than a selection's top-k blocks (when a
    sequence's `max_pages` exceed it; else to `max_pages`), at least two pages, so that every
    width takes the same graph."""

    def __init__(self, model: MiniMaxM3, cache: KVCache, max_batch: int, spare_page: int, max_pages: int):
        self.model, self.cache, self.spare, self.max_batch = model, cache, spare_page, max_batch
        self.layers: tuple[int, ...] = ()
        topk = model.args.index_topk_blocks
        wide = (topk + 1 if max_pages > topk else max_pages) if any(model.args.sparse_layers) else 2
        self.min_width = max(2, wide)
        self.buckets = [1, 2] if max_batch > 1 else [1]  # a graph each: 1, and every B >= 2
        self.failed: str | None = None  # why compiling failed: every step then runs eagerly
        self._compiled_shapes: set[int] = set()
        self.compile_s = 0.0  # seconds spent compiling graphs so far
        self._warm = False  # after `capture_all`: a new graph runs eagerly, never compiles
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self._compiled = torch.compile(self._step, fullgraph=True)

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        dec = DecodeBatch.build(positions, tables, self.cache, self.cache.page_size)
        return self.model.forward_batch(tokens, dec)  # [B, V]

    def bucket(self, n: int) -> int:
        return 1 if n == 1 else 2

    def capture_all(self, each: Callable[[int], None] | None = None) -> list[int]:
        """Compile each graph not compiled yet (the warm-up does: no request waits for a compile)
        on padding rows that write to the spare page, calling each(b) after graph b; returns
        the graphs compiled now. From then on a shape without a graph runs eagerly."""
        new = [b for b in self.buckets if b not in self._compiled_shapes]
        for b in new:
            self.run([0] * b, [0] * b, [[self.spare]] * b)
            if each is not None:
                each(b)
        self._warm = True
        return [b for b in new if b in self._compiled_shapes]

    @torch.inference_mode()
    def run(
        self, tokens: list[int], positions: list[int], tables: list[list[int]]
    ) -> tuple[torch.Tensor, None]:
        return self._logits(tokens, positions, tables), None

    def _logits(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        n = len(tokens)
        width = max(self.min_width, *map(len, tables))
        host = np.full((n, width), self.spare, dtype=np.int32)
        for i, table in enumerate(tables):
            host[i, : len(table)] = table
        args = (torch.tensor(tokens), torch.tensor(positions), torch.from_numpy(host))
        if self.failed is None:
            try:
                return self._run_compiled(*args)
            except Exception as e:  # any failure to compile: this engine runs eagerly
                self.failed = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
                log.warning("compiled CPU decode step unavailable, decoding eagerly (%s)", self.failed)
        return self._step(*args)

    def _run_compiled(self, *args: torch.Tensor) -> torch.Tensor:
        b = self.bucket(args[0].shape[0])
        if b not in self._compiled_shapes:
            if self._warm:
                return self._step(*args)  # never compile while serving
            self._step(*args)  # an eager step first packs the weights the graph reads as they are
            # Without duck shapes a size equal to a model dimension (2 KV heads, 8 blocks) by
            # chance is not taken for it: the graph stays general in B and the width.
            tokens, positions, tables = args
            for t in (tokens, positions, tables):
                torch._dynamo.maybe_mark_dynamic(t, 0)  # B (a batch of one is its own graph)
            torch._dynamo.maybe_mark_dynamic(tables, 1)
            # Frozen: the weights become constants, repacked for the CPU's matrix products.
            # The batch of one's loops on one thread: waking a second costs more than its tiny
            # loops take (larger batches keep torch's threads).
            options = {"freezing": True, **({"cpp.threads": 1} if b == 1 else {})}
            start = time.perf_counter()
            with fx_config.patch(use_duck_shape=False), inductor_config.patch(options):
                out = self._compiled(*args)
            self.compile_s += time.perf_counter() - start
            self._compiled_shapes.add(b)
            return out
        # The model and the caches never change under a graph, and the padding keeps every
        # table in the graphs' range: of the guards only those telling the graphs apart are needed.
        with torch.compiler.set_stance("eager_on_recompile", skip_guard_eval_unsafe=True):
            return self._compiled(*args)
