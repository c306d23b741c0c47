"""Page allocation for the paged caches, with prefix caching (pure Python, no tensors).

A page holds `page_size` consecutive positions of one sequence; the page size equals the MSA
block size, so a block the indexer selects is exactly one page. Each sequence owns a block
table (its pages in position order); KV and index-key pools share that one table.

Prefix caching: a full page's contents are a function of the tokens at and before its positions
(positions start at 0 in every sequence, and MSA anchors its blocks to them), so each full page
is named by a SHA-256 chain over its sequence's tokens, page by page (`seal`). A new sequence
starts on the pages that already hold its longest named prefix (`match`), shared and never
written again: a sequence writes only at positions past its cache, and only full pages get
names. A page whose last owner ends keeps its name and contents while nothing needs the room;
allocation takes unnamed free pages first, then the least recently released named ones, a
sequence's tail before its head. A sequence admitted to compute pages that no cache holds yet
promises their names (`promise`); a prompt whose next page is promised waits for it (`awaits`)
rather than compute it a second time (n choices of one prompt, or requests that arrive together
with a shared system prompt). With `events` the manager records each page named, each name
forgotten and each reset (`cache.events`), for the engine to publish.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable

from m3lm.cache.events import CacheCleared, PageEvent, PagesRemoved, PagesStored, record


def page_key(parent: bytes, tokens: list[int]) -> bytes:
    """The name of a full page: SHA-256 of the previous page's name and this page's token ids."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True, events: bool = False):
        assert num_pages > 0 and page_size > 0
        self.num_pages, self.page_size = num_pages, page_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_pages))  # pages holding nothing reusable
        self._tables: dict[int, list[int]] = {}
        self._refs: dict[int, int] = {}  # page -> sequences holding it
        self._names: dict[int, bytes] = {}  # page -> its name, for full pages whose contents are known
        self._pages: dict[bytes, int] = {}  # name -> page
        self._idle: OrderedDict[int, None] = OrderedDict()  # named pages no sequence holds, oldest first
        self._chains: dict[int, list[bytes]] = {}  # seq -> names of its full pages so far
        self._promised: dict[bytes, int] = {}  # name -> the sequence about to compute that page
        self._promises: dict[int, list[bytes]] = {}  # seq -> the names it promised
        self._roots: dict[int, bytes] = {}  # seq -> the name its chain starts from (its cache salt)
        self._events: list[PageEvent] | None = [] if events else None  # None: nothing recorded

    @property
    def num_free(self) -> int:
        """Pages a sequence can take now (named pages that no sequence holds included)."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_idle(self) -> int:
        """Named pages kept for later prefixes that no sequence holds."""
        return len(self._idle)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def missing_pages(self, seq_id: int, tokens: int) -> int:
        """Pages `seq_id` still needs to hold `tokens` positions."""
        return max(0, self.pages_for(tokens) - len(self.table(seq_id)))

    def match(self, seq_id: int, tokens: list[int], salt: str | None = None, reuse: bool = True) -> int:
        """Start a sequence that holds no pages on the cached pages of its longest prefix; returns
        the positions they hold. At least the last token is left to compute (its logits are
        needed), so a prompt found whole gives back its last page, which is then recomputed.
        With a `salt` the chain of page names starts from it: only sequences with the same salt
        share pages, so one tenant cannot learn from timing or cached counts what another sent.
        Without `reuse` nothing is matched (the sequence computes every position), but the pages
        it fills are named as usual for later sequences."""
        assert not self.table(seq_id), "match only starts a sequence"
        if not self.prefix_caching:
            return 0
        root = hashlib.sha256(b"cache_salt\0" + salt.encode()).digest() if salt else b""
        if root:
            self._roots[seq_id] = root
        if not reuse:
            self._tables[seq_id], self._chains[seq_id] = [], []
            return 0
        names, pages, name = [], [], root
        for start in range(0, len(tokens) - self.page_size, self.page_size):  # pages before the last token
            name = page_key(name, tokens[start : start + self.page_size])
            page = self._pages.get(name)
            if page is None:
                break
            names.append(name)
            pages.append(page)
        for page in pages:
            self._idle.pop(page, None)
            self._refs[page] = self._refs.get(page, 0) + 1
        self._tables[seq_id] = pages
        self._chains[seq_id] = names
        return len(pages) * self.page_size

    def promise(self, seq_id: int, tokens: list[int]) -> None:
        """The sequence (started by `match`) is about to compute the full pages of `tokens` past its
        cached prefix: their names are promised to it until it seals them or ends."""
        if not self.prefix_caching:
            return
        chain = self._chains.get(seq_id, [])
        name, names = (chain[-1] if chain else self._roots.get(seq_id, b"")), []
        for start in range(len(chain) * self.page_size, len(tokens) - self.page_size + 1, self.page_size):
            name = page_key(name, tokens[start : start + self.page_size])
            if name not in self._pages and name not in self._promised:
                self._promised[name] = seq_id
                names.append(name)
        self._promises[seq_id] = names

    def awaits(self, seq_id: int, tokens: list[int]) -> bool:
        """Whether the page after the sequence's matched prefix (`match`) is one that `match` could
        take and that another sequence has promised to compute."""
        chain = self._chains.get(seq_id, [])
        start = len(chain) * self.page_size
        if not self.prefix_caching or start + self.page_size >= len(tokens):
            return False
        name = page_key(
            chain[-1] if chain else self._roots.get(seq_id, b""), tokens[start : start + self.page_size]
        )
        return self._promised.get(name, seq_id) != seq_id

    def ensure(self, seq_id: int, tokens: int) -> bool:
        """Grow the sequence's table to hold `tokens` positions; all or nothing."""
        need = self.missing_pages(seq_id, tokens)
        if need > self.num_free:
            return False
        # In ascending order: pages taken as a run stay one (reclaimed cached pages come tail
        # first), so the forward can use a view of the pools instead of a page list.
        new = sorted(self._take() for _ in range(need))
        self._refs.update(dict.fromkeys(new, 1))
        self._tables.setdefault(seq_id, []).extend(new)
        return True

    def seal(self, seq_id: int, cached: int, tokens: Callable[[int, int], list[int]]) -> None:
        """Name the sequence's pages that `cached` positions have filled. tokens(start, end): the
        sequence's token ids at those positions."""
        if not self.prefix_caching:
            return
        chain = self._chains.setdefault(seq_id, [])
        table = self._tables.get(seq_id, [])
        while (len(chain) + 1) * self.page_size <= cached:
            start = len(chain) * self.page_size
            parent, ids = (
                chain[-1] if chain else self._roots.get(seq_id, b""),
                tokens(start, start + self.page_size),
            )
            name = page_key(parent, ids)
            chain.append(name)
            self._promised.pop(name, None)
            page = table[len(chain) - 1]
            if name not in self._pages:  # else another sequence's page holds these contents already
                self._pages[name], self._names[page] = page, name
                if self._events is not None:
                    record(self._events, PagesStored([name], parent or None, list(ids)))

    def free(self, seq_id: int, keep: bool = True) -> None:
        """Release every page of the sequence at once (finish, abort or preemption): named pages
        stay cached, tail first in line to be reused. keep=False (a failed sequence) forgets the
        names of the pages it alone held, so that nothing it wrote is reused."""
        self._chains.pop(seq_id, None)
        self._roots.pop(seq_id, None)
        for name in self._promises.pop(seq_id, []):
            if self._promised.get(name) == seq_id:
                del self._promised[name]
        for page in reversed(self._tables.pop(seq_id, [])):
            self._refs[page] -= 1
            if self._refs[page] > 0:
                continue
            del self._refs[page]
            if page in self._names and not keep:
                self._forget(page)
            if page in self._names:
                self._idle[page] = None
            else:
                self._free.append(page)

    def trim(self, seq_id: int, tokens: int) -> None:
        """Give back the sequence's pages past the first `tokens` positions (the pages that only
        rejected draft tokens reached). They were allocated for it and never named (`seal` names
        only pages below the sequence's valid positions), so they go straight back to the free list."""
        table = self._tables.get(seq_id, [])
        keep = self.pages_for(tokens)
        for page in reversed(table[keep:]):
            assert self._refs[page] == 1 and page not in self._names, "only fresh pages are trimmed"
            del self._refs[page]
            self._free.appendleft(page)  # taken again first: still warm in the caches
        del table[keep:]

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._idle.popitem(last=False)  # the least recently released named page
        self._forget(page)
        return page

    def _forget(self, page: int) -> None:
        name = self._names.pop(page)
        del self._pages[name]
        if self._events is not None:
            record(self._events, PagesRemoved([name]))

    def reset(self) -> None:
        """Forget every page's name: the prefix cache starts empty. Pages that sequences hold stay
        theirs (their contents are still right for them), and the pages they fill from now on are
        named as usual."""
        self._free.extend(self._idle)
        self._idle.clear()
        self._names.clear()
        self._pages.clear()
        if self._events is not None:
            self._events.append(CacheCleared())

    def take_events(self) -> list[PageEvent]:
        """What happened to the cache since the last call, in order (empty unless recording)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def cached(self) -> frozenset[bytes]:
        """The names of the pages whose contents a later prefix can reuse."""
        return frozenset(self._pages)

    def check(self) -> None:
        """Invariants: every page is free, idle or held (its count = the tables that hold it), names
        and pages map one to one, and promised names belong to live sequences and to no page yet."""
        held: dict[int, int] = {}
        for table in self._tables.values():
            for p in table:
                held[p] = held.get(p, 0) + 1
        assert held == self._refs
        parts = [set(held), set(self._free), set(self._idle)]
        assert sum(map(len, parts)) == self.num_pages == len(set().union(*parts))
        assert len(self._free) == len(set(self._free))
        assert all(p in self._names for p in self._idle)
        assert all(p not in self._names for p in self._free)
        assert {p: n for n, p in self._pages.items()} == self._names
        assert all(seq in self._tables for seq in self._promised.values())
        assert not self._promised.keys() & self._pages.keys()
