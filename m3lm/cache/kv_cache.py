"""Paged KV and index-key pools, and the per-forward view that attention layers write through.

Pools: per layer K and V [P, S, K, D]; per sparse layer index keys [P, S, Di] (post-norm,
post-RoPE). P pages of S positions; page p of a sequence holds positions S*i .. S*i+S-1 where
p = table[i].
"""

from __future__ import annotations

import torch

from m3lm.config import ModelArgs


class KVCache:
    def __init__(
        self,
        args: ModelArgs,
        num_pages: int,
        device: torch.device | str,
        dtype: torch.dtype,
        kv_heads: int | None = None,
    ):
        """`kv_heads`: the KV heads this rank holds under tensor parallelism (default: all)."""
        self.page_size = args.index_block_size
        self.num_pages = num_pages
        shape = (num_pages, self.page_size, kv_heads or args.num_key_value_heads, args.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.num_hidden_layers)]
        ishape = (num_pages, self.page_size, args.index_head_dim)
        self.ik = {
            i: torch.zeros(ishape, device=device, dtype=dtype)
            for i, sparse in enumerate(args.sparse_layers)
            if sparse
        }

    @staticmethod
    def bytes_per_page(args: ModelArgs, dtype: torch.dtype, kv_heads: int | None = None) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        kv = 2 * args.num_hidden_layers * (kv_heads or args.num_key_value_heads) * args.head_dim
        index = sum(args.sparse_layers) * args.index_head_dim
        return args.index_block_size * (kv + index) * elem


class PagedKV:
    """The `KVStore` of one forward pass: sequence i writes positions starts[i].. into its pages.

    Reference path: after writing, a sequence's keys are gathered from its pages in position
    order ([Tk, K, D]); the GPU kernels read the pages in place instead.
    """

    def __init__(self, cache: KVCache, tables: list[list[int]], starts: list[int], q_lens: list[int]):
        self.cache = cache
        s = cache.page_size
        device = cache.k[0].device
        self._write, self._read = [], []
        for table, start, n in zip(tables, starts, q_lens, strict=True):
            total = start + n
            assert len(table) * s >= total, "pages must be allocated before the forward"
            t = torch.tensor(table[: -(-total // s)], dtype=torch.long, device=device)
            pos = torch.arange(start, total, device=device)
            self._write.append((t[pos // s], pos % s))
            self._read.append((t, total))

    def _append(self, pool: torch.Tensor, seq: int, new: torch.Tensor) -> torch.Tensor:
        pages, slots = self._write[seq]
        pool[pages, slots] = new.to(pool.dtype)
        table, total = self._read[seq]
        return pool[table].flatten(0, 1)[:total]

    def update(
        self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._append(self.cache.k[layer], seq, k), self._append(self.cache.v[layer], seq, v)

    def update_index(self, layer: int, seq: int, ik: torch.Tensor) -> torch.Tensor:
        return self._append(self.cache.ik[layer], seq, ik)
