"""Errors of the sampling layer.

They derive from :class:`pagedgen.errors.PagedGenError` and ``ValueError`` (bad input, not a broken engine),
so the engine and the server can catch them as either. Each is raised before any sampler or matcher state
changes.
"""

from __future__ import annotations

from pagedgen.errors import PagedGenError


class SamplingError(PagedGenError, ValueError):
    """A sampling call got inputs it cannot honour (shape mismatch, bad token id, no sampleable token)."""


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
