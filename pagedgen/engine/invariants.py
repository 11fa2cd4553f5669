"""Pure validators of engine state: each returns the list of violations it found (empty when consistent).

They recompute everything from the raw records (block states, free lists, tables, the live reservation)
instead of trusting the counters those records keep: a counter corrected after the fact would hide exactly
the bugs these checks exist to find. Read-only, so tests and ``EngineConfig(debug_invariants=True)`` run
them after every operation; what each pool must satisfy: docs/cache.md, "What the invariant validators
check".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping

from pagedgen.cache.block_pool import BlockPool, BlockState
from pagedgen.cache.block_table import BlockTable
from pagedgen.cache.manager import PagedCacheManager
from pagedgen.cache.prefix import BlockHashes, PrefixCache
from pagedgen.cache.reservation import Reservation, ReservationState


def validate_cache(manager: PagedCacheManager) -> list[str]:
    """Every block of each pool free, reserved or owned exactly once; tables, reservation and counters
    consistent; every resident owns exactly one ring of the window pool (none without one)."""
    pool = manager.pool
    states = pool.states()
    violations = _pool_records(pool, states)
    tables = manager.tables()
    violations += _table_records(manager, tables, states, manager.prefix)
    violations += _reservation_records(manager.live_reservation, tables, states, manager.block_size)
    owned = len({block for t in tables.values() for block in t.blocks})
    reserved = _live_reserved(manager.live_reservation)
    cached = len(set(pool.cached_list()))
    if pool.num_free + reserved + owned + cached != pool.num_blocks:
        parts = f"{pool.num_free} free + {reserved} reserved + {owned} owned"
        if cached:
            parts += f" + {cached} cached"
        violations.append(f"block totals: {parts} != {pool.num_blocks}")
    if len(tables) > manager.max_batch_size:
        violations.append(f"{len(tables)} residents exceed max_batch_size {manager.max_batch_size}")
    violations += _prefix_records(manager, tables, states)
    return violations + _window_records(manager, tables) + _fixed_records(manager, tables)


def _prefix_records(
    manager: PagedCacheManager, tables: Mapping[Hashable, BlockTable], states: tuple[BlockState, ...]
) -> list[str]:
    """Reference counts, the CACHED set and the name table agree with the tables and the reservation."""
    pool, prefix, live = manager.pool, manager.prefix, manager.live_reservation
    violations = []
    holders = Counter(block for t in tables.values() for block in set(t.blocks))
    refs = pool.refcounts()
    for block, state in enumerate(states):
        expected = holders[block] if state is BlockState.OWNED else 0
        if refs[block] != expected:
            violations.append(
                f"block {block} ({state.value}) has refcount {refs[block]}, expected {expected}"
            )
    cached = pool.cached_list()
    for block, count in Counter(cached).items():
        if count > 1:
            violations.append(f"block {block} appears {count} times in the LRU list")
        if (
            not (isinstance(block, int) and 0 <= block < len(states))
            or states[block] is not BlockState.CACHED
        ):
            violations.append(f"block {block!r} is in the LRU list but not CACHED")
    num_cached = sum(state is BlockState.CACHED for state in states)
    if num_cached != len(set(cached)):
        violations.append(f"{num_cached} blocks are CACHED but the LRU list holds {len(set(cached))}")
    if prefix is None:
        if num_cached:
            violations.append(f"{num_cached} blocks are CACHED without a prefix cache")
        if live is not None and (live.pinned_blocks() or live.evicted):
            violations.append("the reservation pins or evicted cached blocks without a prefix cache")
        return violations
    return violations + _name_records(prefix, tables, states, live, manager.block_size)


def _name_records(
    prefix: PrefixCache,
    tables: Mapping[Hashable, BlockTable],
    states: tuple[BlockState, ...],
    live: Reservation | None,
    block_size: int,
) -> list[str]:
    """The name table is one to one over OWNED / CACHED blocks, every CACHED block is named, named blocks sit
    only where they are full, and the live reservation pins named blocks and evicted unnamed ones."""
    violations = []
    entries = prefix.entries()
    for digest, block in entries.items():
        if prefix.digest_of(block) != digest:
            violations.append(f"prefix cache: block {block} is filed under a digest it is not named by")
        if not (isinstance(block, int) and 0 <= block < len(states)):
            violations.append(f"prefix cache names invalid block id {block!r}")
        elif states[block] not in (BlockState.OWNED, BlockState.CACHED):
            violations.append(f"prefix cache names block {block}, which is {states[block].value}")
    if len(prefix.blocks()) != len(entries):
        violations.append(f"prefix cache: {len(prefix.blocks())} named blocks but {len(entries)} digests")
    for block, state in enumerate(states):
        if state is BlockState.CACHED and block not in prefix:
            violations.append(f"block {block} is CACHED but has no name in the prefix cache")
    for rid, table in tables.items():
        full = table.committed_slots // block_size
        for index, block in enumerate(table.blocks):
            if index >= full and block in prefix:
                violations.append(f"request {rid!r} holds named block {block} at index {index}, not yet full")
    if live is not None:
        for block in live.pinned_blocks():
            if block not in prefix:
                violations.append(f"the reservation pins block {block}, which has no name")
        for block, _digest, _stamp in live.evicted:
            if block in prefix:
                violations.append(f"the reservation evicted block {block}, which is still named")
    return violations


def validate_prefix_content(manager: PagedCacheManager, hashes: Mapping[Hashable, BlockHashes]) -> list[str]:
    """Every named block in a resident's table is named by the digest of that request's own tokens at that
    index (``hashes``: each resident's block digests): a cache hit can only ever give the right K/V."""
    prefix = manager.prefix
    if prefix is None:
        return []
    violations = []
    for rid, table in manager.tables().items():
        chain = hashes.get(rid)
        full = table.committed_slots // manager.block_size
        if chain is None or chain.num_full_blocks < full:
            continue
        for index, (block, digest) in enumerate(zip(table.blocks[:full], chain.upto(full), strict=True)):
            named = prefix.digest_of(block)
            if named is not None and named != digest:
                violations.append(
                    f"request {rid!r}: block {block} at index {index} is named for other tokens than the "
                    "request's own"
                )
    return violations


def _fixed_records(manager: PagedCacheManager, tables: Mapping[Hashable, BlockTable]) -> list[str]:
    """The fixed-state pool: every slot free, provisional (held by the live reservation) or owned exactly
    once; its owners are exactly the paged residents, each with fixed tokens equal to its committed slots."""
    pool = manager.fixed
    live = manager.live_reservation
    if pool is None:
        if live is not None and live.fixed is not None:
            return ["the reservation holds fixed-state slots without a fixed-state pool"]
        return []
    violations = []
    free = pool.free_slots()
    owners = pool.owners()
    sub = None if live is None else live.fixed
    if sub is not pool.live_reservation:
        violations.append("the fixed-state pool's live reservation is not the cache reservation's")
    provisional = () if sub is None else sub.provisional_slots()
    if list(free) != sorted(set(free)):
        violations.append(f"fixed free list {list(free)} is not ascending and unique")
    held = Counter([*free, *owners.values(), *provisional])
    for index in range(pool.capacity):
        if held[index] != 1:
            violations.append(f"fixed-state slot {index} is free, owned or provisional {held[index]} times")
    if sum(held.values()) != pool.capacity:
        violations.append(f"fixed-state slots: {sum(held.values())} records for {pool.capacity} slots")
    for rid, index in owners.items():
        named = pool.slot(index).owner
        if named != rid:
            violations.append(f"fixed-state slot {index} is filed under {rid!r} but names {named!r}")
    for index in (*free, *provisional):
        if 0 <= index < pool.capacity and pool.slot(index).owner is not None:
            violations.append(f"fixed-state slot {index} is not owned but names {pool.slot(index).owner!r}")
    if set(owners) != set(tables):
        violations.append(
            f"fixed-state owners {sorted(map(repr, owners))} are not the paged residents "
            f"{sorted(map(repr, tables))}"
        )
    for rid, table in tables.items():
        if rid in owners and pool.committed_tokens(rid) != table.committed_slots:
            violations.append(
                f"request {rid!r}: fixed state holds {pool.committed_tokens(rid)} tokens, its table "
                f"{table.committed_slots} committed slots"
            )
    return violations


def _window_records(manager: PagedCacheManager, tables: Mapping[Hashable, BlockTable]) -> list[str]:
    """The window-ring pool, validated on its own: states, rings, the live reservation's rings, totals."""
    pool = manager.window_pool
    live = manager.live_reservation
    if pool is None:
        violations = [
            f"request {rid!r} holds window blocks without a window pool"
            for rid, t in tables.items()
            if t.window_blocks
        ]
        if live is not None and live.reserved_window_blocks():
            violations.append("the reservation holds window blocks without a window pool")
        return violations
    states = pool.states()
    violations = [f"window pool: {v}" for v in _pool_records(pool, states)]
    owner: dict[int, Hashable] = {}
    for rid, table in tables.items():
        if len(table.window_blocks) != manager.ring_blocks:
            violations.append(
                f"request {rid!r} owns {len(table.window_blocks)} window blocks, "
                f"a ring is {manager.ring_blocks}"
            )
        violations += _owned_blocks("window block", rid, table.window_blocks, states, owner)
    num_owned = sum(state is BlockState.OWNED for state in states)
    if num_owned != len(owner):
        violations.append(f"{num_owned} window blocks are OWNED but rings hold {len(owner)} distinct blocks")
    reserved = () if live is None else live.reserved_window_blocks()
    violations += [f"window pool: {v}" for v in _reserved_blocks(reserved, states)]
    if live is not None:
        for row in live.rows:
            if row.is_new and len(row.new_window_blocks) != manager.ring_blocks:
                violations.append(
                    f"reservation admits {row.request_id!r} with {len(row.new_window_blocks)} window blocks, "
                    f"a ring is {manager.ring_blocks}"
                )
            if not row.is_new and row.new_window_blocks:
                violations.append(f"reservation grows the ring of resident {row.request_id!r}")
    total = pool.num_free + len(set(reserved)) + len(owner)
    if total != pool.num_blocks:
        violations.append(
            f"window block totals: {pool.num_free} free + {len(set(reserved))} reserved + {len(owner)} owned "
            f"!= {pool.num_blocks}"
        )
    return violations


def _owned_blocks(
    label: str,
    rid: Hashable,
    blocks: list[int],
    states: tuple[BlockState, ...],
    owner: dict[int, Hashable],
    shareable: set[int] | frozenset[int] = frozenset(),
) -> list[str]:
    """Each block a valid OWNED id, owned by ``rid`` only (``owner`` accumulates across tables), unless it is
    ``shareable`` (a full published prefix block) and not repeated within this table."""
    violations = []
    seen: set[int] = set()
    for block in blocks:
        if not (isinstance(block, int) and 0 <= block < len(states)):
            violations.append(f"request {rid!r} holds invalid {label} id {block!r}")
            continue
        if block in owner and (block in seen or block not in shareable):
            violations.append(f"{label} {block} is owned by both {owner[block]!r} and {rid!r}")
        seen.add(block)
        owner[block] = rid
        if states[block] is not BlockState.OWNED:
            violations.append(f"{label} {block} is held by {rid!r} but {states[block].value}")
    return violations


def validate_residents(manager: PagedCacheManager, expected_slots: Mapping[Hashable, int]) -> list[str]:
    """Request progress agrees with cache progress: the residents are exactly ``expected_slots``' keys, each
    with that many committed slots (the engine passes every resident request's processed length)."""
    violations = []
    resident = set(manager.resident_ids())
    for rid in resident - set(expected_slots):
        violations.append(f"request {rid!r} is resident in the cache but not expected")
    for rid, slots in expected_slots.items():
        if rid not in resident:
            violations.append(f"request {rid!r} is expected resident but owns no block table")
        elif manager.committed_slots(rid) != slots:
            violations.append(
                f"request {rid!r} has {manager.committed_slots(rid)} committed slots, expected {slots}"
            )
    return violations


def _pool_records(pool: BlockPool, states: tuple[BlockState, ...]) -> list[str]:
    """The free list holds exactly the FREE blocks, once each, and the pool's counters match its states."""
    violations = []
    if len(states) != pool.num_blocks:
        violations.append(f"pool records {len(states)} block states for {pool.num_blocks} blocks")
    free_list = pool.free_list()
    for block, count in Counter(free_list).items():
        if not (isinstance(block, int) and 0 <= block < len(states)):
            violations.append(f"free list holds invalid block id {block!r}")
            continue
        if count > 1:
            violations.append(f"block {block} appears {count} times in the free list")
        if states[block] is not BlockState.FREE:
            violations.append(f"block {block} is in the free list but {states[block].value}")
    by_state = Counter(states)
    if by_state[BlockState.FREE] != len(set(free_list)):
        violations.append(
            f"{by_state[BlockState.FREE]} blocks are FREE but the free list holds {len(free_list)}"
        )
    if pool.num_reserved != by_state[BlockState.RESERVED]:
        violations.append(
            f"pool counts {pool.num_reserved} reserved blocks, states say {by_state[BlockState.RESERVED]}"
        )
    if pool.num_owned != by_state[BlockState.OWNED]:
        violations.append(
            f"pool counts {pool.num_owned} owned blocks, states say {by_state[BlockState.OWNED]}"
        )
    return violations


def _table_records(
    manager: PagedCacheManager,
    tables: Mapping[Hashable, BlockTable],
    states: tuple[BlockState, ...],
    prefix: PrefixCache | None = None,
) -> list[str]:
    """Each table block is a valid OWNED id owned by exactly one table (or, named in the prefix cache and
    full there, shared by several, each once); slots fit the table's capacity."""
    violations = []
    owner: dict[int, Hashable] = {}
    shareable = set() if prefix is None else _full_named_blocks(tables, prefix, manager.block_size)
    for rid, table in tables.items():
        if table.request_id != rid:
            violations.append(f"table filed under {rid!r} names request {table.request_id!r}")
        if not 0 <= table.committed_slots <= table.capacity(manager.block_size):
            violations.append(
                f"request {rid!r}: {table.committed_slots} committed slots outside its capacity "
                f"{table.capacity(manager.block_size)} ({len(table.blocks)} blocks)"
            )
        width = manager.max_blocks_per_table
        if width is not None and len(table.blocks) > width:
            violations.append(f"request {rid!r}: {len(table.blocks)} blocks exceed the table width {width}")
        violations += _owned_blocks("block", rid, table.blocks, states, owner, shareable)
    num_owned = sum(state is BlockState.OWNED for state in states)
    if num_owned != len(owner):
        violations.append(f"{num_owned} blocks are OWNED but tables hold {len(owner)} distinct blocks")
    return violations


def _full_named_blocks(
    tables: Mapping[Hashable, BlockTable], prefix: PrefixCache, block_size: int
) -> set[int]:
    """Blocks that may be shared: named in the prefix cache and full in *every* table holding them."""
    named, not_full = set(), set()
    for table in tables.values():
        full = table.committed_slots // block_size
        for index, block in enumerate(table.blocks):
            if block in prefix and index < full:
                named.add(block)
            else:
                not_full.add(block)
    return named - not_full


def _reservation_records(
    live: Reservation | None,
    tables: Mapping[Hashable, BlockTable],
    states: tuple[BlockState, ...],
    block_size: int,
) -> list[str]:
    """The live reservation holds exactly the RESERVED blocks, once each; its rows agree with residency."""
    num_reserved_states = sum(state is BlockState.RESERVED for state in states)
    if live is None:
        if num_reserved_states:
            return [f"{num_reserved_states} blocks are RESERVED but no reservation is live"]
        return []
    violations = []
    if live.state is not ReservationState.LIVE:
        violations.append(f"the manager's live reservation is {live.state.value}")
    violations += _reserved_blocks(live.reserved_blocks(), states)
    for row in live.rows:
        table = tables.get(row.request_id)
        if row.is_new and table is not None:
            violations.append(f"reservation admits {row.request_id!r}, which is already resident")
        if not row.is_new and table is None:
            violations.append(f"reservation grows {row.request_id!r}, which is not resident")
        if not row.committed_slots <= row.required_slots <= len(row.blocks) * block_size:
            violations.append(
                f"reservation row {row.request_id!r}: slots {row.committed_slots}..{row.required_slots} "
                f"do not fit its {len(row.blocks)} blocks"
            )
    return violations


def _reserved_blocks(blocks: tuple[int, ...], states: tuple[BlockState, ...]) -> list[str]:
    """The reservation's blocks are valid ids, each once and RESERVED, and exactly the RESERVED ones."""
    violations = []
    for block, count in Counter(blocks).items():
        if not (isinstance(block, int) and 0 <= block < len(states)):
            violations.append(f"reservation holds invalid block id {block!r}")
            continue
        if count > 1:
            violations.append(f"block {block} is reserved {count} times")
        if states[block] is not BlockState.RESERVED:
            violations.append(f"block {block} is held by the reservation but {states[block].value}")
    num_reserved_states = sum(state is BlockState.RESERVED for state in states)
    if len(set(blocks)) != num_reserved_states:
        violations.append(
            f"{num_reserved_states} blocks are RESERVED but the reservation holds {len(set(blocks))}"
        )
    return violations


def _live_reserved(live: Reservation | None) -> int:
    return 0 if live is None else len(set(live.reserved_blocks()))
