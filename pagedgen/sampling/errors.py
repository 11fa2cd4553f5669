"""Errors of the sampling layer.

They derive from :class:`pagedgen.errors.PagedGenError` and ``ValueError`` (bad input, not a broken engine),
so the engine and the server can catch them as either. Each is raised before any sampler or matcher state
changes.
"""

from __future__ import annotations

from pagedgen.errors import PagedGenError


class SamplingError(PagedGenError, ValueError):
    """A sampling call got inputs it cannot honour (shape mismatch, bad token id, no sampleable token)."""


class SamplingOptionsError(SamplingError):
    """A :class:`~pagedgen.sampling.options.SamplingOptions` field is out of range; the message names it."""


class StopStringError(SamplingError):
    """Misuse of a :class:`~pagedgen.sampling.stop.StopStringMatcher` (bad stop strings, late feed)."""
