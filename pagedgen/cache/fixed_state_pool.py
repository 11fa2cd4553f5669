"""Fixed request-state pools: per-request conv / recurrent state in two banks, published only at commit.

Every fixed tensor has two persistent banks ``[2, capacity, *row]``; a step reads each slot's active bank and
writes the other (directly, or through staging when the rows' slots are not one contiguous interval), and
only the commit flips the selector, so a rolled-back step leaves every visible byte as it was.
:meth:`FixedStatePool.reserve` admits rows (an admission provisionally, in the lowest free slot),
:meth:`FixedStateReservation.validate_commit` proves nothing moved, ``prepare_commit`` is the one fallible
device copy (fail-stop), ``publish_commit`` is host bookkeeping that cannot fail, ``discard`` returns only
the provisional slots. One reservation is live at a time, and banks and staging are allocated once, so a
planned step never fails for want of fixed-state memory. The whole design: docs/cache.md, "Fixed state".
"""

from __future__ import annotations

import bisect
import enum
import operator
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from pagedgen.core.fixed_state_spec import FixedStateSpec
from pagedgen.core.kv import zeroed_tensor
from pagedgen.core.step_inputs import FixedStateInputs
from pagedgen.core.transfer import upload_values
from pagedgen.errors import CacheError


class FixedReservationState(enum.Enum):
    RESERVED = "reserved"
    PREPARED = "prepared"
    COMMITTED = "committed"
    DISCARDED = "discarded"
    FAILED = "failed"  # prepare_commit failed: provisional slots returned, the pool is unhealthy


@dataclass(slots=True)
class FixedSlot:
    """One slot's host record (its state rows live in the pool's banks)."""

    owner: Hashable | None = None  # the committed owner; None while free or provisional
    allocation_generation: int = 0  # advanced when the slot is published to a new owner
    state_generation: int = 0  # advanced on every commit that writes the slot
    committed_tokens: int = 0  # tokens baked into the visible state
    active: int = 0  # the bank holding the visible state (0 or 1)


@dataclass(frozen=True, slots=True)
class FixedRow:
    """One scheduled row of a fixed reservation, in step order."""

    request_id: Hashable
    slot: int
    is_new: bool  # admitted provisionally by this reservation
    committed_tokens: int  # the slot's committed tokens at reserve (0 for an admission)
    target_tokens: int  # the tokens its state holds after the step
    allocation_generation: int  # the slot's at reserve
    state_generation: int  # the slot's at reserve
    write_bank: int  # the bank the step's output lands in; active after publish


