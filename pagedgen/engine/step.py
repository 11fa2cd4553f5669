"""One dynamic engine step as a transaction.

    plan -> reserve -> checkpoint -> pack -> execute once -> sample -> stage -> validate -> prepare
         -> commit (request/search, then cache + admission) -> publish events in scheduler order

Nothing before the commit boundary changes committed state, so a known failure there is undone by
restoring the checkpoints and discarding the reservation; from the commit on, containment is fail-stop.
:meth:`DynamicStep._fail` is the one place that turns a failure into an outcome
(:func:`pagedgen.engine.outcomes.classify_failure`); a failure that names its request fails only that turn
(:mod:`pagedgen.engine.isolation` narrows down the others). The phases: docs/architecture.md, "The engine
step"; the rollback rules: docs/engine.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import llguidance
import torch

from pagedgen.cache import Reservation
from pagedgen.core.step_inputs import StepInputs
from pagedgen.engine.events import EngineEvent, FinishReason, TokenLogprobs, TurnReuse
from pagedgen.engine.faults import FaultInjector
from pagedgen.engine.isolation import FailureIsolator
from pagedgen.engine.outcomes import ENGINE_EVENT_OF, Phase, StepOutcome, classify_failure
from pagedgen.engine.request import RequestState
from pagedgen.engine.scheduler import DynamicScheduler, RequestStepPlan, StepPlan, cache_candidates
from pagedgen.engine.turn_output import (
    StagedResult,
    commit_staged,
    fail_turn_now,
    finish_turn_now,
    sample_row,
    stage_outputs,
)
from pagedgen.errors import CacheError, EngineErrorCode, RequestFailure, RowSamplingError
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.executor.runner import StepRunner
from pagedgen.guidance.bitmask import TokenMasks
from pagedgen.guidance.masks import MaskComputer, MaskRow, PendingMasks
from pagedgen.sampling import Sampler, SamplerCheckpoint, StopCheckpoint
from pagedgen.sampling.draft_verification import VerifiedRow, sample_with_drafts


@dataclass(slots=True)
class StepResult:
    """A step's typed outcome, the events it publishes (scheduler order) and, on failure, the error.

    ``affected`` lists the requests of a fatally failed step (their turns must be failed by the engine);
    ``drafts_proposed`` / ``drafts_accepted`` count the draft tokens a committed step verified / accepted.
    """

    outcome: StepOutcome
    events: list[EngineEvent] = field(default_factory=list)
    error: BaseException | None = None
    affected: list[RequestState] = field(default_factory=list)
    drafts_proposed: int = 0
    drafts_accepted: int = 0


@dataclass(slots=True)
class _Checkpoint:
    """The transactional part of one sampled request: its random stream, stop-string matcher and grammar
    cursor."""

    state: RequestState
    sampler: SamplerCheckpoint
    matcher: StopCheckpoint | None
    held_logprobs: list[TokenLogprobs | None]
    cursor: tuple[llguidance.LLMatcher, int] | None = None


@dataclass(slots=True)
class _Transaction:
    phase: Phase = Phase.PLAN
    plan: StepPlan | None = None
    request_ids: tuple[int, ...] = ()  # the planned rows' requests, plan order
    reservation: Reservation | None = None
    checkpoints: list[_Checkpoint] = field(default_factory=list)
    early_events: list[EngineEvent] = field(default_factory=list)  # unserviceable turns, published first
    masks: PendingMasks | None = None  # the guided rows' masks, computed while the model runs
    failed_in: Phase | None = None  # where a failed step failed (decides what its rollback can restore)


_BEFORE_EXECUTION = frozenset({Phase.RESERVE, Phase.CHECKPOINT, Phase.PACK})


def _turn_reuse(row: RequestStepPlan) -> TurnReuse | None:
    """For the first step of a turn's input, what it did not compute (usage); None for any other step."""
    if not row.state.turn_input_pending:
        return None
    return row.state.reuse_from(row.past_len)


