"""Every error type pagedgen raises on purpose, and the one enum of engine error codes.

One module with no imports, so every layer (core up to the server) can name the same classes, and a caller
reads here which failures exist and which of them carry a code. The families: model loading and tokenizers,
the Engine/Request misuse errors (each raised before any state changes, each with an
:class:`EngineErrorCode`), the cache's ownership errors, sampling and guidance input errors, and the failures
the step transaction classifies (docs/engine.md, "Rollback rules"; the hierarchy: docs/architecture.md,
"Errors").
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


class PagedGenError(Exception):
    """Base class of every error pagedgen raises on purpose."""


# -- models and tokenizers ----------------------------------------------------------------------------


class ModelLoadError(PagedGenError, ValueError):
    """A model file or directory could not be loaded (missing, corrupt, unsupported, inconsistent)."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint names an architecture pagedgen does not implement."""


class StateManifestError(ModelLoadError):
    """A decoder state manifest (derived from the config, or a ``pagedgen.json`` override) is invalid."""


class TokenizerError(PagedGenError, ValueError):
    """The tokenizer could not be built or could not encode/decode the input."""


# -- Engine/Request misuse (the public contract: catch EngineError) -------------------------------------


class EngineError(PagedGenError, RuntimeError):
    """Misuse of the Engine/Request API; raised before any state is changed.

    ``code`` is the :class:`EngineErrorCode` of the refusal (``INVALID_ARGUMENT`` for bad input); None only
    on this base class.
    """

    code: EngineErrorCode | None = None


class InvalidArgumentError(EngineError, ValueError):
    """An argument has the wrong type or value (empty token list, unknown option name, negative limit).

    ``field`` names the offending option when there is one (``"logit_bias"``, ``"temperature"``), so a server
    can report it as the bad parameter.
    """

    code = EngineErrorCode.INVALID_ARGUMENT

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class WrongThreadError(EngineError):
    """An Engine or Request call came from a thread other than the engine's owner thread."""

    code = EngineErrorCode.FAILED_PRECONDITION


class RequestStateError(EngineError):
    """The call is not legal in the request's current lifecycle state (e.g. begin_turn while queued)."""

    code = EngineErrorCode.FAILED_PRECONDITION


class RequestClosedError(RequestStateError):
    """The request was closed (explicitly, by abandonment, or by engine teardown)."""


class EngineClosedError(EngineError):
    """The engine was closed; it accepts no more work."""

    code = EngineErrorCode.FAILED_PRECONDITION


class SessionLimitError(InvalidArgumentError):
    """The turn's input would leave no room for a generated token under ``max_session_tokens``."""


class DraftsUnsupportedError(EngineError):
    """This engine cannot verify caller-supplied drafts (``max_draft_tokens_per_proposal()`` is 0: static
    batching, a model with fixed conv / recurrent state, or ``max_draft_tokens=0``); only an empty proposal
    is accepted."""

    code = EngineErrorCode.UNIMPLEMENTED


class EngineUnhealthyError(EngineError):
    """A fatal step failure made the engine permanently unhealthy; ``cause`` is the stored failure."""

    code = EngineErrorCode.ENGINE_UNHEALTHY

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.cause = cause


class UnsupportedStateError(EngineError):
    """The model's decoder state manifest needs something this engine does not implement (a fixed conv or
    recurrent state pool, several paged groups); raised at engine construction, naming what and why."""

    code = EngineErrorCode.UNIMPLEMENTED


# -- the cache ------------------------------------------------------------------------------------------


class CacheError(PagedGenError, RuntimeError):
    """Misuse of the paged-cache ownership layer (bad reservation, unknown request, double commit)."""


# -- sampling and guidance input (bad input, not a broken engine: also ValueError) ----------------------


class SamplingError(PagedGenError, ValueError):
    """A sampling call got inputs it cannot honour (shape mismatch, bad token id, no sampleable token).

    Each sampling error is raised before any sampler or matcher state changes.
    """


class RowSamplingError(SamplingError):
    """One row of a batched sampling call cannot be sampled; ``row`` is its index in that call.

    Lets the engine fail only the request that owns the row instead of the whole step.
    """

    def __init__(self, message: str, row: int):
        super().__init__(message)
        self.row = row


class SamplingOptionsError(SamplingError):
    """A sampling or turn option is out of range; the message names it and ``field`` holds its name."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class StopStringError(SamplingError):
    """Misuse of a :class:`~pagedgen.sampling.stop.StopStringMatcher` (bad stop strings, late feed)."""


class GuidanceError(PagedGenError, ValueError):
    """A guidance kind is unknown or its schema / grammar does not compile; the message says which."""


# -- failures the step transaction classifies -------------------------------------------------------------


class RetryableExecutionError(PagedGenError, RuntimeError):
    """The executor reports a transient failure: the step is rolled back and may be retried unchanged."""


class ExecutionCapacityError(PagedGenError, RuntimeError):
    """The model run exceeded available memory: the step is rolled back; the engine stays healthy."""


class TensorParallelError(PagedGenError, ValueError):
    """A model or size that tensor parallelism cannot split (the message names the family or the sizes)."""


class RankFailedError(PagedGenError, RuntimeError):
    """A tensor-parallel rank died, hung past the timeout, failed to start or failed mid-step: the ranks are
    out of step."""


class RequestFailure(Exception):
    """A step failure that belongs to one request's row (its sampler, processors, stop matcher).

    Raised before the commit boundary, it rolls the step back and fails only that request's turn.
    """

    def __init__(self, request_id: int, cause: BaseException):
        super().__init__(f"request {request_id} failed: {type(cause).__name__}: {cause}")
        self.request_id = request_id
        self.cause = cause


class InjectedFault(RuntimeError):
    """The default error of an armed fault point (:mod:`pagedgen.engine.faults`): an *unknown* failure,
    with no retryable or capacity meaning."""
