"""Page allocation for the paged caches (pure Python, no tensors).

A page holds `page_size` consecutive positions of one sequence; the page size equals the MSA
block size, so a block the indexer selects is exactly one page. Each sequence owns a block
table (its pages in position order); KV and index-key pools share that one table.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        assert num_pages > 0 and page_size > 0
        self.num_pages, self.page_size = num_pages, page_size
        self._free: deque[int] = deque(range(num_pages))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def missing_pages(self, seq_id: int, tokens: int) -> int:
        """Pages `seq_id` still needs to hold `tokens` positions."""
        return max(0, self.pages_for(tokens) - len(self.table(seq_id)))

    def ensure(self, seq_id: int, tokens: int) -> bool:
        """Grow the sequence's table to hold `tokens` positions; all or nothing."""
        need = self.missing_pages(seq_id, tokens)
        if need > len(self._free):
            return False
        table = self._tables.setdefault(seq_id, [])
        table.extend(self._free.popleft() for _ in range(need))
        return True

    def free(self, seq_id: int) -> None:
        """Return every page of the sequence at once (finish, abort or preemption)."""
        self._free.extend(self._tables.pop(seq_id, []))

    def check(self) -> None:
        """Invariant: every page is either free or owned by exactly one sequence."""
        owned = [p for t in self._tables.values() for p in t]
        assert len(owned) + len(self._free) == self.num_pages
        assert len(set(owned) | set(self._free)) == self.num_pages
