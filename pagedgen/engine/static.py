"""The static engine path (``EngineConfig(dynamic_batching=False)``): a fixed batch advanced as a unit.

A batch is formed from waiting requests and allocated once; each step runs
every executable row of the batch (whole pending input, no token budget or chunking) and samples them, with
no reservation or checkpoint protocol. Rows never release cache individually: a closed row stays physically
allocated (not executed, not reported) until the whole batch is recycled, which happens only when no row
has executable work and new requests are waiting. A request whose batch was recycled has lost its cache
state and cannot continue. Events, finish reasons and per-turn limits are the dynamic path's.

Each row owns a contiguous block range sized for its request's ``max_session_tokens`` (the most it can ever
hold), so a resident row's continuation never needs new blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pagedgen.cache import PagedCacheManager, blocks_for_tokens
from pagedgen.engine.events import EngineEvent, FinishReason
from pagedgen.engine.faults import FaultInjector
from pagedgen.engine.isolation import FailureIsolator
from pagedgen.engine.outcomes import ENGINE_EVENT_OF, Phase, StepOutcome, classify_failure
from pagedgen.engine.request import RequestState, RequestStatus
from pagedgen.engine.step import StepResult
from pagedgen.engine.turn_output import (
    commit_staged,
    fail_turn_now,
    finish_turn_now,
    sample_row,
    stage_sampled,
)
from pagedgen.errors import EngineErrorCode, RequestFailure, RowSamplingError
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.executor.runner import StepRunner
from pagedgen.guidance.bitmask import TokenMasks
from pagedgen.guidance.masks import MaskComputer, MaskRow
from pagedgen.sampling import Sampler


@dataclass(slots=True)
class StaticBatch:
    """The rows of the current batch in order, each with its fixed block range."""

    rows: dict[int, RequestState] = field(default_factory=dict)
    tables: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return sum(len(t) for t in self.tables.values())


class StaticScheduler:
    """Waiting queue plus the current static batch; the batch doubles as the static cache manager."""

    def __init__(self, num_blocks: int, block_size: int, max_batch_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self._waiting: dict[int, RequestState] = {}
        self.batch = StaticBatch()
        self.cache: PagedCacheManager | None = None  # the batch keeps its blocks itself
        self.chunk_size: int | None = None  # a row runs its whole pending input
        self.num_preemptions = 0  # rows are never preempted or evicted
        self.num_yields = 0

    # -- membership (the engine's scheduler interface) ------------------------------------------------

    def submit(self, state: RequestState) -> None:
        if state.request_id not in self.batch.rows:
            self._waiting[state.request_id] = state

    def withdraw(self, state: RequestState) -> None:
        self._waiting.pop(state.request_id, None)

    def release(self, state: RequestState) -> None:
        """Logical removal only: a batch row stays allocated (and is skipped) until the batch is recycled."""
        self._waiting.pop(state.request_id, None)

    def is_resident(self, state: RequestState) -> bool:
        return state.request_id in self.batch.rows

    def has_work(self) -> bool:
        return bool(self._waiting) or any(s.status.executable for s in self.batch.rows.values())

    @property
    def num_resident(self) -> int:
        return len(self.batch.rows)

    def block_counts(self) -> tuple[int, int]:
        return self.num_blocks, self.num_blocks - self.batch.num_blocks

    def window_block_counts(self) -> tuple[int, int]:
        """The static path keeps windowed layers in its one pool (masked): no ring pool."""
        return 0, 0

    def fixed_slot_counts(self) -> tuple[int, int]:
        """The static path serves no fixed-state model: no fixed-state pool."""
        return 0, 0

    # -- batch formation ------------------------------------------------------------------------------

    def plan(self) -> tuple[list[RequestState], list[RequestState]]:
        """``(rows to execute, unserviceable waiting requests)``; recycles the batch when it is all done.

        Mutates the batch (recycling and admission happen here: the static path has no transaction).
        """
        unserviceable: list[RequestState] = []
        executable = [s for s in self.batch.rows.values() if s.status.executable]
        if not executable and self._waiting:
            self.batch = StaticBatch()
            unserviceable = self._admit_waiting()
            executable = list(self.batch.rows.values())
        return executable, unserviceable

    def _admit_waiting(self) -> list[RequestState]:
        unserviceable = []
        next_block = 0
        for state in list(self._waiting.values()):
            width = blocks_for_tokens(state.max_total_tokens, self.block_size)
            if width > self.num_blocks:
                unserviceable.append(state)
                del self._waiting[state.request_id]
            elif len(self.batch.rows) < self.max_batch_size and next_block + width <= self.num_blocks:
                self.batch.rows[state.request_id] = state
                self.batch.tables[state.request_id] = list(range(next_block, next_block + width))
                next_block += width
                del self._waiting[state.request_id]
        return unserviceable

    def snapshot(self) -> dict[str, object]:
        """The waiting queue, the batch's rows and their block ranges, and the block counts."""
        return {
            "blocks": self.block_counts(),
            "residents": self.num_resident,
            "waiting": list(self._waiting),
            "batch": {rid: tuple(table) for rid, table in self.batch.tables.items()},
        }

    def violations(self, states: Mapping[int, RequestState]) -> list[str]:
        problems = []
        for rid, state in self.batch.rows.items():
            capacity = len(self.batch.tables[rid]) * self.block_size
            if not state.processed_len <= len(state.tokens) <= capacity:
                problems.append(f"static row {rid}: {len(state.tokens)} tokens do not fit {capacity} slots")
            if state.status is not RequestStatus.CLOSED and rid not in states:
                problems.append(f"static row {rid} is not registered with the engine")
        for rid, state in self._waiting.items():
            if rid in self.batch.rows or state.status is not RequestStatus.ASSIGNED:
                problems.append(f"waiting request {rid} is {state.status.value} or already in the batch")
        if self.batch.num_blocks > self.num_blocks:
            problems.append(f"static batch holds {self.batch.num_blocks} of {self.num_blocks} blocks")
        return problems


