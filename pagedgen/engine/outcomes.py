"""The phases of one engine step, its typed outcomes, and the single rule that classifies a failure.

Why one table: the step is a transaction whose failure handling depends only on *where* it
failed and *what* failed. Before the commit boundary a known failure rolls back (RETRYABLE or
CAPACITY_BLOCKED, engine healthy); an unknown execution failure, a reservation that contradicts the plan, a
failed rollback, or anything at or after the commit boundary is fatal (fail-stop, engine unhealthy).

Failure isolation: a failure before the commit boundary that names its request (:class:`RequestFailure`,
raised for one sampling row or one stop matcher) rolls the step back and fails only that turn
(REQUEST_FAILED); the rest of the batch runs again in the next step. Unattributed rollbacks that recur are
narrowed down by :mod:`pagedgen.engine.isolation`. The table and its consequences: docs/engine.md, "Rollback
rules".
"""

from __future__ import annotations

import enum

from pagedgen.engine.events import EngineEventFlags
from pagedgen.errors import EngineErrorCode, ExecutionCapacityError, RequestFailure, RetryableExecutionError


class Phase(enum.Enum):
    """Where a step is; each is a fault point. Phases after VALIDATE, and ROLLBACK, are fail-stop."""

    PLAN = "plan"
    RESERVE = "reserve"
    CHECKPOINT = "checkpoint"
    PACK = "pack"
    EXECUTE = "execute"
    SAMPLE = "sample"
    STAGE = "stage"
    VALIDATE = "validate"
    PREPARE = "prepare"  # the commit's fallible device work (fixed state into its inactive banks)
    COMMIT_REQUEST = "commit_request"
    COMMIT_CACHE = "commit_cache"
    PUBLISH = "publish"
    ROLLBACK = "rollback"

    @property
    def fail_stop(self) -> bool:
        return self in _FAIL_STOP_PHASES


_FAIL_STOP_PHASES = frozenset(
    {Phase.PREPARE, Phase.COMMIT_REQUEST, Phase.COMMIT_CACHE, Phase.PUBLISH, Phase.ROLLBACK}
)
_RETRYABLE_PHASES = frozenset({Phase.CHECKPOINT, Phase.PACK, Phase.SAMPLE, Phase.STAGE, Phase.VALIDATE})
# Where a failure can name its request: per-row work after the model ran, before the commit boundary.
_ATTRIBUTABLE_PHASES = frozenset({Phase.SAMPLE, Phase.STAGE})


class StepOutcome(enum.Enum):
    """What one step did."""

    NO_WORK = "no_work"  # no runnable work remains
    CAPACITY_DEFERRED = "capacity_deferred"  # pending work exists, none fits the free capacity now
    UNSERVICEABLE_REQUEST = "unserviceable_request"  # some turns can never fit; they finished FAILED
    COMMITTED = "committed"
    RESIDENCY_RELEASED = "residency_released"  # idle residents yielded or a request was preempted; no run
    RETRYABLE_BATCH_ABORT = "retryable_batch_abort"  # rolled back; may be retried
    REQUEST_FAILED = "request_failed"  # rolled back; one turn failed alone, the rest retries
    EXECUTION_CAPACITY_EXCEEDED = "execution_capacity_exceeded"  # rolled back; engine healthy
    EXECUTION_CONTRACT_FAILURE = "execution_contract_failure"  # collaborators disagree: fatal
    FATAL_EXECUTION_FAILURE = "fatal_execution_failure"  # execution or rollback failed: fatal

    @property
    def is_fatal(self) -> bool:
        return self in (StepOutcome.EXECUTION_CONTRACT_FAILURE, StepOutcome.FATAL_EXECUTION_FAILURE)

    @property
    def rolled_back(self) -> bool:
        return self in (
            StepOutcome.RETRYABLE_BATCH_ABORT,
            StepOutcome.REQUEST_FAILED,
            StepOutcome.EXECUTION_CAPACITY_EXCEEDED,
        )


def classify_failure(phase: Phase, error: BaseException) -> StepOutcome:
    """The outcome of ``error`` raised in ``phase`` (the module docstring's rule)."""
    if phase.fail_stop:
        return StepOutcome.FATAL_EXECUTION_FAILURE
    if phase in (Phase.PLAN, Phase.RESERVE):
        return StepOutcome.EXECUTION_CONTRACT_FAILURE
    if isinstance(error, RequestFailure) and phase in _ATTRIBUTABLE_PHASES:
        return StepOutcome.REQUEST_FAILED
    if phase is Phase.EXECUTE:
        if isinstance(error, RetryableExecutionError):
            return StepOutcome.RETRYABLE_BATCH_ABORT
        if isinstance(error, ExecutionCapacityError):
            return StepOutcome.EXECUTION_CAPACITY_EXCEEDED
        return StepOutcome.FATAL_EXECUTION_FAILURE
    if phase in _RETRYABLE_PHASES:
        return StepOutcome.RETRYABLE_BATCH_ABORT
    return StepOutcome.FATAL_EXECUTION_FAILURE


# The engine-level event of each outcome that rolled back or made no progress.
ENGINE_EVENT_OF: dict[StepOutcome, tuple[EngineEventFlags, EngineErrorCode]] = {
    StepOutcome.CAPACITY_DEFERRED: (EngineEventFlags.CAPACITY_BLOCKED, EngineErrorCode.CAPACITY_DEFERRED),
    StepOutcome.RETRYABLE_BATCH_ABORT: (EngineEventFlags.RETRYABLE, EngineErrorCode.RETRYABLE_EXECUTION),
    StepOutcome.EXECUTION_CAPACITY_EXCEEDED: (
        EngineEventFlags.CAPACITY_BLOCKED,
        EngineErrorCode.EXECUTION_CAPACITY_EXCEEDED,
    ),
}

FATAL_ERROR_CODE: dict[StepOutcome, EngineErrorCode] = {
    StepOutcome.EXECUTION_CONTRACT_FAILURE: EngineErrorCode.ENGINE_CONTRACT_FAILURE,
    StepOutcome.FATAL_EXECUTION_FAILURE: EngineErrorCode.ENGINE_EXECUTION_FAILURE,
}
