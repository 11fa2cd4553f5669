"""The cache manager the engine talks to: plan, reserve, release and report paged KV-cache ownership.

A facade over per-kind pieces (the full pool, the window-ring pool, the fixed-state pool, the prefix cache,
the block tables), so the scheduler and the step see one plan / reserve / commit / deallocate surface and
only a small result type crosses it. Committed state changes only at a reservation's commit or a
deallocation: docs/cache.md, "The cache manager".
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from pagedgen.cache.block_pool import BlockPool, BlockState
from pagedgen.cache.block_table import BlockTable, blocks_for_tokens
from pagedgen.cache.fixed_state_pool import FixedStatePool, FixedStateReservation
from pagedgen.cache.paged import (
    CacheCandidate,
    PlanLimits,
    ResourcePlan,
    blocks_needed,
    check_candidates,
    is_unserviceable,
    plan_resources,
)
from pagedgen.cache.prefix import PrefixCache, PrefixStats
from pagedgen.cache.reservation import Reservation, ReservedRow
from pagedgen.cache.window_pool import WindowRingSpec
from pagedgen.errors import CacheError


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of block accounting; ``blocks_per_request`` is a fresh dict in admission order.

    The ``window_*`` counts are the window-ring pool's (all 0 without one), ``fixed_*`` the fixed-state
    pool's slots (0 without one).
    """

    total_blocks: int
    free_blocks: int
    reserved_blocks: int
    owned_blocks: int
    resident_requests: int
    blocks_per_request: dict[Hashable, int] = field(default_factory=dict)
    window_total_blocks: int = 0
    window_free_blocks: int = 0
    window_reserved_blocks: int = 0
    window_owned_blocks: int = 0
    window_blocks_per_request: dict[Hashable, int] = field(default_factory=dict)
    fixed_total_slots: int = 0  # the fixed-state pool's slots (0 without one)
    fixed_free_slots: int = 0
    cached_blocks: int = 0  # unreferenced blocks holding a published prefix (included in free_blocks)
    prefix_blocks: int = 0  # blocks named in the prefix cache, referenced or not
    prefix: PrefixStats | None = None  # admissions' lookups (None: prefix caching off)


def _positive(name: str, value: int) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


