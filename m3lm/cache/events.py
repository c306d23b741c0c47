"""The prefix cache's events (published when `--kv-events-config` asks: `m3lm.kv_events_config`).

A page is stored when it gets its name (`BlockManager.seal`: its 128 positions are written and
its name is new to the cache), removed when its name is forgotten (its room taken for other
contents, or a failed sequence's pages), and the cache is cleared when every name is forgotten
at once (`BlockManager.reset`). The block manager records them only when asked; the engine hands
them to the publisher (`engine.kv_events`) after each step. Pure Python: no sockets here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PagesStored:
    """Consecutive pages of one chain: `names[0]`'s parent is `parent` (None: the chain's start,
    without a cache salt), each later name's the one before it; `token_ids` are theirs, in order."""

    names: list[bytes]
    parent: bytes | None
    token_ids: list[int]


@dataclass
class PagesRemoved:
    names: list[bytes]


@dataclass
class CacheCleared:
    pass


PageEvent = PagesStored | PagesRemoved | CacheCleared


def record(log: list[PageEvent], event: PageEvent) -> None:
    """Append `event`, merged into the last event where it continues it (the next page of the same
    chain, another removal): the order of what happened is kept, in fewer events."""
    last = log[-1] if log else None
    if isinstance(event, PagesStored) and isinstance(last, PagesStored) and last.names[-1] == event.parent:
        last.names += event.names
        last.token_ids += event.token_ids
    elif isinstance(event, PagesRemoved) and isinstance(last, PagesRemoved):
        last.names += event.names
    else:
        log.append(event)
