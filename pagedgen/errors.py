"""The error types of pagedgen.

Every misuse or bad input raises a subclass of :class:`PagedGenError` with a message that names the problem.
Engine-facing errors derive from :class:`EngineError` (the public contract: docs/architecture.md).
"""

from __future__ import annotations


class PagedGenError(Exception):
    """Base class of every error pagedgen raises on purpose."""


class ModelLoadError(PagedGenError, ValueError):
    """A model file or directory could not be loaded (missing, corrupt, unsupported, inconsistent)."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint names an architecture pagedgen does not implement."""


class TokenizerError(PagedGenError, ValueError):
    """The tokenizer could not be built or could not encode/decode the input."""


class EngineError(PagedGenError, RuntimeError):
    """Misuse of the Engine/Request API; raised before any state is changed.

    ``code`` is the :class:`pagedgen.EngineErrorCode` of the refusal (``INVALID_ARGUMENT`` for bad input);
    None only on this base class.
    """

    code = None


class CacheError(PagedGenError, RuntimeError):
    """Misuse of the paged-cache ownership layer (bad reservation, unknown request, double commit)."""


class StateManifestError(ModelLoadError):
    """A decoder state manifest (derived from the config, or a ``pagedgen.json`` override) is invalid."""
