"""The Responses API's store: responses kept for `previous_response_id` and `GET`, bounded in
count and bytes, by API key, fair between keys."""

from __future__ import annotations

import threading
from collections import OrderedDict

import msgspec

STORED = 256  # responses kept for previous_response_id and GET
STORED_BYTES = 64 << 20  # and their JSON's bytes at most


class ResponseStore:
    """Stored responses with the items of their conversation, by id within one API key's
    namespace (a tenant), at most `capacity` of them and `max_bytes` of their JSON. When full,
    the tenant holding the most bytes loses its least recently used one: a tenant that stores
    more than the others evicts its own responses, not theirs. Whole responses are stored from
    the replies' threads, streamed ones from the event loop: a lock keeps the two apart."""

    def __init__(self, capacity: int = STORED, max_bytes: int = STORED_BYTES) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self._entries: OrderedDict[tuple[str | None, str], tuple[dict, list[dict], int]] = OrderedDict()
        self._bytes: dict[str | None, int] = {}  # each tenant's, of what it stores
        self._lock = threading.Lock()

    def put(self, tenant: str | None, response: dict, items: list[dict]) -> None:
        size = len(msgspec.json.encode([response, items]))
        if size > self.max_bytes:
            return  # never kept: it would take the whole store
        with self._lock:
            self._put(tenant, response, items, size)

    def _put(self, tenant: str | None, response: dict, items: list[dict], size: int) -> None:
        self._drop((tenant, response["id"]))
        self._entries[(tenant, response["id"])] = (response, items, size)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        while len(self._entries) > self.capacity or sum(self._bytes.values()) > self.max_bytes:
            largest = max(self._bytes, key=self._bytes.__getitem__)
            self._drop(next(k for k in self._entries if k[0] == largest))  # its least recently used

    def _drop(self, key: tuple[str | None, str]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes[key[0]] -= entry[2]
            if not self._bytes[key[0]]:
                del self._bytes[key[0]]

    def get(self, tenant: str | None, rid: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            entry = self._entries.get((tenant, rid))
            if entry is None:
                return None
            self._entries.move_to_end((tenant, rid))
            return entry[0], entry[1]
