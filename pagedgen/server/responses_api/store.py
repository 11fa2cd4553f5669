"""Stored responses: what ``previous_response_id`` and ``GET /v1/responses/{id}`` find, bounded and evictable.

An LRU map bounded by count, JSON bytes and age (each a ``pagedgen serve`` flag); every response it drops
has its kept engine Request released. docs/server.md, "The Responses API" ("Stored responses are
bounded"), has the bounds.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_MAX_AGE_S = 3600.0


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """The store's bounds: ``max_responses`` responses, ``max_bytes`` of JSON, ``max_age_s`` seconds each."""

    max_responses: int = DEFAULT_MAX_RESPONSES
    max_bytes: int = DEFAULT_MAX_BYTES
    max_age_s: float = DEFAULT_MAX_AGE_S

    def __post_init__(self) -> None:
        if isinstance(self.max_responses, bool) or not isinstance(self.max_responses, int):
            raise ValueError(f"StoreLimits.max_responses must be an int, got {self.max_responses!r}")
        if self.max_responses < 0:
            raise ValueError(f"StoreLimits.max_responses must be >= 0, got {self.max_responses}")
        if self.max_bytes < 0:
            raise ValueError(f"StoreLimits.max_bytes must be >= 0, got {self.max_bytes}")
        if not self.max_age_s > 0:
            raise ValueError(f"StoreLimits.max_age_s must be positive, got {self.max_age_s}")


@dataclass(slots=True)
class StoredResponse:
    """One finished response: ``kept`` when its engine Request may still be open for a follow-up."""

    id: str
    payload: JsonObject
    conversation: list[JsonObject]
    kept: bool
    size: int = 0
    stored_at: float = 0.0


def json_size(value: object) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


@dataclass(slots=True)
class ResponseStore:
    """The LRU map of stored responses; ``clock`` is injectable for tests.

    A stored response holds its payload (what ``GET`` returns) and its conversation as chat messages (what
    a follow-up's prompt starts with). Putting, reading and deleting evict first what is too old, then the
    least recently used until the bounds hold; a response larger than the whole byte bound is not stored.
    Every removed response is handed to ``release`` (its engine Request may still be open). Handlers call
    the store from the event loop and from the threads that build payloads, so it has a lock.
    """

    limits: StoreLimits
    release: Callable[[str], None]  # closes the engine Request kept for a response's follow-up
    clock: Callable[[], float] = time.monotonic
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, record: StoredResponse) -> bool:
        """Store ``record`` (the most recently used); False, and its Request released, if it is too big."""
        record.size = json_size(record.payload) + json_size(record.conversation)
        record.stored_at = self.clock()
        removed = []
        with self._lock:
            if record.size > self.limits.max_bytes or self.limits.max_responses == 0:
                removed.append(record)
            else:
                self._pop(record.id)  # a replaced record: its Request, if kept, is the new one's
                self._entries[record.id] = record
                self._bytes += record.size
                removed.extend(self._evict())
        self._released(removed)
        return record not in removed

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None if it is not (or no longer) stored."""
        with self._lock:
            removed = self._evict()
            record = self._entries.get(response_id)
            if record is not None:
                self._entries.move_to_end(response_id)
        self._released(removed)
        return record

    def delete(self, response_id: str) -> bool:
        with self._lock:
            removed = self._evict()
            found = self._pop(response_id)
        self._released(removed + found)
        return bool(found)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def _pop(self, response_id: str) -> list[StoredResponse]:
        record = self._entries.pop(response_id, None)
        if record is None:
            return []
        self._bytes -= record.size
        return [record]

    def _evict(self) -> list[StoredResponse]:
        """Remove what is too old, then the least recently used past the bounds (under the lock)."""
        removed = []
        oldest_allowed = self.clock() - self.limits.max_age_s
        for record in list(self._entries.values()):
            if record.stored_at < oldest_allowed:
                removed.extend(self._pop(record.id))
        while self._entries and (
            len(self._entries) > self.limits.max_responses or self._bytes > self.limits.max_bytes
        ):
            removed.extend(self._pop(next(iter(self._entries))))
        return removed

    def _released(self, records: list[StoredResponse]) -> None:
        for record in records:
            if record.kept:
                self.release(record.id)
