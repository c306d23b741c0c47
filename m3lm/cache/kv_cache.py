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

    def write_index(self, layer: int, at, ik: torch.Tensor) -> None:
        """Store index keys ik [n, Di] at `at` (`put`), quantised per position when fp8."""
        if layer in self.ik_scale:
            q, scale = quantize_rows_fp8(ik)
            put(self.ik[layer], at, q)
            put(self.ik_scale[layer], at, scale)
        else:
            put(self.ik[layer], at, ik.to(self.ik[layer].dtype))

    def read_index(self, layer: int, table, total: int, dtype: torch.dtype) -> torch.Tensor:
        """A sequence's index keys [total, Di] from its pages `table` (a page list, or a slice of
        consecutive pages: then a view), dequantised to `dtype`."""
        keys = rows(self.ik[layer], table, total)
        if layer in self.ik_scale:
            return dequant_rows_fp8(keys, rows(self.ik_scale[layer], table, total), dtype)
        return keys


def rows(pool: torch.Tensor, table, total: int) -> torch.Tensor:
    """Positions 0..total-1 of a sequence from pool [P, S, ...] and its pages `table` (a page
    list: gathered; or a slice of consecutive pages: a view) -> [total, ...]."""
    return pool[table].flatten(0, 1)[:total]


def put(pool: torch.Tensor, at, new: torch.Tensor) -> None:
    """pool [P, S, ...] at `at` = new: `at` is (pages, slots) [n] each, or a slice of positions
    over the pages laid end to end (a copy into a view, no index kernel)."""
    if isinstance(at, slice):
        pool.flatten(0, 1)[at] = new
    else:
        pool[at] = new


class PagedKV:
    """The `KVStore` of one forward pass: sequence i writes positions starts[i].. into its pages.

    A sequence whose pages are consecutive (a fresh cache hands them out in order) writes and
    reads its keys through views of the pools; otherwise its page list goes to the device, new
    keys are scattered to (page, slot) and its keys are gathered in position order ([Tk, K, D]).
    Device work is made on first use, so a prefill's first products are queued before it.
    """

    def __init__(self, cache: KVCache, tables: list[list[int]], starts: list[int], q_lens: list[int]):
        self.cache = cache
        self.starts = list(starts)
        s = cache.page_size
        self._seqs: list[tuple[list[int], int, slice | None]] = []  # (pages, total, the run of pages)
        for table, start, n in zip(tables, starts, q_lens, strict=True):
            total = start + n
            assert len(table) * s >= total, "pages must be allocated before the forward"
            pages = list(table[: -(-total // s)])
            first = pages[0] if pages else 0
            run = (
                slice(first, first + len(pages)) if pages == list(range(first, first + len(pages))) else None
            )
            self._seqs.append((pages, total, run))
        self._tables: dict[int, torch.Tensor] = {}
        self._write: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, seq: int) -> slice | torch.Tensor:
        """Sequence `seq`'s pages: a slice when consecutive, else the page list on the device
        (copied from pinned memory: the host does not wait for the stream)."""
        pages, _, run = self._seqs[seq]
        if run is not None:
            return run
        if seq not in self._tables:
            device = self.cache.k[0].device
            host = torch.tensor(pages, dtype=torch.long, pin_memory=device.type == "cuda")
            self._tables[seq] = host.to(device, non_blocking=True)
        return self._tables[seq]

    def _at(self, seq: int):
        """Where sequence `seq`'s new positions go (`put`)."""
        _, total, run = self._seqs[seq]
        start, s = self.starts[seq], self.cache.page_size
        if run is not None:
            return slice(run.start * s + start, run.start * s + total)
        if seq not in self._write:
            table = self._table(seq)
            pos = torch.arange(start, total, device=table.device)
            self._write[seq] = (table[pos // s], pos % s)
        return self._write[seq]

    def _append(self, pool: torch.Tensor, seq: int, new: torch.Tensor) -> torch.Tensor:
        put(pool, self._at(seq), new.to(pool.dtype))
        return rows(pool, self._table(seq), self._seqs[seq][1])

    def update(
        self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._append(self.cache.k[layer], seq, k), self._append(self.cache.v[layer], seq, v)

    def update_index(self, layer: int, seq: int, ik: torch.Tensor) -> torch.Tensor:
        self.cache.write_index(layer, self._at(seq), ik)
        return self.cache.read_index(layer, self._table(seq), self._seqs[seq][1], ik.dtype)
