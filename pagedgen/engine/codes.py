"""Why an event or an error is what it is: the one enum of engine error codes.

Kept in a module of its own (no imports) so that both the events and the misuse errors can carry a code.
"""

from __future__ import annotations

import enum


class EngineErrorCode(enum.Enum):
    """Why an event carries CAPACITY_BLOCKED, RETRYABLE or FAILED, or why a call was refused."""

    NONE = "none"
    CAPACITY_DEFERRED = "capacity_deferred"  # pending work exists but none fits the free capacity now
    EXECUTION_CAPACITY_EXCEEDED = "execution_capacity_exceeded"  # the model run ran out of memory
    RETRYABLE_EXECUTION = "retryable_execution"  # the transaction was rolled back and may be retried
    REQUEST_UNSERVICEABLE = "request_unserviceable"  # the turn can never fit the configured cache
    REQUEST_FAILED = "request_failed"  # this turn alone failed (failure isolation); the engine is healthy
    GUIDANCE_FAILED = "guidance_failed"  # this turn's constraint failed (a parser limit, its mask budget)
    ENGINE_CONTRACT_FAILURE = "engine_contract_failure"  # collaborators disagreed; engine is unhealthy
    ENGINE_EXECUTION_FAILURE = "engine_execution_failure"  # execution/rollback failed; engine is unhealthy
    # Codes of refused calls (``EngineError.code``); no event carries them.
    INVALID_ARGUMENT = "invalid_argument"  # a bad value or type; nothing changed
    FAILED_PRECONDITION = "failed_precondition"  # the call is not legal in the current state; nothing changed
    UNIMPLEMENTED = "unimplemented"  # the feature is not available
    ENGINE_UNHEALTHY = "engine_unhealthy"  # a fatal step failure made the engine refuse further work
