"""Where one JSON value ends, in text that arrives in pieces.

A streamed tool call's arguments are sent as they are generated, but the text after them (the call's
closing ``}``, a closing tag) is not theirs: :class:`JsonValueEnd` follows strings, escapes and bracket depth
over the pieces so the parser knows, without re-reading what came before, the exact character where the
value stops. It checks nesting only as far as it needs to (it is not a validator: the constraint, or
``json.loads`` on the finished text, is).
"""

from __future__ import annotations

from dataclasses import dataclass

_OPENERS = "{["
_CLOSERS = "}]"
_SCALAR_END = " \t\r\n,;}]"  # what may follow a top-level number, true, false or null


@dataclass(slots=True)
class JsonValueEnd:
    """Feed text with :meth:`feed`; it returns how much of that text belongs to the value."""

    started: bool = False
    done: bool = False
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _scalar: bool = False

    def feed(self, text: str) -> tuple[int, int]:
        """``(start, end)`` offsets in ``text`` of the value's characters it holds: leading whitespace before
        the value is skipped (``start``), and ``end < len(text)`` once the value has ended inside ``text``
        (``done`` is then set; later text is not the value's)."""
        start = 0
        for index, char in enumerate(text):
            if not self.started:
                if char.isspace():
                    start = index + 1
                    continue
                self.started = True
                if self._begin(char):
                    self.done = True
                    return start, index + 1
                continue
            if self._step(char):
                self.done = True
                return start, index if self._scalar else index + 1
        return start, len(text)

    def _begin(self, char: str) -> bool:
        if char in _OPENERS:
            self._depth = 1
        elif char == '"':
            self._in_string = True
        else:
            self._scalar = True
        return False

    def _step(self, char: str) -> bool:
        """Advance by one character; True when the value has just ended (a scalar: before ``char``)."""
        if self._scalar:
            return char in _SCALAR_END
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                return self._depth == 0
            return False
        if char == '"':
            self._in_string = True
        elif char in _OPENERS:
            self._depth += 1
        elif char in _CLOSERS:
            self._depth -= 1
            return self._depth == 0
        return False