class StaticStep:
    """One static step: execute the batch's executable rows, sample, commit, report. No rollback protocol.

    The model and the sampler mutate nothing a retry would see (cache slots beyond committed lengths are
    rewritten by the retry), so execution and sampling failures are still reported as RETRYABLE /
    CAPACITY_BLOCKED; a failure while results are being applied is fatal. Failure isolation is the dynamic
    path's (docs/engine.md): a row the sampler refuses fails alone, and recurring rollbacks narrow the rows
    executed until the culprit is found.
    """

    def __init__(
        self,
        scheduler: StaticScheduler,
        runner: StepRunner,
        faults: FaultInjector,
        eos_token_ids: tuple[int, ...],
        isolator: FailureIsolator | None = None,
        masker: MaskComputer | None = None,
    ):
        self.scheduler = scheduler
        self.runner = runner
        self.faults = faults
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.isolator = FailureIsolator() if isolator is None else isolator
        self.masker = MaskComputer() if masker is None else masker
        self._phase = Phase.PLAN
        self._ids: tuple[int, ...] = ()

    def run(self) -> StepResult:
        rows: list[RequestState] = []
        failed: list[EngineEvent] = []  # unserviceable turns: published whatever happens next
        try:
            self._ids = ()
            self._enter(Phase.PLAN)
            rows, unserviceable = self.scheduler.plan()
            failed = self._fail_unserviceable(unserviceable)
            rows = self._isolated(rows)
            if not rows:
                outcome = StepOutcome.UNSERVICEABLE_REQUEST if failed else StepOutcome.NO_WORK
                return StepResult(outcome, failed)
            self._ids = tuple(s.request_id for s in rows)
            self._enter(Phase.EXECUTE)
            logits = self._execute(rows)
            self._enter(Phase.SAMPLE)
            try:
                masks = self._masks(rows)
                sampled = self.sampler.sample(
                    logits, [sample_row(s, self.eos_token_ids) for s in rows], masks
                )
            except RowSamplingError as error:
                return StepResult(StepOutcome.REQUEST_FAILED, failed + self._fail(rows[error.row]), error)
            self._enter(Phase.COMMIT_REQUEST)
            events = list(failed)
            for state, token in zip(rows, sampled, strict=True):
                staged = stage_sampled(state, token, len(state.tokens))
                commit_staged(staged)
                events += staged.events
            self._enter(Phase.PUBLISH)
            self.isolator.on_progress()
            return StepResult(StepOutcome.COMMITTED, events)
        except Exception as error:
            outcome = classify_failure(self._phase, error)
            if outcome is StepOutcome.REQUEST_FAILED:
                assert isinstance(error, RequestFailure)
                culprit = next(s for s in rows if s.request_id == error.request_id)
                return StepResult(outcome, failed + self._fail(culprit, error.cause), error)
            if outcome.rolled_back:
                flags, code = ENGINE_EVENT_OF[outcome]
                events = [*failed, EngineEvent.engine_level(flags, code)]
                culprit_id = self.isolator.on_rollback(list(self._ids))
                if culprit_id is not None:
                    events += self._fail(next(s for s in rows if s.request_id == culprit_id))
                return StepResult(outcome, events, error)
            return StepResult(outcome, failed, error, rows)

    def _masks(self, rows: list[RequestState]) -> TokenMasks | None:
        """The guided rows' masks, computed now (the static path does not overlap them); a request whose
        grammar fails is a RequestFailure (it fails alone). Cursors advance when the rows are applied: a
        token its mask allowed is never rejected there."""
        guided = [MaskRow(s.request_id, s.cursor, r) for r, s in enumerate(rows) if s.cursor is not None]
        if not guided:
            return None
        result = self.masker.compute(guided)
        if result.failed:
            raise RequestFailure(*result.failed[0])
        return result.masks

    def _isolated(self, rows: list[RequestState]) -> list[RequestState]:
        """The rows the isolator allows (all of them unless it is narrowing down a recurring failure)."""
        while True:
            allowed = self.isolator.allowed()
            kept = rows if allowed is None else [s for s in rows if s.request_id in allowed]
            if kept or not self.isolator.active:
                return kept
            self.isolator.on_progress()

    def _fail(self, state: RequestState, cause: BaseException | None = None) -> list[EngineEvent]:
        """Finish one row's turn FAILED (failure isolation; ``cause`` picks the code, as
        :func:`fail_turn_now` says); its batch row stays allocated."""
        self.isolator.forget(state.request_id)
        return fail_turn_now(state, cause)

    def _enter(self, phase: Phase) -> None:
        self._phase = phase
        self.faults.check(phase, self._ids)

    def _execute(self, rows: list[RequestState]) -> torch.Tensor:
        tables = self.scheduler.batch.tables
        chunks = [
            SequenceChunk(s.tokens[s.processed_len :], s.processed_len, tables[s.request_id]) for s in rows
        ]
        inputs = pack_step(chunks, self.scheduler.block_size, device=self.runner.device)
        return self.runner.execute(inputs)  # [len(rows), vocab]

    def _fail_unserviceable(self, states: list[RequestState]) -> list[EngineEvent]:
        events = []
        for state in states:
            events += finish_turn_now(state, FinishReason.FAILED, EngineErrorCode.REQUEST_UNSERVICEABLE)
        return events
