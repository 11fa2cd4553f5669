"""A turn's grammar cursor: an llguidance matcher as transactional per-request state.

Compiled matchers are cached per (tokenizer, grammar) and each turn starts from a copy; the cursor's
checkpoint is a copy too, so a restored cursor is exactly the checkpointed one, and an llguidance error
poisons it for good. Costs and the poisoning rule: docs/engine.md, "Grammar cursors".
"""

from __future__ import annotations

import time

import llguidance

from pagedgen.core.decoder import DecoderModel
from pagedgen.errors import GuidanceError
from pagedgen.guidance.lru import BoundedLru
from pagedgen.guidance.spec import GuidanceSpec, parser_limits
from pagedgen.guidance.tokenizer import guidance_tokenizer

COMPILED_CACHE_SIZE = 128  # compiled (tokenizer, grammar) matchers kept; a server reuses a few schemas a lot
COMPILED_CACHE_BYTES = 256 << 20  # ... and at most this many estimated bytes of them
MATCHER_BYTES_PER_GRAMMAR_BYTE = 32  # measured: a 0.5 MB regex's compiled matcher adds ~15 MB of RSS
FIRST_MASK_BUDGET_S = 0.5  # the first masks of a new grammar must take less wall time than this
FORCED_WALK = 8  # forced tokens the first-mask check follows (a grammar may explode right after them)

_compiled: BoundedLru[tuple[llguidance.LLTokenizer, llguidance.LLMatcher]] = BoundedLru(
    COMPILED_CACHE_SIZE, COMPILED_CACHE_BYTES
)


def compiled_matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """The pristine compiled matcher of ``grammar`` on ``tokenizer`` (shared: deep-copy it, never advance it).

    A new grammar is built under the parser limits and its first masks are computed once
    (:func:`check_first_masks`) before it is cached, so a grammar over the limits is refused here, where
    the server calls it before admission, and not by the engine step. Raises :class:`GuidanceError` with
    llguidance's message; failures are not cached.
    """
    key = (id(tokenizer), grammar)
    entry = _compiled.get(key)
    if entry is not None and entry[0] is tokenizer:
        return entry[1]
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise GuidanceError(
            f"the grammar does not compile for this model's tokenizer: {_first_line_of(matcher.get_error())}"
        )
    check_first_masks(matcher)
    # The tokenizer is held so that its id stays unique; the cost estimates the matcher's memory.
    _compiled.put(key, (tokenizer, matcher), len(grammar) * MATCHER_BYTES_PER_GRAMMAR_BYTE)
    return matcher


def check_first_masks(matcher: llguidance.LLMatcher) -> None:
    """Compute the first token mask of a fresh matcher (on a copy), following up to :data:`FORCED_WALK`
    forced tokens (a mask that allows one token); :class:`GuidanceError` if llguidance reports a limit or
    the masks took longer than :data:`FIRST_MASK_BUDGET_S`.

    Forced tokens are walked because costly grammars often have a cheap first mask and explode one token
    later ("(a{1000}){999}", 20,000 choices sharing a first character, a recursive required ``$ref``).
    """
    probe = matcher.deep_copy()
    start = time.perf_counter()
    for _ in range(FORCED_WALK + 1):
        allowed = int.from_bytes(probe.compute_bitmask(), "little")
        _raise_if_over_a_limit(probe)
        if allowed.bit_count() != 1 or probe.is_accepting():
            break  # a free choice, or a complete grammar (its one token is EOS)
        probe.consume_token(allowed.bit_length() - 1)
        _raise_if_over_a_limit(probe)
    elapsed = time.perf_counter() - start
    if elapsed > FIRST_MASK_BUDGET_S:
        raise GuidanceError(
            f"the grammar's first token masks took {elapsed:.2f} s; the budget is {FIRST_MASK_BUDGET_S} s"
        )


def _raise_if_over_a_limit(matcher: llguidance.LLMatcher) -> None:
    if matcher.is_error():
        raise GuidanceError(f"the grammar exceeds a parser limit: {_first_line_of(matcher.get_error())}")


class GrammarCursor:
    """Where one turn's output stands in its grammar. Owned by the engine's request state; not thread-safe
    (the mask worker reads it only while the owner thread waits for the step's forward pass)."""

    __slots__ = ("spec", "vocab_size", "_matcher", "num_consumed", "error")

    def __init__(self, spec: GuidanceSpec, matcher: llguidance.LLMatcher, vocab_size: int):
        self.spec = spec
        self.vocab_size = vocab_size  # llguidance's vocabulary (the logits width, + 1 without an EOS id)
        self._matcher = matcher
        self.num_consumed = 0  # tokens this turn's output advanced the grammar by
        self.error: str | None = None  # llguidance's error text once poisoned (permanent)

    @classmethod
    def for_model(cls, model: DecoderModel, spec: GuidanceSpec) -> GrammarCursor:
        """A fresh cursor at the grammar's start; :class:`GuidanceError` if it fails for the model."""
        tokenizer = guidance_tokenizer(model, json=spec.kind == "json_schema")
        return cls(spec, compiled_matcher(tokenizer, spec.grammar).deep_copy(), tokenizer.vocab_size)

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The live matcher (for the batched mask computation); raises if the cursor is poisoned."""
        self.check()
        return self._matcher

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and admits nothing more (only EOS): the turn's output is complete."""
        return self.error is None and self._matcher.is_stopped() and not self._matcher.is_error()

    def check(self) -> None:
        """Raise :class:`GuidanceError` if the cursor is poisoned (picking up a matcher error just made)."""
        if self.error is None and self._matcher.is_error():
            self.error = self._matcher.get_error()
        if self.error is not None:
            raise GuidanceError(f"guidance failed: {_first_line_of(self.error)}")

    def consume(self, token: int) -> None:
        """Advance by one emitted token; a token the grammar rejects poisons the cursor and raises."""
        self.check()
        if not self._matcher.consume_token(int(token)):
            self.check()
            raise GuidanceError(f"guidance failed: token {token} was rejected")  # pragma: no cover
        self.num_consumed += 1

    def checkpoint(self) -> tuple[llguidance.LLMatcher, int]:
        """An exact copy of the cursor's position, for :meth:`restore`."""
        return self._matcher.deep_copy(), self.num_consumed

    def restore(self, checkpoint: tuple[llguidance.LLMatcher, int]) -> None:
        """Return to ``checkpoint`` (taking ownership of it). A poisoned cursor stays poisoned."""
        self._matcher, self.num_consumed = checkpoint

    def snapshot(self) -> tuple[int, bytes, bool, str | None]:
        """The observable position: tokens consumed, the next-token mask, stopped, the poison reason."""
        return self.num_consumed, self.allowed_bitmask(), self.complete, self.error

    def allowed_bitmask(self) -> bytes:
        """The mask of the next token as llguidance computes it for one matcher (tests, diagnostics)."""
        return self._matcher.deep_copy().compute_bitmask()

    def poison(self, error: str) -> None:
        """Mark the cursor failed with ``error`` (llguidance's text), permanently."""
        if self.error is None:
            self.error = error

    def __repr__(self) -> str:
        state = "poisoned" if self.error is not None else "complete" if self.complete else "open"
        return f"GrammarCursor({self.spec!r}, {state})"


def _first_line_of(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown llguidance error"
