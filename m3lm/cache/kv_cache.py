"""Paged KV and index-key pools, and the per-forward view that attention layers write through.

Pools: per layer K and V [P, S, K, D]; per sparse layer index keys [P, S, Di] (post-norm,
post-RoPE), optionally e4m3 with one fp32 scale per position [P, S] (`index_fp8`, off by
default: it halves the index keys' bytes at the cost of rounding the scores). P pages of S positions; page p of a sequence holds positions S*i .. S*i+S-1 where
p = table[i].
"""

from __future__ import annotations

import torch

from m3lm.config import ModelArgs
from m3lm.kernels.fp8 import dequant_rows_fp8, quantize_rows_fp8


class KVCache:
    def __init__(
        self,
        args: ModelArgs,
        num_pages: int,
        device: torch.device | str,
        dtype: torch.dtype,
        index_fp8: bool = False,
        kv_heads: int | None = None,
    ):
        """`kv_heads`: the KV heads this rank holds under tensor parallelism (default: all)."""
        self.page_size = args.index_block_size
        self.num_pages = num_pages
        shape = (num_pages, self.page_size, kv_heads or args.num_key_value_heads, args.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.num_hidden_layers)]
        ishape = (num_pages, self.page_size, args.index_head_dim)
        sparse = [i for i, sp in enumerate(args.sparse_layers) if sp]
        idt = torch.float8_e4m3fn if index_fp8 else dtype
        self.ik = {i: torch.zeros(ishape, device=device, dtype=idt) for i in sparse}
        # Per-position scales of the fp8 index keys (empty when the keys are kept in `dtype`).
        self.ik_scale = {i: torch.zeros(ishape[:2], device=device) for i in sparse} if index_fp8 else {}

    @staticmethod
    def bytes_per_page(
        args: ModelArgs, dtype: torch.dtype, index_fp8: bool = False, kv_heads: int | None = None
    ) -> int:
        """Bytes of one page over all layers; `kv_heads` as in the constructor."""
        elem = torch.empty(0, dtype=dtype).element_size()
        kv = 2 * args.num_hidden_layers * (kv_heads or args.num_key_value_heads) * args.head_dim * elem
        index = sum(args.sparse_layers) * (
            args.index_head_dim + 4 if index_fp8 else args.index_head_dim * elem
        )
        return args.index_block_size * (kv + index)

    def write_index(self, layer: int, pages: torch.Tensor, slots: torch.Tensor, ik: torch.Tensor) -> None:
        """Store index keys ik [n, Di] at (pages, slots) [n], quantised per position when fp8."""
        if layer in self.ik_scale:
            q, scale = quantize_rows_fp8(ik)
            self.ik[layer][pages, slots] = q
            self.ik_scale[layer][pages, slots] = scale
        else:
            self.ik[layer][pages, slots] = ik.to(self.ik[layer].dtype)

    def read_index(self, layer: int, table: torch.Tensor, total: int, dtype: torch.dtype) -> torch.Tensor:
        """A sequence's index keys [total, Di] from its pages `table`, dequantised to `dtype`."""
        keys = self.ik[layer][table].flatten(0, 1)[:total]
        if layer in self.ik_scale:
            return dequant_rows_fp8(keys, self.ik_scale[layer][table].flatten(0, 1)[:total], dtype)
        return keys


class PagedKV:
    """The `KVStore` of one forward pass: sequence i writes positions starts[i].. into its pages.

    Reference path: after writing, a sequence's keys are gathered from its pages in position
    order ([Tk, K, D]); the GPU kernels read the pages in place instead.
    """

    def __init__(self, cache: KVCache, tables: list[list[int]], starts: list[int], q_lens: list[int]):
        self.cache = cache
        self.starts = list(starts)
        s = cache.page_size
        device = cache.k[0].device
        self._write: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._read = []
        for table, start, n in zip(tables, starts, q_lens, strict=True):
            total = start + n
            assert len(table) * s >= total, "pages must be allocated before the forward"
            # The page list goes to the device now, while the GPU is idle: a copy from pageable
            # memory waits for the stream, which later would stall the host behind the GPU.
            t = torch.tensor(table[: -(-total // s)], dtype=torch.long, device=device)
            self._read.append((t, total))

    def _slots(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, slot) [n] of each new position of sequence `seq`; made on first use, so that a
        prefill's first products are queued before these small launches."""
        if seq not in self._write:
            (table, total), start, s = self._read[seq], self.starts[seq], self.cache.page_size
            pos = torch.arange(start, total, device=table.device)
            self._write[seq] = (table[pos // s], pos % s)
        return self._write[seq]

    def _append(self, pool: torch.Tensor, seq: int, new: torch.Tensor) -> torch.Tensor:
        pages, slots = self._slots(seq)
        pool[pages, slots] = new.to(pool.dtype)
        table, total = self._read[seq]
        return pool[table].flatten(0, 1)[:total]

    def update(
        self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._append(self.cache.k[layer], seq, k), self._append(self.cache.v[layer], seq, v)

    def update_index(self, layer: int, seq: int, ik: torch.Tensor) -> torch.Tensor:
        pages, slots = self._slots(seq)
        self.cache.write_index(layer, pages, slots, ik)
        table, total = self._read[seq]
        return self.cache.read_index(layer, table, total, ik.dtype)
