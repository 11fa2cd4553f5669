"""One step's paged-cache transaction: reserved blocks that become committed ownership only at commit.

Between reserve and commit the model writes K/V into the reserved blocks through
:meth:`Reservation.block_table`, while committed ownership stays untouched; then exactly one of
:meth:`Reservation.commit` (blocks join their tables, new tables and window rings are published, filled
blocks are named for prefix caching) or :meth:`Reservation.discard` (everything reserved goes back, and
cached blocks it evicted return to the cache when the model never ran) happens. Cached prefix blocks are
only pinned until the commit takes their references, and a model's fixed-state reservation rides along
(``fixed``) so both states commit at one token boundary. :meth:`Reservation.validate_commit` proves, without
mutating anything, that committed state is as the reservation found it, so the publish cannot fail for a
reason it could have checked first. Details: docs/cache.md ("Prefix caching", "Fixed state") and
docs/engine.md.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

from pagedgen.cache.block_pool import BlockPool, BlockState
from pagedgen.cache.block_table import BlockTable
from pagedgen.cache.fixed_state_pool import FixedStateReservation
from pagedgen.cache.prefix import BlockHashes, PrefixCache
from pagedgen.core.step_inputs import FixedStateInputs
from pagedgen.errors import CacheError


class ReservationState(enum.Enum):
    LIVE = "live"
    COMMITTED = "committed"
    DISCARDED = "discarded"


@dataclass(frozen=True, slots=True)
class ReservedRow:
    """One selected request inside a reservation, in scheduled row order."""

    request_id: Hashable
    is_new: bool
    committed_slots: int  # committed slots at reserve time (+ its cached prefix): the step's past length
    required_slots: int  # the most slots commit may advance to
    committed_blocks: tuple[int, ...]  # the committed table at reserve time
    new_blocks: tuple[int, ...]  # reserved blocks, appended to the table at commit
    window_ring: tuple[int, ...] = ()  # the request's window ring: committed, or reserved when new
    new_window_blocks: tuple[int, ...] = ()  # the ring's reserved blocks (a new request's whole ring)
    cached_blocks: tuple[int, ...] = ()  # an admission's cached prefix blocks (pinned; referenced at commit)
    hashes: BlockHashes | None = field(default=None, compare=False)  # its block digests (prefix caching)

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.committed_blocks + self.cached_blocks + self.new_blocks


@dataclass(frozen=True, slots=True)
class _TableSnapshot:
    table: BlockTable
    generation: int
    committed_slots: int
    num_blocks: int
    num_window_blocks: int

    def matches(self, table: BlockTable | None) -> bool:
        return (
            table is self.table
            and table.generation == self.generation
            and table.committed_slots == self.committed_slots
            and len(table.blocks) == self.num_blocks
            and len(table.window_blocks) == self.num_window_blocks
        )


class Reservation:
    """A live paged-cache transaction over one manager's pool and tables.

    Created only by ``PagedCacheManager.reserve`` after it took the blocks from the pools (``window_pool``:
    the window-ring pool, or None). ``on_close`` is called once when the reservation commits or is
    discarded, so the manager can accept the next one.
    """

    __slots__ = (
        "state",
        "_pool",
        "_window_pool",
        "_tables",
        "_rows",
        "_index",
        "_snapshot",
        "_generation",
        "_window_generation",
        "_on_close",
        "fixed",
        "_prepared",
        "_prefix",
        "evicted",
    )

    def __init__(
        self,
        pool: BlockPool,
        tables: dict[Hashable, BlockTable],
        rows: tuple[ReservedRow, ...],
        on_close: Callable[[Reservation], None],
        window_pool: BlockPool | None = None,
        fixed: FixedStateReservation | None = None,
        prefix: PrefixCache | None = None,
        evicted: tuple[tuple[int, bytes, int], ...] = (),
    ):
        self.state = ReservationState.LIVE
        self._prefix = prefix
        self.evicted = evicted  # (block, digest, LRU stamp) of each cached block evicted to make room
        self.fixed = fixed  # the fixed-state sub-reservation (same rows, same order), or None
        self._prepared = False
        self._pool = pool
        self._window_pool = window_pool
        self._tables = tables
        self._rows = rows
        self._index = {row.request_id: row for row in rows}
        self._snapshot = {
            rid: _TableSnapshot(t, t.generation, t.committed_slots, len(t.blocks), len(t.window_blocks))
            for rid, t in tables.items()
        }
        self._generation = pool.generation
        self._window_generation = None if window_pool is None else window_pool.generation
        self._on_close = on_close

    @property
    def rows(self) -> tuple[ReservedRow, ...]:
        return self._rows

    @property
    def request_ids(self) -> tuple[Hashable, ...]:
        return tuple(row.request_id for row in self._rows)

    def reserved_blocks(self) -> tuple[int, ...]:
        """Every block this reservation holds, in row order."""
        return tuple(block for row in self._rows for block in row.new_blocks)

    @property
    def num_reserved_blocks(self) -> int:
        return sum(len(row.new_blocks) for row in self._rows)

    def pinned_blocks(self) -> tuple[int, ...]:
        """The cached prefix blocks the admissions start from (distinct, row order): pinned until commit."""
        return tuple(dict.fromkeys(block for row in self._rows for block in row.cached_blocks))

    def reserved_window_blocks(self) -> tuple[int, ...]:
        """Every window-pool block this reservation holds (the new requests' rings), in row order."""
        return tuple(block for row in self._rows for block in row.new_window_blocks)

    @property
    def num_reserved_window_blocks(self) -> int:
        return sum(len(row.new_window_blocks) for row in self._rows)

    def window_ring(self, request_id: Hashable) -> tuple[int, ...]:
        """The request's window ring (committed, or reserved for a new request); empty without a pool."""
        return self.row(request_id).window_ring

    @property
    def fixed_bindings(self) -> FixedStateInputs | None:
        """The model's fixed-state inputs and outputs for this step (None without fixed state)."""
        return None if self.fixed is None else self.fixed.bindings

    def row(self, request_id: Hashable) -> ReservedRow:
        row = self._index.get(request_id)
        if row is None:
            raise CacheError(f"request {request_id!r} is not part of this reservation")
        return row

    def block_table(self, request_id: Hashable) -> tuple[int, ...]:
        """Committed plus reserved blocks of one request, in logical order: the table the model reads."""
        return self.row(request_id).blocks

    def committed_slots(self, request_id: Hashable) -> int:
        """Committed slots of one request when the reservation was made (0 for a new request)."""
        return self.row(request_id).committed_slots

    def validate_commit(self, advance: Mapping[Hashable, int] | None = None) -> None:
        """Raise ``CacheError`` unless :meth:`commit` with ``advance`` would succeed. Mutates nothing.

        Checks that the reservation is live, that neither pool was mutated since reserve, that every resident
        table is the same object with the same generation, sizes and committed slots, that every reserved
        block (of both pools) is still reserved, and that each ``advance`` names a row and lies in
        ``[committed, required]``. Cost: O(residents + reserved blocks).
        """
        if self.state is not ReservationState.LIVE:
            raise CacheError(f"cannot commit a {self.state.value} reservation")
        if self._pool.generation != self._generation:
            raise CacheError(
                f"block pool changed since reserve (generation {self._generation} -> {self._pool.generation})"
            )
        window = self._window_pool
        if window is not None and window.generation != self._window_generation:
            raise CacheError(
                f"window block pool changed since reserve (generation {self._window_generation} -> "
                f"{window.generation})"
            )
        if len(self._tables) != len(self._snapshot):
            raise CacheError(
                f"resident count changed since reserve ({len(self._snapshot)} -> {len(self._tables)})"
            )
        for rid, snapshot in self._snapshot.items():
            if not snapshot.matches(self._tables.get(rid)):
                raise CacheError(f"block table of request {rid!r} changed since reserve")
        for row in self._rows:
            for block in row.new_blocks:
                if self._pool.state(block) is not BlockState.RESERVED:
                    raise CacheError(
                        f"reserved block {block} of request {row.request_id!r} is no longer reserved"
                    )
            for block in row.cached_blocks:
                if self._prefix is None or block not in self._prefix:
                    raise CacheError(f"cached block {block} of request {row.request_id!r} left the cache")
            for block in row.new_window_blocks:
                if window is None or window.state(block) is not BlockState.RESERVED:
                    raise CacheError(
                        f"reserved window block {block} of request {row.request_id!r} is no longer reserved"
                    )
        targets = self._target_slots(advance)
        if self.fixed is not None:  # both states commit at one token boundary
            self.fixed.validate_commit(targets)

    def prepare_commit(self, advance: Mapping[Hashable, int] | None = None) -> None:
        """Validate, then do the commit's fallible device work: the fixed state's staged outputs are copied
        into its inactive banks (nothing becomes visible). Raises ``CacheError`` for a failed check, or
        the device error (the fixed pool is then unhealthy; the step is fatal). Idempotent once prepared.
        """
        self.validate_commit(advance)
        if self.fixed is not None:
            self.fixed.prepare_commit(self._target_slots(advance))
        self._prepared = True

    def commit(self, advance: Mapping[Hashable, int] | None = None) -> None:
        """Publish the reservation: reserved blocks join their tables, committed slots advance, then the
        fixed state flips to the banks the step wrote.

        ``advance[rid]`` is the request's new committed slot count (default ``required_slots``); a narrower
        count (a partial prefill chunk, rejected drafts) still keeps every reserved block in the table.
        Prepares first unless :meth:`prepare_commit` already ran (validating again either way); a refused
        commit changes nothing. Cost: O(residents + reserved blocks).
        """
        if self._prepared:
            self.validate_commit(advance)
        else:
            self.prepare_commit(advance)
        targets = self._target_slots(advance)
        self._pool.publish(self.reserved_blocks())
        self._pool.add_ref([block for row in self._rows for block in row.cached_blocks])
        if self._window_pool is not None:
            self._window_pool.publish(self.reserved_window_blocks())
        for row in self._rows:
            if row.is_new:
                self._tables[row.request_id] = BlockTable(
                    row.request_id,
                    list(row.cached_blocks + row.new_blocks),
                    targets[row.request_id],
                    0,
                    list(row.window_ring),
                )
            else:
                self._tables[row.request_id].advance(row.new_blocks, targets[row.request_id])
            self._publish_filled(row, targets[row.request_id])
        self._pool.record_mutation()
        if self.fixed is not None:
            self.fixed.publish_commit()
        self._close(ReservationState.COMMITTED)

    def _publish_filled(self, row: ReservedRow, target: int) -> None:
        """Name every block this step filled (prefix caching): those between the row's past and ``target``;
        count an admission's lookup (committed admissions only, so a rolled-back step counts nothing)."""
        if self._prefix is None or row.hashes is None:
            return
        blocks, size = row.blocks, row.hashes.block_size
        if row.is_new:
            stats = self._prefix.stats
            stats.queries += 1
            stats.queried_tokens += row.required_slots
            stats.hits += bool(row.cached_blocks)
            stats.hit_tokens += len(row.cached_blocks) * size
        first, last = row.committed_slots // size, target // size
        if last <= first:
            return  # the usual decode step: no block filled
        for index, digest in enumerate(row.hashes.upto(last)[first:], start=first):
            self._prefix.publish(blocks[index], digest)

    def discard(self, restore_evicted: bool = False) -> None:
        """Return every reserved block to the pool; committed state stays exactly as before reserve.

        ``restore_evicted``: the model never ran, so the cached blocks evicted to make room still hold their
        content and go back into the cache exactly; otherwise they stay FREE (module docstring). Idempotent
        once discarded; raises ``CacheError`` after a commit.
        """
        if self.state is ReservationState.DISCARDED:
            return
        if self.state is ReservationState.COMMITTED:
            raise CacheError("cannot discard a committed reservation")
        self._pool.return_reserved(self.reserved_blocks())
        if restore_evicted and self.evicted and self._prefix is not None:
            self._pool.restore_cached((block, stamp) for block, _, stamp in self.evicted)
            for block, digest, _ in self.evicted:
                self._prefix.publish(block, digest)
        if self._window_pool is not None:
            self._window_pool.return_reserved(self.reserved_window_blocks())
        if self.fixed is not None:
            self.fixed.discard()  # resident slots untouched; provisional ones freed
        self._close(ReservationState.DISCARDED)

    def _target_slots(self, advance: Mapping[Hashable, int] | None) -> dict[Hashable, int]:
        """New committed slots per row; ``CacheError`` for an unknown row or an out-of-range advance."""
        targets = {row.request_id: row.required_slots for row in self._rows}
        for rid, slots in (advance or {}).items():
            row = self.row(rid)
            try:
                slots = operator.index(slots)
            except TypeError:
                raise CacheError(f"advance for request {rid!r} must be an int, got {slots!r}") from None
            if not row.committed_slots <= slots <= row.required_slots:
                raise CacheError(
                    f"advance for request {rid!r} is {slots}, outside "
                    f"[{row.committed_slots}, {row.required_slots}]"
                )
            targets[rid] = slots
        return targets

    def _close(self, state: ReservationState) -> None:
        self.state = state
        self._on_close(self)
