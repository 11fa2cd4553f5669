"""Decode-first planning for the dynamic path: which requests run this step, and how many tokens each sends.

Decodes go first so a running stream never waits behind a long prompt; prefills then fill the step's token
budget in chunks (a smaller one, ``max_mixed_step_tokens``, when the step carries a decode row, so a long
prompt cannot stall the streams), and an admitted prefill reserves cache for its whole remaining input so it
can always finish. When a plan leaves work behind for want of room, :meth:`DynamicScheduler.relieve` releases
residency instead (idle residents yield, the youngest running request is preempted, waiting requests age), so
nothing waits forever. The policy, its rules and why they cannot cycle: docs/engine.md, "Scheduling: decode
first" and "Residency"; prefix-cache hits and held-back admissions: docs/cache.md; drafts:
:mod:`pagedgen.engine.draft_budget`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedgen.cache import CacheCandidate, DeferReason, PagedCacheManager
from pagedgen.engine.draft_budget import draft_width, extra_blocks, slot_capacity
from pagedgen.engine.invariants import validate_cache, validate_prefix_content, validate_residents
from pagedgen.engine.request import RequestState, RequestStatus

AGE_LIMIT = 32  # committed steps a waiting request may be deferred in a row before aging protects it


@dataclass(slots=True)
class RequestStepPlan:
    """One scheduled row: a request's share of the step, in scheduler order."""

    state: RequestState
    past_len: int  # tokens in the committed KV cache before the step
    seq_len: int  # tokens in the sequence before the step
    num_tokens: int  # unprocessed tokens sent this step (provisionally 1)
    is_prefill: bool  # input still being prefilled (not the one token sampled by the previous step)
    is_new: bool  # not cache-resident: admitted by this step
    packed_offset: int = 0  # first row of this request in the flat token input
    drafts: tuple[int, ...] = ()  # draft tokens verified after the decode's one token (never for prefill)
    cached_len: int = 0  # an admission's tokens found in the prefix cache (past_len includes them)

    @property
    def request_id(self) -> int:
        return self.state.request_id

    @property
    def target_slots(self) -> int:
        """Committed cache slots after the step commits."""
        return self.past_len + self.num_tokens

    @property
    def num_query_tokens(self) -> int:
        """Rows of the flat input this request occupies: its tokens plus its drafts."""
        return self.num_tokens + len(self.drafts)

    @property
    def required_slots(self) -> int:
        """Slots the step's reservation must hold: the whole sequence, plus the drafts' K/V."""
        return self.seq_len + len(self.drafts)

    @property
    def samples(self) -> bool:
        """Whether this row sends its last unprocessed token, so its logits row is sampled."""
        return self.target_slots == self.seq_len


@dataclass(slots=True)
class StepPlan:
    """The selected rows (scheduler order) and what was left out, and why."""

    rows: list[RequestStepPlan] = field(default_factory=list)
    deferred: list[RequestState] = field(default_factory=list)  # fits later, when capacity frees
    unserviceable: list[RequestState] = field(default_factory=list)  # can never fit the configured cache
    num_tokens: int = 0
    short_of_blocks: list[RequestState] = field(default_factory=list)  # deferred: too few free blocks
    short_of_residency: list[RequestState] = field(default_factory=list)  # deferred: max_batch_size residents

    @property
    def sampling_rows(self) -> list[RequestStepPlan]:
        return [row for row in self.rows if row.samples]


@dataclass(slots=True)
class Relief:
    """What :meth:`DynamicScheduler.relieve` released: idle residents that yielded, running ones preempted."""

    yielded: list[RequestState] = field(default_factory=list)
    preempted: list[RequestState] = field(default_factory=list)


