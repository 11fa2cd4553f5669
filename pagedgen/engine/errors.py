"""The Engine/Request misuse errors.

Every class derives from :class:`pagedgen.errors.EngineError` (the public contract), so callers can catch one
type. Each is raised *before* any state changes: a refused call leaves the engine and the request exactly as
they were (the reference's "fails without mutation").
"""

from __future__ import annotations

from pagedgen.errors import EngineError


class InvalidArgumentError(EngineError, ValueError):
    """An argument has the wrong type or value (empty token list, unknown option name, negative limit)."""


class WrongThreadError(EngineError):
    """An Engine or Request call came from a thread other than the engine's owner thread."""


class RequestStateError(EngineError):
    """The call is not legal in the request's current lifecycle state (e.g. begin_turn while queued)."""


class RequestClosedError(RequestStateError):
    """The request was closed (explicitly, by abandonment, or by engine teardown)."""


class EngineClosedError(EngineError):
    """The engine was closed; it accepts no more work."""


class SessionLimitError(InvalidArgumentError):
    """The turn's input would leave no room for a generated token under ``max_session_tokens``."""


class DraftsUnsupportedError(EngineError):
    """Caller-supplied speculative drafts are not implemented yet; only an empty proposal is accepted."""


class EngineUnhealthyError(EngineError):
    """A fatal step failure made the engine permanently unhealthy; ``cause`` is the stored failure."""

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.cause = cause
