"""A thread-safe LRU cache bounded by both its entry count and the bytes its entries are charged.

The guidance caches hold compiled grammars whose size follows the constraint a client sent: a count bound
alone let 60 distinct half-megabyte regexes grow a server by 841 MB. Each entry is charged a byte cost when
it is stored (the caller estimates it from the grammar's size), and the least recently used entries are
dropped until both bounds hold again. An entry costing more than the whole byte bound is not stored at all
(the value is still returned to its caller, it is just not kept).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class BoundedLru(Generic[V]):
    """``get`` / ``put`` under a lock; ``num_bytes`` is the sum of the stored entries' costs."""

    def __init__(self, max_entries: int, max_bytes: int):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"a cache needs max_entries and max_bytes >= 1, got {max_entries}, {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, value: V, cost: int) -> None:
        """Store ``value`` charged ``cost`` bytes, then drop the oldest entries past either bound."""
        if cost > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= old[1]
            self._entries[key] = (value, cost)
            self.num_bytes += cost
            while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
                _key, (_value, dropped) = self._entries.popitem(last=False)
                self.num_bytes -= dropped

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.num_bytes = 0
