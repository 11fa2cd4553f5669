"""What the engine tells its caller: typed event records, their flags and codes, and the reusable buffer.

A committed step produces, per affected request, a token event, a terminal event, or one combined
``TOKEN | TURN_FINISHED`` event. Engine-level events (``request is None``) report steps that made no progress
(capacity, retryable rollback) or a fatal failure that affected no turn. Events are plain records: draining
them never changes model, cache or request state.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedgen.errors import EngineErrorCode as EngineErrorCode  # re-exported: events carry the public codes
from pagedgen.errors import InvalidArgumentError

if TYPE_CHECKING:
    from pagedgen.engine.engine import Engine
    from pagedgen.engine.request import Request


class EngineEventFlags(enum.IntFlag):
    """Bitmask: test bits (``flags & TOKEN``), never compare for equality; TOKEN | TURN_FINISHED combine."""

    NONE = 0
    TOKEN = 1
    TURN_FINISHED = 2
    CAPACITY_BLOCKED = 4
    FAILED = 8
    RETRYABLE = 16


class FinishReason(enum.Enum):
    """Why a turn ended; ``NONE`` while it is in progress."""

    NONE = "none"
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    STOP_STRING = "stop_sequence"  # alias: ONNX Runtime GenAI 0.18's name for STOP_SEQUENCE
    MAX_GENERATED_TOKENS = "max_generated_tokens"
    MAX_SESSION_TOKENS = "max_session_tokens"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Usage:
    """Per-turn token accounting, reported with the terminal event.

    ``prompt_tokens`` counts the turn's accepted input, ``generated_tokens`` the output tokens the turn
    appended, ``cached_prompt_tokens`` how many of the ``prompt_tokens`` were not computed because the
    admission found them in the prefix cache (0 for a resident continuation, which recomputes nothing
    before its input either, and whenever prefix caching is off). ``reused_tokens`` counts every position
    before the turn's first computed one that the turn did not compute: a resident continuation's history
    or the cached prefix an admission started from (the conversation a chat turn did not recompute).
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_prompt_tokens: int = 0
    reused_tokens: int = 0  # tokens before the turn's first computed position it did not compute itself


@dataclass(frozen=True, slots=True)
class TurnReuse:
    """What the first step of a turn's input did not compute: ``reused_tokens`` positions before it (a
    resident's history, or the cached prefix its admission found), ``cached_prompt_tokens`` of them the
    turn's own input."""

    reused_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The sampled token's log-probability and the top-n ``(token, logprob)`` alternatives."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class EngineEvent:
    """One event. ``request`` is the caller's own Request object (identity), or None for engine-level events.

    ``token`` is None unless ``flags & TOKEN``; ``finish_reason`` and ``usage`` are set with TURN_FINISHED;
    ``turn_id`` is the request-local turn id (0 for engine-level events).

    Events stay at token granularity: a token in which a stop string begins is never a TOKEN event, even when
    part of its text precedes the stop string. That part is ``text_before_stop``, set with TURN_FINISHED when
    the turn ends on a stop string ("" otherwise): the turn's text is exactly the decode of its TOKEN events
    followed by ``text_before_stop``.
    """

    request: Request | None
    turn_id: int
    flags: EngineEventFlags
    token: int | None = None
    finish_reason: FinishReason = FinishReason.NONE
    usage: Usage | None = None
    error_code: EngineErrorCode = EngineErrorCode.NONE
    matched_stop_string_index: int | None = None
    logprobs: TokenLogprobs | None = None
    text_before_stop: str = ""
    error_message: str = ""  # with FAILED: why, when the engine can say (llguidance's reason)
    # The engine-internal request id; lets the engine purge a closed request's events without the handle.
    request_id: int | None = field(default=None, repr=False, compare=False)

    def snapshot(self) -> tuple[object, ...]:
        """The event as a comparable value, its request by id (the engine's snapshot of retained events)."""
        request_id = None if self.request is None else self.request.id
        return (
            request_id,
            self.turn_id,
            int(self.flags),
            self.token,
            self.finish_reason,
            self.usage,
            self.error_code,
        )

    @staticmethod
    def engine_level(flags: EngineEventFlags, error_code: EngineErrorCode) -> EngineEvent:
        return EngineEvent(request=None, turn_id=0, flags=flags, error_code=error_code)


class EngineEventBuffer(Sequence[EngineEvent]):
    """Caller-owned, fixed-capacity event storage bound to the engine that created it.

    ``Engine.run(buffer)`` clears the buffer and fills it with up to ``capacity`` events; the buffer is then a
    read-only sequence. It holds only a weak reference to its engine (a buffer never keeps an engine alive).
    """

    __slots__ = ("_capacity", "_engine_ref", "_events")

    def __init__(self, engine: Engine, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgumentError(f"event buffer capacity must be an int >= 0, got {capacity!r}")
        self._capacity = capacity
        self._engine_ref = weakref.ref(engine)
        self._events: list[EngineEvent] = []

    @property
    def capacity(self) -> int:
        return self._capacity

    def bound_to(self, engine: Engine) -> bool:
        return self._engine_ref() is engine

    def _reset(self) -> None:
        self._events.clear()

    def _fill(self, events: list[EngineEvent]) -> None:
        self._events.extend(events)

    def __len__(self) -> int:
        return len(self._events)

    def __getitem__(self, index):  # type: ignore[override]
        return self._events[index]

    def __iter__(self) -> Iterator[EngineEvent]:
        return iter(self._events)

    def __repr__(self) -> str:
        return f"EngineEventBuffer(capacity={self._capacity}, events={self._events!r})"
