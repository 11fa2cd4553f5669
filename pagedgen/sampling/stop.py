"""Stop strings: detect them in a turn's generated text and decide which tokens may be emitted.

The engine feeds every generated token of a turn to one :class:`StopStringMatcher`. The matcher decodes the
turn incrementally (vLLM's prefix / read offset window, so each feed decodes only a few tokens) and keeps
just the text it still needs: the text of the held tokens and at least the last ``max(len(stop)) - 1``
characters (a stop string may begin there). A token is

* released (may become a TOKEN event) once all of its text lies before any possible stop-string start;
* held while its text could still be the beginning of a stop string, or while its bytes do not decode to
  text yet (a partial UTF-8 sequence decodes to U+FFFD: we wait for the rest of the character);
* dropped when it ends after the start of the matched stop string: the stop string is never emitted.

Tokens are released whole, so a token that straddles the match start is dropped although part of its text
precedes the stop string. That part is not lost: on a match, :attr:`StopUpdate.text_before_match` is the
text from the end of the last released token up to the match start (the dropped tokens' text before the
stop string). ``decode(released tokens) + text_before_match`` is the turn's text cut at the stop string,
which is what OpenAI and vLLM return. Released tokens always end on a complete character (pending bytes
are held), so a consumer's incremental detokenizer has nothing held back at that boundary.

On a match the turn is over: :attr:`matched` is the index of the stop string with the earliest start in the
text (ties go to the lower index). If the turn ends for another reason, :meth:`flush` releases what is held.
All state is immutable values, so :meth:`checkpoint` / :meth:`restore` are O(1) and exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedgen.errors import StopStringError

_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class StopUpdate:
    """What one fed token changed: tokens now safe to emit (in order) and the matched stop index, if any.

    ``text_before_match`` is set with a match only: the text between the end of the last released token and
    the start of the stop string (possibly empty), which no released token carries.
    """

    release: list[int]
    matched: int | None = None
    text_before_match: str = ""


@dataclass(frozen=True, slots=True)
class _State:
    window: tuple[int, ...] = ()  # tokens from the decode prefix offset on
    read: int = 0  # window[:read] were already turned into text
    held: tuple[tuple[int, int | None], ...] = ()  # unreleased (token, text end offset or None while pending)
    tail: str = ""  # the text from min(released_end, text_len - (max_len - 1)) on
    text_len: int = 0  # characters of text decoded so far
    released_end: int = 0  # text offset where the last released token ends
    finished: bool = False
    matched: int | None = None


@dataclass(frozen=True, slots=True)
class StopCheckpoint:
    owner: object
    state: _State


class StopStringMatcher:
    """Per-turn stop-string state. ``decode`` maps token ids to text (e.g. ``Tokenizer.decode``).

    Raises :class:`StopStringError` for an empty or non-string stop string. Mutated only by :meth:`feed`,
    :meth:`flush` and :meth:`restore`.
    """

    __slots__ = ("_stops", "_keep", "_decode", "_state", "_identity")

    def __init__(self, stop_strings: Sequence[str], decode: Callable[[list[int]], str]) -> None:
        stops = tuple(stop_strings)
        if isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stops):
            raise StopStringError(f"stop_strings must be a list of non-empty strings, got {stop_strings!r}")
        self._stops = stops
        self._keep = max((len(s) for s in stops), default=1) - 1
        self._decode = decode
        self._state = _State()
        self._identity = object()

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stops

    @property
    def finished(self) -> bool:
        """True after a match or a flush; the matcher then accepts no more tokens."""
        return self._state.finished

    @property
    def matched(self) -> int | None:
        return self._state.matched

    @property
    def held(self) -> list[int]:
        """Tokens fed but neither released nor dropped yet."""
        return [t for t, _ in self._state.held]

    def feed(self, token: int) -> StopUpdate:
        """Add one generated token; returns the tokens it makes safe to emit and the match, if any."""
        st = self._state
        if st.finished:
            raise StopStringError("StopStringMatcher.feed after the turn finished (matched or flushed)")
        if not self._stops:
            return StopUpdate([token])
        window, read, piece = self._decode_step(st.window + (token,), st.read)
        held = st.held + ((token, None),)
        if piece is None:  # the token ends inside a multi-byte character: no new text yet
            self._state = _State(window, read, held, st.tail, st.text_len, st.released_end)
            return StopUpdate([])
        end = st.text_len + len(piece)
        held = tuple((t, end if e is None else e) for t, e in held)
        buf = st.tail + piece
        base = st.text_len - len(st.tail)  # absolute offset of buf[0]
        match = self._find(buf)
        if match is not None:
            pos, index = match
            n = _count_ending_by(held, base + pos)
            released_end = held[n - 1][1] if n else st.released_end
            self._state = _State(finished=True, matched=index)
            return StopUpdate([t for t, _ in held[:n]], index, buf[released_end - base : pos])
        n = _count_ending_by(held, end - self._partial_suffix(buf))
        released_end = held[n - 1][1] if n else st.released_end
        keep_from = max(min(released_end, end - self._keep), base)
        self._state = _State(window, read, held[n:], buf[keep_from - base :], end, released_end)
        return StopUpdate([t for t, _ in held[:n]])

    def flush(self) -> list[int]:
        """The turn ended for another reason: release every held token and finish."""
        st = self._state
        if st.finished:
            return []
        self._state = _State(finished=True)
        return [t for t, _ in st.held]

    def checkpoint(self) -> StopCheckpoint:
        return StopCheckpoint(self._identity, self._state)

    def snapshot(self) -> object:
        """The matcher's state as a comparable value (held tokens, decoded text, whether it finished)."""
        return self._state

    def restore(self, checkpoint: object) -> None:
        """Roll back to ``checkpoint``; raises :class:`StopStringError` (changing nothing) if not ours."""
        if not isinstance(checkpoint, StopCheckpoint) or checkpoint.owner is not self._identity:
            raise StopStringError("StopStringMatcher.restore got a checkpoint taken from another matcher")
        self._state = checkpoint.state

    def _decode_step(self, window: tuple[int, ...], read: int) -> tuple[tuple[int, ...], int, str | None]:
        """Decode the new tokens in the context of the previous ones; None while a character is incomplete."""
        prefix_text = self._decode(list(window[:read])) if read else ""
        full = self._decode(list(window))
        if full.endswith(_REPLACEMENT):
            return window, read, None
        return window[read:], len(window) - read, full[len(prefix_text) :]

    def _find(self, buf: str) -> tuple[int, int] | None:
        """Earliest ``(start, stop index)`` in ``buf``; only matches ending in the new text can exist."""
        best: tuple[int, int] | None = None
        for index, stop in enumerate(self._stops):
            pos = buf.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, index)
        return best

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:length]):
                    best = length
                    break
        return best


def _count_ending_by(held: tuple[tuple[int, int | None], ...], offset: int) -> int:
    """How many of the oldest held tokens have all their text before ``offset`` (pending ones never do)."""
    n = 0
    while n < len(held) and held[n][1] is not None and held[n][1] <= offset:
        n += 1
    return n