class DynamicStep:
    """Runs one transaction over the scheduler's requests, the paged cache and the model runner."""

    def __init__(
        self,
        scheduler: DynamicScheduler,
        runner: StepRunner,
        faults: FaultInjector,
        eos_token_ids: tuple[int, ...],
        isolator: FailureIsolator | None = None,
        masker: MaskComputer | None = None,
    ):
        self.scheduler = scheduler
        self.cache = scheduler.cache
        self.runner = runner
        self.faults = faults
        self.eos_token_ids = eos_token_ids
        self.block_size = scheduler.cache.block_size
        window = scheduler.cache.window
        self.window = None if window is None else window.window  # sliding window of the ring layers
        self.sampler = Sampler()
        self.isolator = FailureIsolator() if isolator is None else isolator
        self.masker = MaskComputer(hold=faults.hold_mask) if masker is None else masker

    def run(self) -> StepResult:
        """Plan and execute at most one transaction. Never raises except for a planning MemoryError."""
        txn = _Transaction()
        try:
            plan = self._plan(txn)
            if not self.isolator.active and self.scheduler.relieve(plan) is not None:
                return StepResult(StepOutcome.RESIDENCY_RELEASED)  # the next step plans with the room
            if not plan.rows:
                return self._without_execution(plan)
            reservation = self._reserve(txn, plan)
            self._checkpoint(txn, plan)
            inputs = self._pack(txn, plan, reservation)
            txn.masks = self._submit_masks(plan)
            logits = self._execute(txn, inputs)
            sampled = self._sample(txn, plan, logits)
            staged = self._stage(txn, plan, sampled)
            advance = self._validate(txn, plan, staged, reservation)
            self._prepare(txn, reservation, advance)
            self._commit(txn, plan, staged, reservation, advance)
            self.isolator.on_progress()
            return self._committed(txn, staged)
        except BaseException as error:
            return self._fail(txn, error)

    # -- phases ---------------------------------------------------------------------------------------

    def _enter(self, txn: _Transaction, phase: Phase) -> None:
        txn.phase = phase
        self.faults.check(phase, txn.request_ids)

    def _plan(self, txn: _Transaction) -> StepPlan:
        """The scheduler's plan, restricted to the isolator's suspects while it narrows down a failure."""
        self._enter(txn, Phase.PLAN)
        plan = self.scheduler.plan(self.isolator.allowed())
        while not plan.rows and self.isolator.active:  # the suspects are gone: try the next scope
            self.isolator.on_progress()
            plan = self.scheduler.plan(self.isolator.allowed())
        txn.plan = plan
        txn.request_ids = tuple(row.request_id for row in plan.rows)
        return plan

    def _without_execution(self, plan: StepPlan) -> StepResult:
        """Nothing fits: fail the unserviceable turns, else report capacity backpressure, else no work."""
        if plan.unserviceable:
            return StepResult(StepOutcome.UNSERVICEABLE_REQUEST, self._fail_unserviceable(plan))
        if plan.deferred:
            self.scheduler.on_deferred(plan)
            flags, code = ENGINE_EVENT_OF[StepOutcome.CAPACITY_DEFERRED]
            return StepResult(StepOutcome.CAPACITY_DEFERRED, [EngineEvent.engine_level(flags, code)])
        return StepResult(StepOutcome.NO_WORK)

    def _reserve(self, txn: _Transaction, plan: StepPlan) -> Reservation:
        self._enter(txn, Phase.RESERVE)
        targets = {row.request_id: row.target_slots for row in plan.rows}  # the fixed state's boundary
        txn.reservation = self.cache.reserve(cache_candidates(plan.rows), targets)
        fixed = txn.reservation.fixed
        if fixed is not None and (
            tuple(r.request_id for r in fixed.rows) != txn.request_ids
            or fixed.num_new != sum(row.is_new for row in plan.rows)
        ):  # the fixed reservation must cover the plan's rows in order; a mismatch is a contract failure
            raise CacheError("the fixed-state reservation does not match the step plan")
        return txn.reservation

    def _checkpoint(self, txn: _Transaction, plan: StepPlan) -> None:
        """Snapshot the sampler, stop matcher and grammar cursor of every row that samples (the only
        pre-commit mutations)."""
        self._enter(txn, Phase.CHECKPOINT)
        for row in plan.rows:
            if row.samples:
                state = row.state
                matcher = None if state.stop_matcher is None else state.stop_matcher.checkpoint()
                cursor = None if state.cursor is None else state.cursor.checkpoint()
                txn.checkpoints.append(
                    _Checkpoint(state, state.sampler.checkpoint(), matcher, list(state.held_logprobs), cursor)
                )

    def _pack(self, txn: _Transaction, plan: StepPlan, reservation: Reservation) -> StepInputs:
        """Validate the planned counts and pack the rows into one padding-free model input."""
        self._enter(txn, Phase.PACK)
        chunks = []
        for row in plan.rows:
            remaining = row.seq_len - row.past_len
            if not 0 < row.num_tokens <= remaining or row.past_len != reservation.committed_slots(
                row.request_id
            ):
                raise ValueError(
                    f"request {row.request_id}: planned {row.num_tokens} tokens at past {row.past_len}, but "
                    f"{remaining} remain and the cache holds {reservation.committed_slots(row.request_id)}"
                )
            tokens = row.state.tokens[row.past_len : row.past_len + row.num_tokens]
            if row.drafts:  # verified after the decode's token: one logits row per input token
                tokens = [*tokens, *row.drafts]
            rid = row.request_id
            ring = reservation.window_ring(rid)
            table = reservation.block_table(rid)
            # A partial prefill (samples False) gets no logits row: pack_step leaves it out on the host.
            chunks.append(
                SequenceChunk(
                    tokens, row.past_len, table, bool(row.drafts), window_ring=ring, samples=row.samples
                )
            )
        inputs = pack_step(chunks, self.block_size, device=self.runner.device, window=self.window)
        inputs.fixed = reservation.fixed_bindings  # rows in step order, like the packed tokens
        return inputs

    def _submit_masks(self, plan: StepPlan) -> PendingMasks | None:
        """Start the guided sampling rows' masks on the mask worker, so they overlap the forward pass.

        Rows are numbered as the sampled logits rows: one per sampling row, K+1 for a row with K drafts.
        """
        rows: list[MaskRow] = []
        at = 0
        for row in plan.sampling_rows:
            if row.state.cursor is not None:
                rows.append(MaskRow(row.request_id, row.state.cursor, at, row.drafts))
            at += len(row.drafts) + 1
        return self.masker.submit(rows) if rows else None

    def _execute(self, txn: _Transaction, inputs: StepInputs) -> torch.Tensor:
        self._enter(txn, Phase.EXECUTE)
        return self.runner.execute(inputs)  # [num_sampling_rows, vocab]

    def _sample(self, txn: _Transaction, plan: StepPlan, logits: torch.Tensor) -> list[VerifiedRow]:
        """The sampling seam: one batched call over every row that finished its input this step, verifying
        the drafts of the rows that sent some (:mod:`pagedgen.sampling.draft_verification`)."""
        self._enter(txn, Phase.SAMPLE)
        sampling = plan.sampling_rows
        masks = self._joined_masks(txn)
        rows = [sample_row(row.state, self.eos_token_ids) for row in sampling]
        drafts = [row.drafts for row in sampling]
        try:
            return sample_with_drafts(self.sampler, logits, rows, drafts, masks) if rows else []
        except RowSamplingError as error:  # the sampler names the row it cannot sample: only its turn fails
            raise RequestFailure(sampling[error.row].request_id, error) from error

    @staticmethod
    def _joined_masks(txn: _Transaction) -> TokenMasks | None:
        """The step's guidance masks (waiting for the worker if it is not done); a request whose grammar
        failed fails alone."""
        if txn.masks is None:
            return None
        result = txn.masks.result()
        if result.failed:
            request_id, error = result.failed[0]
            raise RequestFailure(request_id, error)
        return result.masks

    def _stage(self, txn: _Transaction, plan: StepPlan, sampled: list[VerifiedRow]) -> list[StagedResult]:
        """Stage each row; a row's own failure (its stop matcher, say) is attributed to its request."""
        self._enter(txn, Phase.STAGE)
        tokens = iter(sampled)
        staged = []
        for row in plan.rows:
            if not row.samples:
                staged.append(StagedResult(row.state, row.target_slots, reuse=_turn_reuse(row)))
                continue
            verified = next(tokens)
            try:
                staged.append(_stage_row(row, verified))
            except Exception as error:
                raise RequestFailure(row.request_id, error) from error
        return staged

    def _validate(
        self, txn: _Transaction, plan: StepPlan, staged: list[StagedResult], reservation: Reservation
    ) -> dict[int, int]:
        """Prove the commit cannot fail for a checkable reason; returns each row's committed-slot target."""
        self._enter(txn, Phase.VALIDATE)
        for row, result in zip(plan.rows, staged, strict=True):
            state = row.state
            if (
                not state.status.executable
                or len(state.tokens) != row.seq_len
                or state.processed_len != row.past_len - row.cached_len
            ):
                raise ValueError(f"request {state.request_id} changed during the step")
            if not row.target_slots <= result.target_processed <= row.target_slots + len(row.drafts):
                raise ValueError(f"request {state.request_id}: staged length disagrees with the plan")
        # Narrowed to what was accepted: the K/V of rejected drafts stays in slots past the committed length,
        # never visible, and the next step overwrites them.
        advance = {result.state.request_id: result.target_processed for result in staged}
        reservation.validate_commit(advance)
        return advance

    def _prepare(self, txn: _Transaction, reservation: Reservation, advance: dict[int, int]) -> None:
        """The commit's fallible device work (fixed state into its inactive banks); fail-stop, and nothing
        is visible yet."""
        self._enter(txn, Phase.PREPARE)
        reservation.prepare_commit(advance)

    def _commit(
        self,
        txn: _Transaction,
        plan: StepPlan,
        staged: list[StagedResult],
        reservation: Reservation,
        advance: dict[int, int],
    ) -> None:
        """Cross the commit boundary: request/search state, then cache ownership and admission."""
        self._enter(txn, Phase.COMMIT_REQUEST)
        txn.early_events = self._fail_unserviceable(plan)
        for result in staged:
            commit_staged(result)
        txn.checkpoints.clear()
        self._enter(txn, Phase.COMMIT_CACHE)
        reservation.commit(advance)
        for row in plan.rows:
            if row.is_new:
                self.scheduler.admit(row.state)
        self.scheduler.on_committed(plan)

    def _publish(self, txn: _Transaction, staged: list[StagedResult]) -> list[EngineEvent]:
        self._enter(txn, Phase.PUBLISH)
        events = txn.early_events
        for result in staged:
            events.extend(result.events)
        return events

    def _committed(self, txn: _Transaction, staged: list[StagedResult]) -> StepResult:
        result = StepResult(StepOutcome.COMMITTED, self._publish(txn, staged))
        result.drafts_proposed = sum(row.num_drafts for row in staged)
        result.drafts_accepted = sum(row.num_accepted for row in staged)
        return result

    def _fail_unserviceable(self, plan: StepPlan) -> list[EngineEvent]:
        events = []
        for state in plan.unserviceable:
            self.scheduler.withdraw(state)
            events += finish_turn_now(state, FinishReason.FAILED, EngineErrorCode.REQUEST_UNSERVICEABLE)
        return events

    # -- failure: the one place ----------------------------------------------------------------------

    def _fail(self, txn: _Transaction, error: BaseException) -> StepResult:
        """Classify ``error`` by phase; roll back a recoverable step, otherwise report it as fatal."""
        outcome = classify_failure(txn.phase, error)
        txn.failed_in = txn.phase
        if txn.masks is not None:
            txn.masks.wait()  # the worker must be done with the cursors before they are restored
        if not isinstance(error, Exception) or (txn.phase is Phase.PLAN and isinstance(error, MemoryError)):
            # An interrupt, or a planning allocation failure: undo what is undoable and let it propagate.
            if not txn.phase.fail_stop:
                self._rollback(txn)
            raise error
        if outcome.rolled_back:
            try:
                self._rollback(txn)
            except Exception as rollback_error:
                return self._fatal(txn, StepOutcome.FATAL_EXECUTION_FAILURE, rollback_error)
            return StepResult(outcome, self._isolate(txn, outcome, error), error)
        return self._fatal(txn, outcome, error)

    def _isolate(self, txn: _Transaction, outcome: StepOutcome, error: BaseException) -> list[EngineEvent]:
        """After a rollback: fail the named request's turn, or let the isolator retry or narrow the batch."""
        if outcome is StepOutcome.REQUEST_FAILED:
            assert isinstance(error, RequestFailure)
            return self._fail_request(txn, error.request_id, error.cause)
        flags, code = ENGINE_EVENT_OF[outcome]
        events = [EngineEvent.engine_level(flags, code)]
        culprit = self.isolator.on_rollback(list(txn.request_ids))
        if culprit is not None:
            events += self._fail_request(txn, culprit)
        return events

    def _fail_request(
        self, txn: _Transaction, request_id: int, cause: BaseException | None = None
    ) -> list[EngineEvent]:
        """Finish one planned request's turn FAILED after the rollback (:func:`fail_turn_now`: ``cause``
        picks the code); blocks stay owned."""
        assert txn.plan is not None
        state = next(row.state for row in txn.plan.rows if row.request_id == request_id)
        if not self.scheduler.is_resident(state):
            self.scheduler.withdraw(state)
        self.isolator.forget(request_id)
        return fail_turn_now(state, cause)

    def _rollback(self, txn: _Transaction) -> None:
        """Restore every checkpoint and release the reservation: committed state is as before the step."""
        self._enter(txn, Phase.ROLLBACK)
        for cp in reversed(txn.checkpoints):
            cp.state.sampler.restore(cp.sampler)
            if cp.matcher is not None:
                cp.state.stop_matcher.restore(cp.matcher)
            if cp.cursor is not None:
                cp.state.cursor.restore(cp.cursor)
            cp.state.held_logprobs = cp.held_logprobs
        txn.checkpoints.clear()
        if txn.reservation is not None:
            # Cached blocks evicted to make room are intact only if the model never ran (docs/cache.md).
            txn.reservation.discard(restore_evicted=txn.failed_in in _BEFORE_EXECUTION)

    def _fatal(self, txn: _Transaction, outcome: StepOutcome, error: BaseException) -> StepResult:
        """Fail-stop: nothing is rolled back; an unpublished reservation just returns its blocks."""
        reservation = txn.reservation
        if reservation is not None and reservation is self.cache.live_reservation:
            with contextlib.suppress(Exception):  # unhealthy either way; on failure the blocks stay reserved
                reservation.discard()
        affected = [] if txn.plan is None else [row.state for row in txn.plan.rows]
        return StepResult(outcome, [], error, affected)


def _stage_row(row: RequestStepPlan, verified: VerifiedRow) -> StagedResult:
    """Stage a sampling row's outputs (its accepted drafts, then the replacement or bonus token)."""
    return stage_outputs(
        row.state, verified.outputs, row.seq_len, verified.num_drafts, verified.num_accepted, _turn_reuse(row)
    )