class FixedStatePool:
    """``capacity`` slots of every tensor in ``specs`` on ``device`` (raises ``ValueError`` for bad specs)."""

    def __init__(self, specs: Sequence[FixedStateSpec], capacity: int, device: torch.device | str = "cpu"):
        capacity = operator.index(capacity)
        if capacity < 1:
            raise ValueError(f"FixedStatePool capacity must be positive, got {capacity}")
        if not specs:
            raise ValueError("FixedStatePool needs at least one fixed-state tensor")
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"fixed-state tensor names must be unique, got {names}")
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"fixed state needs a CPU or CUDA device, got {self.device}")
        self.specs = tuple(specs)
        self.capacity = capacity
        self._banks = {
            s.name: zeroed_tensor((2, capacity, *s.row_shape), s.dtype, self.device) for s in specs
        }
        self._gathered = {
            s.name: zeroed_tensor((capacity, *s.row_shape), s.dtype, self.device) for s in specs
        }
        self._staged = {s.name: zeroed_tensor((capacity, *s.row_shape), s.dtype, self.device) for s in specs}
        self._slots = [FixedSlot() for _ in range(capacity)]
        self._owners: dict[Hashable, int] = {}
        self._free: list[int] = list(range(capacity))  # ascending: admissions take the lowest slot
        self._live: FixedStateReservation | None = None
        self._next_reservation = 1
        self.healthy = True

    # ---- committed state (read-only) ----

    @property
    def persistent_bytes(self) -> int:
        """Both banks and both staging buffers of every tensor."""
        return 4 * self.capacity * sum(spec.row_bytes for spec in self.specs)

    @staticmethod
    def bytes_for(specs: Sequence[FixedStateSpec], capacity: int) -> int:
        """:attr:`persistent_bytes` of a pool not built yet (the engine takes it off the KV budget)."""
        return 4 * capacity * sum(spec.row_bytes for spec in specs)

    @property
    def live_reservation(self) -> FixedStateReservation | None:
        return self._live

    @property
    def num_free(self) -> int:
        return len(self._free)

    def snapshot(self) -> dict[str, object]:
        """Committed state: per owner its slot record and visible values, the free slots, health.

        The active bank index is left out on purpose: moving a row to the other bank without changing its
        value is a representation change (direct-path normalisation), not a change of committed state.
        """
        owners = {}
        for rid, index in self.owners().items():
            slot = self.slot(index)
            state = {name: tuple(t.flatten().tolist()) for name, t in self.state(rid).items()}
            owners[rid] = (
                index,
                slot.allocation_generation,
                slot.state_generation,
                slot.committed_tokens,
                state,
            )
        return {"owners": owners, "free": self.free_slots(), "healthy": self.healthy}

    def free_slots(self) -> tuple[int, ...]:
        return tuple(self._free)

    def owners(self) -> Mapping[Hashable, int]:
        """Committed owner -> slot (a copy)."""
        return dict(self._owners)

    def slot(self, index: int) -> FixedSlot:
        """The record of slot ``index`` (read it; do not mutate it)."""
        return self._slots[index]

    def slot_of(self, request_id: Hashable) -> int:
        index = self._owners.get(request_id)
        if index is None:
            raise CacheError(f"request {request_id!r} owns no fixed-state slot")
        return index

    def committed_tokens(self, request_id: Hashable) -> int:
        return self._slots[self.slot_of(request_id)].committed_tokens

    def state(self, request_id: Hashable) -> dict[str, torch.Tensor]:
        """A copy of the request's visible committed state, per tensor (``[*row]`` each)."""
        index = self.slot_of(request_id)
        active = self._slots[index].active
        return {name: bank[active, index].clone() for name, bank in self._banks.items()}

    # ---- the step transaction ----

    def reserve(self, rows: Sequence[tuple[Hashable, int]]) -> FixedStateReservation:
        """Admit ``(request_id, target_tokens)`` rows in step order; all or nothing.

        Raises ``CacheError`` (changing nothing) while another reservation is live or the pool is unhealthy,
        for an empty or duplicate row list, a target below a resident's committed tokens, or more admissions
        than free slots.
        """
        if not self.healthy:
            raise CacheError("the fixed-state pool is unhealthy after a failed prepare; no more reservations")
        if self._live is not None:
            raise CacheError("cannot reserve fixed state while a reservation is live")
        if not rows:
            raise CacheError("cannot reserve fixed state for an empty step")
        ids = [rid for rid, _ in rows]
        if len(set(ids)) != len(ids):
            raise CacheError(f"a request appears twice in the fixed-state rows {ids}")
        num_new = sum(rid not in self._owners for rid in ids)
        if num_new > len(self._free):
            raise CacheError(f"{num_new} admissions need fixed-state slots, only {len(self._free)} are free")
        targets = [self._target(rid, target) for rid, target in rows]
        slots = self._slots_for(ids)
        direct = self._is_interval(ids, slots)
        canonical = self._normalize(slots) if direct else self._majority(ids)
        reserved = []
        for rid, target, index in zip(ids, targets, slots, strict=True):
            is_new = rid not in self._owners
            slot = self._slots[index]
            reserved.append(
                FixedRow(
                    request_id=rid,
                    slot=index,
                    is_new=is_new,
                    committed_tokens=0 if is_new else slot.committed_tokens,
                    target_tokens=target,
                    allocation_generation=slot.allocation_generation,
                    state_generation=slot.state_generation,
                    write_bank=1 - canonical if is_new else 1 - slot.active,
                )
            )
        reservation = FixedStateReservation(self, tuple(reserved), direct, self._next_reservation)
        del self._free[:num_new]  # the lowest free slots, taken in row order above
        self._next_reservation += 1
        self._live = reservation
        return reservation

    def release(self, request_id: Hashable) -> bool:
        """Return a committed owner's slot to the free list (its state is not zeroed); False if none.

        Raises ``CacheError`` while a reservation is live.
        """
        if self._live is not None:
            raise CacheError("cannot release a fixed-state slot while a reservation is live")
        index = self._owners.pop(request_id, None)
        if index is None:
            return False
        self._slots[index].owner = None
        bisect.insort(self._free, index)
        return True

    # ---- internals ----

    def _target(self, request_id: Hashable, target: int) -> int:
        try:
            target = operator.index(target)
        except TypeError:
            raise CacheError(
                f"request {request_id!r}: target_tokens must be an int, got {target!r}"
            ) from None
        index = self._owners.get(request_id)
        committed = 0 if index is None else self._slots[index].committed_tokens
        if target <= committed:
            raise CacheError(
                f"request {request_id!r}: target_tokens {target} does not advance its fixed state "
                f"({committed} committed tokens)"
            )
        return target

    def _slots_for(self, ids: Sequence[Hashable]) -> list[int]:
        """Each row's slot: its own, or (admissions) the lowest free slots in row order."""
        free = iter(self._free)
        return [self._owners[rid] if rid in self._owners else next(free) for rid in ids]

    def _is_interval(self, ids: Sequence[Hashable], slots: Sequence[int]) -> bool:
        """Direct binding needs resident rows on ascending contiguous slots."""
        if any(rid not in self._owners for rid in ids):
            return False
        return list(slots) == list(range(slots[0], slots[0] + len(slots)))

    def _majority(self, ids: Sequence[Hashable]) -> int:
        """The active bank most resident rows share (0 with none): where an admission's output goes."""
        actives = [self._slots[self._owners[rid]].active for rid in ids if rid in self._owners]
        return int(2 * sum(actives) > len(actives))

    def _normalize(self, slots: Sequence[int]) -> int:
        """Move the minority rows' visible state into the majority bank; returns that canonical bank.

        Representation only: each moved row's visible value is copied, then its selector flipped, so every
        request's committed state reads the same before and after.
        """
        actives = [self._slots[i].active for i in slots]
        canonical = int(2 * sum(actives) > len(actives))
        minority = [i for i, a in zip(slots, actives, strict=True) if a != canonical]
        if minority:
            index = torch.tensor(minority, dtype=torch.long, device=self.device)
            for bank in self._banks.values():
                bank[canonical].index_copy_(0, index, bank[1 - canonical].index_select(0, index))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for i in minority:
                self._slots[i].active = canonical
        return canonical

    def _bindings(self, rows: Sequence[FixedRow], direct: bool) -> FixedStateInputs:
        """The model's input and output views: bank intervals (direct) or filled staging (gathered)."""
        n = len(rows)
        if direct:
            lo, active = rows[0].slot, 1 - rows[0].write_bank
            return FixedStateInputs(
                {name: bank[active, lo : lo + n] for name, bank in self._banks.items()},
                {name: bank[1 - active, lo : lo + n] for name, bank in self._banks.items()},
            )
        flat = upload_values(
            [self._slots[r.slot].active * self.capacity + r.slot for r in rows], torch.long, self.device
        )
        new = upload_values([r.is_new for r in rows], torch.bool, self.device)  # [n]
        inputs = {}
        for name, bank in self._banks.items():
            gathered = self._gathered[name][:n]
            torch.index_select(bank.flatten(0, 1), 0, flat, out=gathered)
            # An admission starts from zero state, never a previous owner's. masked_fill_, not gathered[new]:
            # boolean indexing would count the rows on the host (a device synchronisation).
            gathered.masked_fill_(new.view(n, *[1] * (gathered.dim() - 1)), 0)
            inputs[name] = gathered
        return FixedStateInputs(inputs, {name: staged[:n] for name, staged in self._staged.items()})

    def _write_back(self, rows: Sequence[FixedRow]) -> None:
        """Copy the gathered path's staged outputs into each row's inactive (write) bank."""
        flat = upload_values([r.write_bank * self.capacity + r.slot for r in rows], torch.long, self.device)
        for name, bank in self._banks.items():
            bank.flatten(0, 1).index_copy_(0, flat, self._staged[name][: len(rows)])

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _closed(self, reservation: FixedStateReservation) -> None:
        if self._live is reservation:
            self._live = None


