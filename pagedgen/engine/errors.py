"""The Engine/Request misuse errors.

Every class derives from :class:`pagedgen.errors.EngineError` (the public contract), so callers can catch one
type, and carries an :class:`~pagedgen.engine.codes.EngineErrorCode` in ``code``. Each is raised *before* any
state changes: a refused call leaves the engine and the request exactly as they were.
"""

from __future__ import annotations

from pagedgen.engine.codes import EngineErrorCode
from pagedgen.errors import EngineError


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