class PagedCacheManager:
    """Paged KV-cache ownership for the dynamic engine.

    ``max_batch_size`` bounds both the rows of one step and the number of resident requests (idle
    turn-complete residents included). ``max_blocks_per_table`` is the widest block table the executor
    supports (``None``: only the pool bounds it). ``window`` adds the window-ring pool: each admission then
    also takes one ring of ``window.ring_blocks`` blocks from it. ``prefix_caching`` shares full blocks
    across requests (module docstring); it needs a purely paged cache, so it is refused with a window pool
    or fixed state. Raises ``ValueError`` for a non-positive setting, a window spec of another block size,
    or prefix caching with a window pool or fixed state.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_batch_size: int,
        max_blocks_per_table: int | None = None,
        window: WindowRingSpec | None = None,
        fixed: FixedStatePool | None = None,
        prefix_caching: bool = False,
    ):
        self.num_blocks = _positive("num_blocks", num_blocks)
        self.block_size = _positive("block_size", block_size)
        self.max_batch_size = _positive("max_batch_size", max_batch_size)
        self.max_blocks_per_table = (
            None if max_blocks_per_table is None else _positive("max_blocks_per_table", max_blocks_per_table)
        )
        if window is not None and window.block_size != self.block_size:
            raise ValueError(
                f"window block_size {window.block_size} differs from block_size {self.block_size}"
            )
        self.pool = BlockPool(self.num_blocks)
        self.window = window
        self.window_pool = None if window is None else BlockPool(window.num_blocks)
        self.ring_blocks = 0 if window is None else window.ring_blocks
        if fixed is not None and fixed.capacity < self.max_batch_size:
            raise ValueError(f"a fixed-state pool of {fixed.capacity} slots is smaller than max_batch_size")
        self.fixed = fixed
        if prefix_caching and (window is not None or fixed is not None):
            raise ValueError(
                "prefix caching needs a purely paged cache: a window ring or a fixed state cannot be "
                "restored at a cached block boundary"
            )
        self.prefix: PrefixCache | None = PrefixCache() if prefix_caching else None
        self._tables: dict[Hashable, BlockTable] = {}
        self._live: Reservation | None = None

    # ---- committed state (read-only) ----

    @property
    def live_reservation(self) -> Reservation | None:
        return self._live

    @property
    def max_servable_slots(self) -> int:
        """Most committed slots one request can ever hold: bounded by the pool and the table width."""
        width = self.num_blocks
        if self.max_blocks_per_table is not None:
            width = min(width, self.max_blocks_per_table)
        return width * self.block_size

    def tables(self) -> Mapping[Hashable, BlockTable]:
        """Read-only view of the committed tables in admission order (for validators; do not mutate them)."""
        return MappingProxyType(self._tables)

    def is_resident(self, request_id: Hashable) -> bool:
        return request_id in self._tables

    def resident_ids(self) -> tuple[Hashable, ...]:
        return tuple(self._tables)

    def committed_slots(self, request_id: Hashable) -> int:
        return self._table(request_id).committed_slots

    def block_table(self, request_id: Hashable) -> tuple[int, ...]:
        return tuple(self._table(request_id).blocks)

    def window_ring(self, request_id: Hashable) -> tuple[int, ...]:
        """The request's committed window ring (empty without a window pool)."""
        return tuple(self._table(request_id).window_blocks)

    def stats(self) -> CacheStats:
        window = self.window_pool
        return CacheStats(
            total_blocks=self.num_blocks,
            free_blocks=self.pool.num_free + self.pool.num_cached,
            reserved_blocks=self.pool.num_reserved,
            owned_blocks=self.pool.num_owned,
            resident_requests=len(self._tables),
            blocks_per_request={rid: len(t.blocks) for rid, t in self._tables.items()},
            window_total_blocks=0 if window is None else window.num_blocks,
            window_free_blocks=0 if window is None else window.num_free,
            window_reserved_blocks=0 if window is None else window.num_reserved,
            window_owned_blocks=0 if window is None else window.num_owned,
            window_blocks_per_request={rid: len(t.window_blocks) for rid, t in self._tables.items()},
            fixed_total_slots=0 if self.fixed is None else self.fixed.capacity,
            fixed_free_slots=0 if self.fixed is None else self.fixed.num_free,
            cached_blocks=self.pool.num_cached,
            prefix_blocks=0 if self.prefix is None else len(self.prefix),
            prefix=None if self.prefix is None else dataclasses.replace(self.prefix.stats),
        )

    def snapshot(self) -> dict[str, object]:
        """Committed state as comparable values: the tables, the free blocks (sorted: a rollback may return
        them in another FIFO order), the window pool's, the fixed-state pool's and the prefix cache's (its
        name table, the LRU list with stamps, every block's reference count)."""
        snap: dict[str, object] = {
            "tables": {
                rid: (tuple(t.blocks), t.committed_slots, tuple(t.window_blocks))
                for rid, t in self._tables.items()
            },
            "free_blocks": sorted(self.pool.free_list()),
        }
        if self.window_pool is not None:
            snap["free_window_blocks"] = sorted(self.window_pool.free_list())
        if self.fixed is not None:
            snap["fixed"] = self.fixed.snapshot()
        if self.prefix is not None:
            snap["prefix"] = {
                "names": self.prefix.entries(),
                "lru": self.pool.cached_stamps(),
                "refs": self.pool.refcounts(),
            }
        return snap

    def cached_prefix(self, candidate: CacheCandidate) -> tuple[int, ...]:
        """The cached blocks a new candidate would start from: the longest published prefix of its full
        blocks, short of its last token (whose logits the step needs, so it is always computed). Empty
        without prefix caching, for a resident, or without hashes. Mutates nothing."""
        if self.prefix is None or candidate.hashes is None or not candidate.is_new:
            return ()
        return self.prefix.match(candidate.hashes, (candidate.required_slots - 1) // self.block_size)

    # ---- the step transaction ----

    def plan_step_resources(
        self, candidates: Sequence[CacheCandidate], max_rows: int | None = None
    ) -> ResourcePlan:
        """Choose the candidates that fit this step, in the given order; say why each other one does not.

        ``max_rows`` caps the selected rows (default ``max_batch_size``). Never mutates. Raises ``CacheError``
        if a reservation is live, if ``max_rows`` is not positive, or if the candidates contradict committed
        state (see :func:`check_candidates`).
        """
        self._require_no_live("plan")
        rows = self.max_batch_size if max_rows is None else operator.index(max_rows)
        if rows < 1:
            raise CacheError(f"max_rows must be >= 1, got {max_rows}")
        check_candidates(candidates, self._tables)
        hits = {c.request_id: self.cached_prefix(c) for c in candidates if c.is_new}
        unreferenced = {
            b for found in hits.values() for b in found if self.pool.state(b) is BlockState.CACHED
        }
        return plan_resources(candidates, self._tables, self._limits(rows), hits, unreferenced)

    def reserve(
        self, selected: Sequence[CacheCandidate], fixed_targets: Mapping[Hashable, int] | None = None
    ) -> Reservation:
        """Reserve every block the selected candidates need, all or nothing, and return the live reservation.

        With a fixed-state pool the reservation is composite: ``fixed_targets[rid]`` is each row's committed
        token count after the step (the paged commit must advance to the same), and every row keeps its slot
        or is admitted provisionally into a free one. Raises ``CacheError`` (changing nothing) if a
        reservation is already live, ``selected`` is empty or contradicts committed state, exceeds the row or
        residency limit, contains a candidate that can never fit, needs more blocks (of either pool) or
        fixed slots than are free, or lacks a fixed target.
        """
        self._require_no_live("reserve")
        if not selected:
            raise CacheError("cannot reserve an empty selection")
        check_candidates(selected, self._tables)
        limits = self._limits(self.max_batch_size)
        if len(selected) > self.max_batch_size:
            raise CacheError(f"{len(selected)} rows exceed max_batch_size {self.max_batch_size}")
        num_new = sum(1 for c in selected if c.is_new)
        if len(self._tables) + num_new > self.max_batch_size:
            raise CacheError(
                f"{len(self._tables)} residents + {num_new} admissions exceed "
                f"max_batch_size {self.max_batch_size}"
            )
        growth = []
        hits = []
        for candidate in selected:
            width, new = blocks_needed(candidate, self._tables, self.block_size)
            if is_unserviceable(width, limits):
                raise CacheError(f"request {candidate.request_id!r} needs {width} blocks and can never fit")
            found = self.cached_prefix(candidate)
            hits.append(found)
            growth.append(new - len(found))
        pinned = {block for found in hits for block in found}
        shortfall = sum(growth) - self.pool.num_free
        evictable = self.pool.num_cached - sum(self.pool.state(b) is BlockState.CACHED for b in pinned)
        if shortfall > evictable:
            raise CacheError(
                f"cannot reserve {sum(growth)} blocks: only {self.pool.num_free} of {self.pool.num_blocks} "
                f"free and {evictable} evictable"
            )
        num_ring_blocks = self.ring_blocks * num_new
        if self.window_pool is not None and num_ring_blocks > self.window_pool.num_free:
            raise CacheError(
                f"cannot reserve {num_new} window rings of {self.ring_blocks} blocks: only "
                f"{self.window_pool.num_free} of {self.window_pool.num_blocks} window blocks free"
            )
        fixed = self._reserve_fixed(selected, fixed_targets)  # first: raises, changing nothing
        evicted = self._evict(shortfall, pinned)  # cannot fail: checked above
        try:
            blocks = self.pool.reserve(sum(growth))  # raises, changing nothing, if too few are free
        except BaseException:
            if fixed is not None:
                fixed.discard()
            raise
        rings: tuple[int, ...] = ()
        if self.window_pool is not None:  # cannot fail: checked above, before either pool changed
            rings = self.window_pool.reserve(num_ring_blocks)
        rows = self._rows(selected, growth, blocks, rings, hits)
        self._live = Reservation(
            self.pool, self._tables, rows, self._closed, self.window_pool, fixed, self.prefix, evicted
        )
        return self._live

    def _evict(self, count: int, pinned: set[int]) -> tuple[tuple[int, bytes, int], ...]:
        """Make ``count`` CACHED blocks (never a pinned one) FREE and drop their names, oldest first."""
        if count <= 0 or self.prefix is None:
            return ()
        victims = self.pool.evict(count, pinned)
        return tuple((block, self.prefix.forget(block), stamp) for block, stamp in victims)

    def _reserve_fixed(
        self, selected: Sequence[CacheCandidate], targets: Mapping[Hashable, int] | None
    ) -> FixedStateReservation | None:
        """The fixed sub-reservation over the same rows (None without a pool); checks that every resident's
        fixed tokens equal its committed slots, so the two states cannot drift apart."""
        if self.fixed is None:
            return None
        if targets is None or any(c.request_id not in targets for c in selected):
            raise CacheError("a fixed-state model needs a target token count for every reserved row")
        owners = self.fixed.owners()
        for candidate in selected:
            rid = candidate.request_id
            table = self._tables.get(rid)
            if (table is None) != (rid not in owners) or (
                table is not None and self.fixed.committed_tokens(rid) != table.committed_slots
            ):
                raise CacheError(f"request {rid!r}: paged and fixed committed state disagree")
        return self.fixed.reserve([(c.request_id, targets[c.request_id]) for c in selected])

    def deallocate(self, request_id: Hashable) -> bool:
        """Return all of a request's blocks (its ring too) to their pools and its fixed-state slot to the
        fixed pool; False if it is not resident.

        Raises ``CacheError`` while a reservation is live (its snapshot of committed state must hold), or,
        before changing anything, when the request owns blocks but no fixed slot. Cost: O(blocks of the
        request).
        """
        self._require_no_live("deallocate")
        table = self._tables.get(request_id)
        if table is None:
            return False
        if self.fixed is not None and request_id not in self.fixed.owners():
            raise CacheError(f"request {request_id!r} owns blocks but no fixed-state slot")
        if self.window_pool is not None:
            self.window_pool.check_state(table.window_blocks, BlockState.OWNED, "return_owned")
        if self.fixed is not None:
            self.fixed.release(request_id)
        self.pool.release(table.blocks, () if self.prefix is None else self.prefix)
        if self.window_pool is not None:
            self.window_pool.return_owned(table.window_blocks)
        del self._tables[request_id]
        return True

    def blocks_for_slots(self, num_slots: int) -> int:
        """Blocks a table of ``num_slots`` committed slots needs at this manager's block size."""
        return blocks_for_tokens(num_slots, self.block_size)

    # ---- internals ----

    def _table(self, request_id: Hashable) -> BlockTable:
        table = self._tables.get(request_id)
        if table is None:
            raise CacheError(f"request {request_id!r} is not resident in the paged cache")
        return table

    def _limits(self, max_rows: int) -> PlanLimits:
        return PlanLimits(
            block_size=self.block_size,
            total_blocks=self.num_blocks,
            free_blocks=self.pool.num_free,
            max_batch_size=self.max_batch_size,
            max_rows=max_rows,
            max_blocks_per_table=self.max_blocks_per_table,
            ring_blocks=self.ring_blocks,
            window_total_blocks=0 if self.window_pool is None else self.window_pool.num_blocks,
            window_free_blocks=0 if self.window_pool is None else self.window_pool.num_free,
            fixed_free_slots=None if self.fixed is None else self.fixed.num_free,
            cached_blocks=self.pool.num_cached,
        )

    def _rows(
        self,
        selected: Sequence[CacheCandidate],
        growth: list[int],
        blocks: tuple[int, ...],
        rings: tuple[int, ...],
        hits: list[tuple[int, ...]],
    ) -> tuple[ReservedRow, ...]:
        """Split the reserved blocks over the selected rows, in order (one ring per new row); an admission
        starts after its cached prefix (``hits``)."""
        rows = []
        start = 0
        ring_start = 0
        for candidate, count, found in zip(selected, growth, hits, strict=True):
            table = self._tables.get(candidate.request_id)
            new_ring: tuple[int, ...] = ()
            if table is None and rings:
                new_ring = rings[ring_start : ring_start + self.ring_blocks]
                ring_start += self.ring_blocks
            rows.append(
                ReservedRow(
                    request_id=candidate.request_id,
                    is_new=candidate.is_new,
                    committed_slots=len(found) * self.block_size if table is None else table.committed_slots,
                    required_slots=candidate.required_slots,
                    committed_blocks=() if table is None else tuple(table.blocks),
                    new_blocks=blocks[start : start + count],
                    window_ring=new_ring if table is None else tuple(table.window_blocks),
                    new_window_blocks=new_ring,
                    cached_blocks=found,
                    hashes=candidate.hashes if self.prefix is not None else None,
                )
            )
            start += count
        return tuple(rows)

    def _require_no_live(self, action: str) -> None:
        if self._live is not None:
            raise CacheError(f"cannot {action} while a reservation is live; commit or discard it first")

    def _closed(self, reservation: Reservation) -> None:
        if self._live is reservation:
            self._live = None