class FixedStateReservation:
    """One step's fixed-state transaction (created by :meth:`FixedStatePool.reserve`)."""

    __slots__ = ("state", "rows", "direct", "reservation_id", "bindings", "_pool", "_index")

    def __init__(self, pool: FixedStatePool, rows: tuple[FixedRow, ...], direct: bool, reservation_id: int):
        self._pool = pool
        self.rows = rows
        self.direct = direct
        self.reservation_id = reservation_id
        self.state = FixedReservationState.RESERVED
        self._index = {row.request_id: row for row in rows}
        self.bindings = pool._bindings(rows, direct)

    @property
    def num_new(self) -> int:
        return sum(row.is_new for row in self.rows)

    @property
    def binding_bytes(self) -> int:
        """Bytes of the step's input and output bindings (direct views overlap the persistent banks)."""
        return 2 * len(self.rows) * sum(spec.row_bytes for spec in self._pool.specs)

    def provisional_slots(self) -> tuple[int, ...]:
        return tuple(row.slot for row in self.rows if row.is_new)

    def validate_commit(self, advance: Mapping[Hashable, int] | None = None) -> None:
        """Raise ``CacheError`` unless publishing with ``advance`` would succeed. Mutates nothing.

        Every slot must be exactly as reserved (owner, generations, tokens; an admission's slot still
        unowned and off the free list) and each ``advance`` must equal the row's target tokens.
        """
        pool = self._pool
        if self.state not in (FixedReservationState.RESERVED, FixedReservationState.PREPARED):
            raise CacheError(f"cannot commit a {self.state.value} fixed-state reservation")
        if pool._live is not self or not pool.healthy:
            raise CacheError("the fixed-state reservation is no longer the pool's live one")
        free = set(pool._free)
        for row in self.rows:
            slot = pool._slots[row.slot]
            owner = None if row.is_new else row.request_id
            if (
                slot.owner != owner
                or slot.allocation_generation != row.allocation_generation
                or slot.state_generation != row.state_generation
                or (not row.is_new and slot.committed_tokens != row.committed_tokens)
                or (row.is_new and (row.slot in free or row.request_id in pool._owners))
                or (not row.is_new and pool._owners.get(row.request_id) != row.slot)
            ):
                raise CacheError(f"fixed slot {row.slot} of request {row.request_id!r} changed since reserve")
        for rid, tokens in (advance or {}).items():
            row = self._index.get(rid)
            if row is None:
                raise CacheError(f"request {rid!r} is not part of this fixed-state reservation")
            if tokens != row.target_tokens:
                raise CacheError(
                    f"request {rid!r}: fixed state holds {row.target_tokens} tokens after the step; it "
                    f"cannot commit {tokens} (a fixed state is not narrowed to a prefix of its step)"
                )

    def prepare_commit(self, advance: Mapping[Hashable, int] | None = None) -> None:
        """Write the step's state into the inactive banks and synchronise; nothing becomes visible.

        On a device failure the pool becomes unhealthy, the provisional slots return to the free list, the
        reservation is FAILED, and the error propagates. Idempotent once prepared.
        """
        if self.state is FixedReservationState.PREPARED:
            return
        self.validate_commit(advance)
        pool = self._pool
        try:
            if not self.direct:
                pool._write_back(self.rows)
            pool._synchronize()
        except BaseException:
            pool.healthy = False
            self._return_provisional()
            self._close(FixedReservationState.FAILED)
            raise
        self.state = FixedReservationState.PREPARED

    def publish_commit(self) -> None:
        """Flip every row to the bank just written and publish admissions. Host-only; raises ``CacheError``
        only for a misuse (not prepared), before changing anything."""
        if self.state is not FixedReservationState.PREPARED:
            raise CacheError(f"cannot publish a {self.state.value} fixed-state reservation; prepare it first")
        pool = self._pool
        for row in self.rows:
            slot = pool._slots[row.slot]
            slot.active = row.write_bank
            slot.state_generation += 1
            slot.committed_tokens = row.target_tokens
            if row.is_new:
                slot.owner = row.request_id
                slot.allocation_generation += 1
                pool._owners[row.request_id] = row.slot
        self._close(FixedReservationState.COMMITTED)

    def commit(self, advance: Mapping[Hashable, int] | None = None) -> None:
        """:meth:`prepare_commit` then :meth:`publish_commit`."""
        self.prepare_commit(advance)
        self.publish_commit()

    def discard(self) -> None:
        """Rollback: return the provisional slots; every resident slot stays exactly as it was.

        Valid from RESERVED or PREPARED; a no-op once discarded or failed; ``CacheError`` after a commit.
        """
        if self.state in (FixedReservationState.DISCARDED, FixedReservationState.FAILED):
            return
        if self.state is FixedReservationState.COMMITTED:
            raise CacheError("cannot discard a committed fixed-state reservation")
        self._return_provisional()
        self._close(FixedReservationState.DISCARDED)

    def _return_provisional(self) -> None:
        for index in self.provisional_slots():
            bisect.insort(self._pool._free, index)

    def _close(self, state: FixedReservationState) -> None:
        self.state = state
        self._pool._closed(self)
