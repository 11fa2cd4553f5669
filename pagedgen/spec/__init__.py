"""Draft proposers above the engine (speculative decoding for the helpers and the server).

The engine only verifies drafts a caller sets; these modules are such a caller: :mod:`.ngram` proposes from
the request's own context (prompt lookup), :mod:`.driver` keeps proposals pending before each step.
"""

from __future__ import annotations

from pagedgen.spec.driver import DraftDriver, DraftProposer, DraftVerifier
from pagedgen.spec.ngram import NgramProposer

SPECULATIVE_METHODS = ("ngram",)


def make_driver(engine: DraftVerifier, method: str | None, num_speculative_tokens: int) -> DraftDriver | None:
    """The driver for ``method`` (None: no speculation). Raises ``ValueError`` for an unknown method, a
    non-positive ``num_speculative_tokens`` or one above ``engine.max_draft_tokens_per_proposal()``."""
    if method is None:
        return None
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative must be None or one of {list(SPECULATIVE_METHODS)}, got {method!r}")
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int):
        raise ValueError(f"num_speculative_tokens must be an int, got {num_speculative_tokens!r}")
    limit = engine.max_draft_tokens_per_proposal()
    if not 1 <= num_speculative_tokens <= limit:
        raise ValueError(
            f"num_speculative_tokens must be in [1, {limit}] (engine.max_draft_tokens_per_proposal(); raise "
            f"EngineConfig.max_draft_tokens for more), got {num_speculative_tokens}"
        )
    return DraftDriver(engine, NgramProposer(num_speculative_tokens))


__all__ = ["SPECULATIVE_METHODS", "DraftDriver", "DraftProposer", "NgramProposer", "make_driver"]