class DynamicScheduler:
    """Owns request membership (waiting queue, resident order) and plans each step against the cache."""

    def __init__(
        self,
        cache: PagedCacheManager,
        max_batch_size: int,
        max_scheduled_tokens: int,
        chunk_size: int | None,
        max_draft_tokens: int = 0,
        max_mixed_step_tokens: int | None = None,
        age_limit: int = AGE_LIMIT,
    ):
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_scheduled_tokens = max_scheduled_tokens
        # None: a step with decodes may take max_scheduled_tokens too (policy step 4)
        self.max_mixed_step_tokens = max_mixed_step_tokens
        self.chunk_size = chunk_size
        self.max_draft_tokens = max_draft_tokens  # 0: drafts are never scheduled
        self._waiting: dict[int, RequestState] = {}  # non-resident ASSIGNED requests, priority order
        self._residents: dict[int, RequestState] = {}  # cache residents, admission order
        self._next_priority = 1
        self._tick = 0  # committed steps, for the idle residents' LRU order
        self.age_limit = age_limit
        self.num_preemptions = 0
        self.num_yields = 0

    # -- membership ------------------------------------------------------------------------------------

    def submit(self, state: RequestState) -> None:
        """A turn was queued: a resident waits in place, anything else joins the waiting queue. The turn gets
        the next priority stamp (earlier turns run first)."""
        state.priority = self._next_priority
        self._next_priority += 1
        state.deferrals = 0
        if state.request_id not in self._residents:
            self._waiting[state.request_id] = state

    def withdraw(self, state: RequestState) -> None:
        """Drop a non-resident request from the waiting queue (cancelled or failed before admission)."""
        self._waiting.pop(state.request_id, None)

    def admit(self, state: RequestState) -> None:
        """A committed step made ``state`` cache-resident."""
        self._waiting.pop(state.request_id, None)
        self._residents[state.request_id] = state

    def release(self, state: RequestState) -> None:
        """Forget ``state`` and return its committed blocks (and fixed-state slot) to their pools (close,
        abandonment, teardown)."""
        self._waiting.pop(state.request_id, None)
        self._residents.pop(state.request_id, None)
        if self.cache.is_resident(state.request_id):
            self.cache.deallocate(state.request_id)

    def on_committed(self, plan: StepPlan) -> None:
        """Bookkeeping of a committed step: when each row last ran (idle LRU order), and how long each
        deferred waiting request has waited (aging)."""
        self._tick += 1
        for row in plan.rows:
            row.state.last_scheduled = self._tick
            row.state.deferrals = 0
        self.on_deferred(plan)

    def on_deferred(self, plan: StepPlan) -> None:
        """Waiting requests this plan deferred have waited one more step."""
        for state in plan.deferred:
            if state.request_id in self._waiting:
                state.deferrals += 1

    # -- releasing residency ---------------------------------------------------------------------------

    def relieve(self, plan: StepPlan) -> Relief | None:
        """Release residents so that work ``plan`` left behind can run (module docstring); None when nothing
        should be released. A resident short of blocks comes first, then waiting work short of a place or
        of blocks (idle residents only), then an aged waiting request."""
        if not plan.short_of_blocks and not plan.short_of_residency:
            return None  # the common step: nothing was left behind for want of room
        idle = sorted(
            (s for s in self._residents.values() if s.status is RequestStatus.TURN_COMPLETE),
            key=lambda s: s.last_scheduled,
        )
        blocked = [s for s in plan.short_of_blocks if s.request_id in self._residents]
        if blocked:
            if idle:
                return self._yield(idle[:1])
            victim = self._victim(blocked[0], allow_self=True)
            return None if victim is None else self._preempt(victim)
        waiting = [s for s in plan.short_of_residency + plan.short_of_blocks if s.request_id in self._waiting]
        if waiting and idle:
            return self._yield(idle[: len(waiting)])
        aged = [s for s in waiting if s.deferrals >= self.age_limit]
        if aged:
            victim = self._victim(min(aged, key=lambda s: s.priority), allow_self=False)
            if victim is not None:
                return self._preempt(victim)
        return None

    def _victim(self, beneficiary: RequestState, *, allow_self: bool) -> RequestState | None:
        """The running resident to preempt for ``beneficiary``: the youngest one younger than it; else, if
        ``allow_self`` and others run, the beneficiary itself; else nobody."""
        running = [s for s in self._residents.values() if s.status.executable]
        younger = [s for s in running if s.priority > beneficiary.priority]
        if younger:
            return max(younger, key=lambda s: s.priority)
        if allow_self and any(s is not beneficiary for s in running):
            return beneficiary
        return None

    def _yield(self, states: list[RequestState]) -> Relief:
        for state in states:
            self._drop_residency(state)
        self.num_yields += len(states)
        return Relief(yielded=states)

    def _preempt(self, state: RequestState) -> Relief:
        """Back to the waiting queue, in priority order, with every token kept: it will be re-prefilled."""
        self._drop_residency(state)
        state.status = RequestStatus.ASSIGNED
        self._waiting[state.request_id] = state
        self._waiting = dict(sorted(self._waiting.items(), key=lambda item: item[1].priority))
        self.num_preemptions += 1
        return Relief(preempted=[state])

    def _drop_residency(self, state: RequestState) -> None:
        """Release a resident's cache (blocks to the prefix cache) and forget that any of it was processed;
        pending drafts go too (module docstring)."""
        self._residents.pop(state.request_id)
        self.cache.deallocate(state.request_id)
        state.processed_len = 0
        state.draft_tokens = ()

    def is_resident(self, state: RequestState) -> bool:
        return state.request_id in self._residents

    def has_work(self) -> bool:
        return bool(self._waiting) or any(s.status.executable for s in self._residents.values())

    @property
    def num_resident(self) -> int:
        return len(self._residents)

    def block_counts(self) -> tuple[int, int]:
        """``(total, free)`` blocks of the pool."""
        stats = self.cache.stats()
        return stats.total_blocks, stats.free_blocks

    def window_block_counts(self) -> tuple[int, int]:
        """``(total, free)`` blocks of the window-ring pool (``(0, 0)`` without one)."""
        stats = self.cache.stats()
        return stats.window_total_blocks, stats.window_free_blocks

    def fixed_slot_counts(self) -> tuple[int, int]:
        """``(total, free)`` slots of the fixed-state pool (``(0, 0)`` without one)."""
        stats = self.cache.stats()
        return stats.fixed_total_slots, stats.fixed_free_slots

    @property
    def residents(self) -> list[RequestState]:
        return list(self._residents.values())

    @property
    def waiting(self) -> list[RequestState]:
        return list(self._waiting.values())

    def snapshot(self) -> dict[str, object]:
        """Membership (waiting and resident order, their counts) and the cache's committed state."""
        return {
            "blocks": self.block_counts(),
            "residents": self.num_resident,
            "waiting": [s.request_id for s in self._waiting.values()],
            "resident_order": list(self._residents),
            **self.cache.snapshot(),
        }

    def violations(self, states: Mapping[int, RequestState]) -> list[str]:
        """Cache accounting plus request/cache agreement: same residents, committed slots == processed."""
        problems = validate_cache(self.cache)
        problems += validate_residents(
            self.cache, {rid: s.processed_len for rid, s in self._residents.items()}
        )
        problems += validate_prefix_content(
            self.cache, {rid: s.block_hashes for rid, s in self._residents.items() if s.block_hashes}
        )
        if self.cache.live_reservation is not None:
            problems.append("a cache reservation is still live between steps")
        for rid, state in self._residents.items():
            if states.get(rid) is not state:
                problems.append(f"resident request {rid} is not registered with the engine")
        for rid, state in states.items():
            if state.processed_len and rid not in self._residents:
                problems.append(f"request {rid}: {state.processed_len} tokens processed but not resident")
        for rid, state in self._waiting.items():
            if rid in self._residents or state.status is not RequestStatus.ASSIGNED or state.processed_len:
                problems.append(
                    f"waiting request {rid} is {state.status.value}, resident or partly processed"
                )
        return problems

    # -- planning --------------------------------------------------------------------------------------

    def plan(self, allowed: frozenset[int] | None = None) -> StepPlan:
        """Select this step's rows and token counts. Mutates nothing (the cache plan is read-only).

        ``allowed`` restricts the candidates to those request ids (failure isolation); None allows all.
        """
        candidates = self._candidates()
        if allowed is not None:
            candidates = [row for row in candidates if row.request_id in allowed]
        if not candidates:
            return StepPlan()
        resources = self.cache.plan_step_resources(
            cache_candidates(candidates),
            max_rows=min(self.max_batch_size, self.max_scheduled_tokens),
        )
        by_id = {row.request_id: row for row in candidates}
        plan = StepPlan(rows=[by_id[c.request_id] for c in resources.selected])
        for rid, num_blocks in resources.hit_blocks.items():
            row = by_id[rid]
            row.cached_len = num_blocks * self.cache.block_size
            row.past_len += row.cached_len
        for candidate, reason in resources.deferred:
            state = by_id[candidate.request_id].state
            if reason is DeferReason.UNSERVICEABLE:
                plan.unserviceable.append(state)
            else:
                plan.deferred.append(state)
        plan.short_of_blocks = [by_id[rid].state for rid in resources.short_of_blocks]
        plan.short_of_residency = [by_id[rid].state for rid in resources.short_of_residency]
        plan.rows = self._hold_back_duplicates(plan.rows)
        drafted = self._assign_drafts(plan.rows, resources.spare_blocks)
        plan.num_tokens = self._assign_tokens(plan.rows, drafted)
        return plan

    def _candidates(self) -> list[RequestStepPlan]:
        decodes: list[RequestStepPlan] = []
        prefills: list[RequestStepPlan] = []
        for state in self._residents.values():
            if state.status.executable:
                row = _provisional_row(state, is_new=False)
                (prefills if row.is_prefill else decodes).append(row)
        waiting = list(self._waiting.values())
        aged = [s for s in waiting if s.deferrals >= self.age_limit]
        if aged:  # nothing younger is admitted past the oldest aged request
            oldest = min(s.priority for s in aged)
            waiting = [s for s in waiting if s.priority <= oldest]
        return decodes + prefills + [_provisional_row(state, is_new=True) for state in waiting]

    def _hold_back_duplicates(self, rows: list[RequestStepPlan]) -> list[RequestStepPlan]:
        """The rows without admissions whose next uncached block an earlier prefill row will compute (module
        docstring). The first row of any such group stays, so a plan with rows keeps at least one."""
        if self.cache.prefix is None:
            return rows
        bs = self.cache.block_size
        coming: set[bytes] = set()  # digests of the full blocks the kept prefill rows will fill
        kept = []
        for row in rows:
            hashes = row.state.block_hashes
            if not row.is_prefill or hashes is None:
                kept.append(row)
                continue
            first, full = row.past_len // bs, row.seq_len // bs
            if row.is_new and first < full and hashes[first] in coming:
                continue  # it will find that block in the cache in a later step
            coming.update(hashes.upto(full)[first:])
            kept.append(row)
        return kept

    def _assign_drafts(self, rows: list[RequestStepPlan], spare_blocks: int) -> int:
        """Give decodes with pending drafts what the mandatory tokens left of the budget and of the
        allocatable blocks (``spare_blocks``: the cache plan's, after the selected rows), in order; returns
        the drafts given."""
        if not self.max_draft_tokens:
            return 0
        budget = self.max_scheduled_tokens - len(rows)
        free = spare_blocks
        given = 0
        for row in rows:
            state = row.state
            if row.is_prefill or row.is_new or not state.draft_tokens or budget <= 0:
                continue
            owned = len(self.cache.block_table(row.request_id))
            bs = self.cache.block_size
            capacity = slot_capacity(row.seq_len, owned, free, bs, self.cache.max_blocks_per_table)
            width = draft_width(state, budget, self.max_draft_tokens, self.chunk_size, capacity)
            row.drafts = state.draft_tokens[:width]
            free -= extra_blocks(row.seq_len, width, owned, bs)
            budget -= width
            given += width
        return given

    def _assign_tokens(self, rows: list[RequestStepPlan], drafted: int = 0) -> int:
        """Expand selected prefills in stable order within the step's token budget (less the ``drafted``
        tokens); set packed offsets."""
        budget = self.step_budget(rows) - len(rows) - drafted
        chunk_extra = None if self.chunk_size is None else self.chunk_size - 1
        offset = 0
        for row in rows:
            if row.is_prefill and budget > 0:
                extra = row.seq_len - row.past_len - 1
                if chunk_extra is not None:
                    extra = min(extra, chunk_extra)
                extra = min(extra, budget)
                row.num_tokens += extra
                budget -= extra
            row.packed_offset = offset
            offset += row.num_query_tokens
        return offset

    def step_budget(self, rows: list[RequestStepPlan]) -> int:
        """The query-token budget of a step of ``rows``: ``max_mixed_step_tokens`` when one of them decodes
        (policy step 4), else ``max_scheduled_tokens``."""
        mixed = self.max_mixed_step_tokens
        if mixed is not None and any(not row.is_prefill for row in rows):
            return min(mixed, self.max_scheduled_tokens)
        return self.max_scheduled_tokens


def cache_candidates(rows: list[RequestStepPlan]) -> list[CacheCandidate]:
    """The cache's view of rows: each must be able to hold its whole sequence (a prefill's whole input) and
    the K/V of its drafts."""
    return [
        CacheCandidate(row.request_id, row.required_slots, row.is_new, row.state.block_hashes) for row in rows
    ]


def _provisional_row(state: RequestState, *, is_new: bool) -> RequestStepPlan:
    seq_len = len(state.tokens)
    return RequestStepPlan(
        state=state,
        past_len=state.processed_len,
        seq_len=seq_len,
        num_tokens=1,
        # A decode's one input is the token its previous step sampled; anything else is (chunked) prefill.
        is_prefill=state.status is not RequestStatus.ACTIVE or state.turn_generated_tokens == 0,
        is_new=is_new,
    )
