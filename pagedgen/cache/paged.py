"""Planning paged-cache resources for one engine step: which candidates fit, and why the others do not.

One pure pass over the scheduler's candidates in decode-first order, skipping what does not fit so a
blocked prefill hides no smaller work, and telling a deferred candidate from one that can never run. How
prefix-cache hits are charged: docs/cache.md, "Planning a step's resources".
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedgen.cache.block_table import blocks_for_tokens
from pagedgen.cache.prefix import BlockHashes
from pagedgen.errors import CacheError


@dataclass(frozen=True, slots=True)
class CacheCandidate:
    """One request the scheduler would like to run this step.

    ``required_slots`` is the committed slot count the request must be able to hold after the step:
    past + 1 for a decode, past + every remaining prompt token for a prefill (so an admitted prefill owns
    blocks for its whole prompt and its later chunks need no new blocks). ``is_new`` marks a request that
    owns no table yet. ``hashes`` are the chained block digests of the request's sequence when prefix caching
    is on (None otherwise): an admission looks its prefix up with them, a commit publishes filled blocks.
    """

    request_id: Hashable
    required_slots: int
    is_new: bool
    hashes: BlockHashes | None = field(default=None, compare=False)


class DeferReason(enum.Enum):
    CAPACITY_DEFERRED = "capacity_deferred"  # could run later, when rows, residency or blocks free up
    UNSERVICEABLE = "unserviceable"  # can never fit: more blocks than the pool or than a table may hold


@dataclass(frozen=True, slots=True)
class ResourcePlan:
    """The planner's answer: the selected candidates and, for every other candidate, why not.

    Both tuples keep the input order. ``new_blocks`` is how many free blocks reserving ``selected`` takes,
    ``new_window_blocks`` how many of the window pool (one ring per admission). ``hit_blocks`` maps each
    selected admission that starts from cached blocks to how many. ``short_of_blocks`` and
    ``short_of_residency`` name the CAPACITY_DEFERRED candidates that were refused for want of blocks, or of a
    resident place (``max_batch_size``), as opposed to rows, rings or fixed slots: the ones that releasing
    residents could help (:mod:`pagedgen.engine.scheduler` decides whom to release). ``spare_blocks`` is
    the supply left after the selection: the most optional work (speculative drafts) may still take.
    """

    selected: tuple[CacheCandidate, ...]
    deferred: tuple[tuple[CacheCandidate, DeferReason], ...]
    new_blocks: int = 0
    new_window_blocks: int = 0
    hit_blocks: Mapping[Hashable, int] = field(default_factory=dict)
    short_of_blocks: tuple[Hashable, ...] = ()
    short_of_residency: tuple[Hashable, ...] = ()
    spare_blocks: int = 0  # blocks still allocatable after the selection (free, plus unclaimed cached ones)

    @property
    def capacity_deferred(self) -> tuple[CacheCandidate, ...]:
        return tuple(c for c, reason in self.deferred if reason is DeferReason.CAPACITY_DEFERRED)

    @property
    def unserviceable(self) -> tuple[CacheCandidate, ...]:
        return tuple(c for c, reason in self.deferred if reason is DeferReason.UNSERVICEABLE)


class ResidentView(Protocol):
    """What planning needs to know about committed residents (the manager's tables)."""

    def get(self, request_id: Hashable, /) -> _TableLike | None: ...

    def __len__(self) -> int: ...


class _TableLike(Protocol):
    blocks: Sequence[int]
    committed_slots: int


@dataclass(frozen=True, slots=True)
class PlanLimits:
    """The capacity a plan must respect; built by the manager for each planning call."""

    block_size: int
    total_blocks: int  # blocks in the whole pool: the UNSERVICEABLE bound
    free_blocks: int  # blocks a reservation can take now
    max_batch_size: int  # bound on residents (committed + newly admitted) and on rows
    max_rows: int  # bound on selected rows this step
    max_blocks_per_table: int | None  # block-table width the executor supports (None: the pool bound)
    cached_blocks: int = 0  # unreferenced CACHED blocks: evictable, so allocatable like free ones
    ring_blocks: int = 0  # window-pool blocks each admission takes (0: no window pool)
    window_total_blocks: int = 0  # blocks of the window pool
    window_free_blocks: int = 0  # window blocks a reservation can take now
    fixed_free_slots: int | None = None  # fixed-state slots an admission can take now (None: no pool)


def check_candidates(candidates: Sequence[CacheCandidate], residents: ResidentView) -> None:
    """Raise ``CacheError`` if the candidate list contradicts committed state.

    Catches duplicate request ids, an ``is_new`` flag that disagrees with residency, a non-integer or
    non-positive ``required_slots``, and a resident whose ``required_slots`` is below its committed slots.
    """
    seen: set[Hashable] = set()
    for candidate in candidates:
        rid = candidate.request_id
        if rid in seen:
            raise CacheError(f"request {rid!r} appears twice in the candidate list")
        seen.add(rid)
        try:
            required = operator.index(candidate.required_slots)
        except TypeError:
            raise CacheError(
                f"request {rid!r}: required_slots must be an int, got {candidate.required_slots!r}"
            ) from None
        if required < 1:
            raise CacheError(f"request {rid!r}: required_slots must be >= 1, got {required}")
        table = residents.get(rid)
        if candidate.is_new and table is not None:
            raise CacheError(f"request {rid!r} is marked new but is already resident")
        if not candidate.is_new and table is None:
            raise CacheError(f"request {rid!r} is marked resident but owns no block table")
        if table is not None and required < table.committed_slots:
            raise CacheError(
                f"request {rid!r}: required_slots {required} is below its "
                f"{table.committed_slots} committed slots"
            )


def blocks_needed(candidate: CacheCandidate, residents: ResidentView, block_size: int) -> tuple[int, int]:
    """``(table width after the step, new blocks to reserve)`` for one candidate."""
    width = blocks_for_tokens(candidate.required_slots, block_size)
    table = residents.get(candidate.request_id)
    owned = 0 if table is None else len(table.blocks)
    return width, max(0, width - owned)


def is_unserviceable(width: int, limits: PlanLimits) -> bool:
    """True if a table of ``width`` blocks (and a ring) could not exist even in an otherwise empty cache."""
    if width > limits.total_blocks or limits.ring_blocks > limits.window_total_blocks:
        return True
    return limits.max_blocks_per_table is not None and width > limits.max_blocks_per_table


def plan_resources(
    candidates: Sequence[CacheCandidate],
    residents: ResidentView,
    limits: PlanLimits,
    hits: Mapping[Hashable, Sequence[int]] | None = None,
    unreferenced: Collection[int] = (),
) -> ResourcePlan:
    """Select, in order, every candidate that still fits; classify the rest. Mutates nothing.

    A candidate is UNSERVICEABLE if its final table is wider than the pool or the supported width. Otherwise
    it is CAPACITY_DEFERRED if the row limit is reached, if it is new and committed residents plus the new
    admissions already selected fill ``max_batch_size``, or if its new blocks (or, new, its ring) exceed
    those still free after the earlier selections, or if it is new and no fixed-state slot is left. Validate
    the candidates with :func:`check_candidates` first.

    ``hits[rid]`` are the cached blocks a new candidate starts from (prefix caching), ``unreferenced`` the
    CACHED ones among all hits: free supply is ``free_blocks + cached_blocks``, and an admission pays for
    its blocks past its hits plus each unreferenced hit no earlier selection claimed.
    """
    hits = hits or {}
    row_limit = min(limits.max_rows, limits.max_batch_size)
    supply = limits.free_blocks + limits.cached_blocks
    free = supply
    window_free = limits.window_free_blocks
    fixed_free = limits.fixed_free_slots
    residents_after = len(residents)
    claimed: set[int] = set()
    selected: list[CacheCandidate] = []
    deferred: list[tuple[CacheCandidate, DeferReason]] = []
    hit_blocks: dict[Hashable, int] = {}
    short_of_blocks: list[Hashable] = []
    short_of_residency: list[Hashable] = []
    reserved = 0
    for candidate in candidates:
        width, growth = blocks_needed(candidate, residents, limits.block_size)
        found = hits.get(candidate.request_id, ()) if candidate.is_new else ()
        growth -= len(found)
        claim = {block for block in found if block in unreferenced} - claimed
        ring = limits.ring_blocks if candidate.is_new else 0
        if is_unserviceable(width, limits):
            deferred.append((candidate, DeferReason.UNSERVICEABLE))
            continue
        no_place = candidate.is_new and residents_after >= limits.max_batch_size
        no_blocks = growth + len(claim) > free
        if (
            len(selected) >= row_limit
            or no_place
            or no_blocks
            or ring > window_free
            or (candidate.is_new and fixed_free is not None and fixed_free < 1)
        ):
            deferred.append((candidate, DeferReason.CAPACITY_DEFERRED))
            if len(selected) < row_limit:
                if no_place:
                    short_of_residency.append(candidate.request_id)
                elif no_blocks:
                    short_of_blocks.append(candidate.request_id)
            continue
        selected.append(candidate)
        free -= growth + len(claim)
        reserved += growth
        claimed |= claim
        if found:
            hit_blocks[candidate.request_id] = len(found)
        window_free -= ring
        if candidate.is_new:
            residents_after += 1
            if fixed_free is not None:
                fixed_free -= 1
    return ResourcePlan(
        tuple(selected),
        tuple(deferred),
        reserved,
        limits.window_free_blocks - window_free,
        hit_blocks,
        tuple(short_of_blocks),
        tuple(short_of_residency),
        free,
    )
