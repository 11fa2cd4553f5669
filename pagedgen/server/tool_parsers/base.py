"""Finding tool calls in a model's text, whole or as it streams, for one tool-call format.

A :class:`ToolCallFormat` says how a model family writes its calls, and a :class:`ToolCallParser` reads a
reply in pieces into OpenAI's content and call deltas, whole text the same way, so a stream and a whole
response agree. docs/server.md, "Automatic tool calls", has the formats.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field

from pagedgen.server.tool_parsers.json_scan import JsonValueEnd
from pagedgen.server.tools import new_tool_call_id

_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:')


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How one model family writes tool calls; every format writes a call as a JSON object
    ``{"name": ..., "<arguments key>": {...}}``.

    ``trigger``: the text that opens the calls; with ``at_start`` the calls must open the reply, either with
    the trigger or directly with a call's ``{`` (Llama 3), and a reply that starts otherwise is all content.
    ``open_words`` follow the trigger (Mistral's ``[``), ``close_words`` follow each call (Hermes's
    ``</tool_call>``), ``next_call`` leads to another call and ``end_word`` (if any) ends the list. The
    ``grammar_*`` fields are the exact text the constraint writes in those places.
    """

    name: str
    trigger: str
    arguments_key: str
    at_start: bool = False
    open_words: tuple[str, ...] = ()
    close_words: tuple[str, ...] = ()
    next_call: str = ""
    end_word: str | None = None
    grammar_open: str = ""  # after the trigger, before the first call
    grammar_close: str = ""  # after each call
    grammar_next: str = ""  # between one call's close and the next call
    grammar_end: str = ""  # after the last call


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A piece of call ``index``: its first piece has ``id`` and ``name``, every piece an arguments part."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ParserDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def extend(self, other: ParserDelta) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False  # the call's object closed (else the turn was cut inside it)


class _Mode(enum.Enum):
    START = "start"  # at_start formats: nothing decided yet
    TEXT = "text"  # content, looking for the trigger
    CONTENT = "content"  # content for good (no call can follow)
    WORDS = "words"  # expecting fixed words (around a call)
    CALL = "call"  # a call object's head, before its arguments
    ARGUMENTS = "arguments"
    CALL_END = "call_end"  # the call object's closing brace
    BETWEEN = "between"  # after a call: the next call, the end word, or the end
    DONE = "done"  # nothing more is parsed


class ToolCallParser:
    """Parse one reply; one parser per choice, fed in order (:meth:`feed`, then :meth:`finish`).

    The content is the text before the first call (without its trailing whitespace, which a stream holds
    back until it knows no call follows), and a call's ``arguments`` are its arguments' text exactly as
    generated. A call whose object names its function first streams its name as soon as it is known, then
    its arguments as they come; any other key order is parsed when the object closes. Text after the calls
    that does not follow the format ends the parsing (it is not content). Only the layout is checked: under
    the server's constraint a call always names a tool and carries arguments valid for it.
    """

    def __init__(self, fmt: ToolCallFormat):
        self.format = fmt
        self.calls: list[ParsedCall] = []
        self.content = ""  # the content sent so far
        self._mode = _Mode.START if fmt.at_start else _Mode.TEXT
        self._pending = ""  # text not yet consumed
        self._held_space = ""  # content whitespace held until text follows it
        self._words: list[str] = []
        self._after_words = _Mode.CALL
        self._args = JsonValueEnd()

    def feed(self, text: str) -> ParserDelta:
        self._pending += text
        delta = ParserDelta()
        while self._step(delta, final=False):
            pass
        return delta

    def finish(self) -> ParserDelta:
        """The rest: held content when no call came, the last call completed if its text allows."""
        delta = ParserDelta()
        while self._step(delta, final=True):
            pass
        if self._mode in (_Mode.TEXT, _Mode.START, _Mode.CONTENT):
            self._content(delta, self._pending, final=True)
        elif self._mode is _Mode.CALL:
            self._call_from_object(delta, self._pending)
        self._pending = ""
        self._mode = _Mode.DONE
        return delta

    @property
    def complete(self) -> bool:
        """At least one call, and every call's object closed."""
        return bool(self.calls) and all(call.complete for call in self.calls)

    # ------------------------------------------------------------------ states

    def _step(self, delta: ParserDelta, final: bool) -> bool:
        """Consume what the current mode can; True when the mode changed and another step may consume."""
        mode = self._mode
        if mode is _Mode.START:
            return self._start()
        if mode is _Mode.TEXT:
            return self._text(delta)
        if mode is _Mode.CONTENT:
            self._content(delta, self._pending, final=False)
            self._pending = ""
            return False
        if mode is _Mode.WORDS:
            return self._expect_words()
        if mode is _Mode.CALL:
            return self._call_head(delta)
        if mode is _Mode.ARGUMENTS:
            return self._arguments(delta)
        if mode is _Mode.CALL_END:
            return self._call_end()
        if mode is _Mode.BETWEEN:
            return self._between(final)
        self._pending = ""
        return False

    def _start(self) -> bool:
        text = self._pending.lstrip()
        trigger = self.format.trigger
        if not text or (trigger.startswith(text) and text != trigger):
            return False
        if text.startswith("{"):
            self._pending = text
            self._mode = _Mode.CALL
        elif trigger and text.startswith(trigger):
            self._pending = text[len(trigger) :]
            self._expect(self.format.open_words, _Mode.CALL)
        else:
            self._mode = _Mode.CONTENT
        return True

    def _text(self, delta: ParserDelta) -> bool:
        trigger = self.format.trigger
        at = self._pending.find(trigger)
        if at >= 0:
            self._content(delta, self._pending[:at], final=False)
            self._held_space = ""  # the content before a call ends without its trailing whitespace
            self._pending = self._pending[at + len(trigger) :]
            self._expect(self.format.open_words, _Mode.CALL)
            return True
        keep = _partial_suffix(self._pending, trigger)
        self._content(delta, self._pending[: len(self._pending) - keep], final=False)
        self._pending = self._pending[len(self._pending) - keep :]
        return False

    def _content(self, delta: ParserDelta, text: str, final: bool) -> None:
        text = self._held_space + text
        kept = text if final else text.rstrip()
        self._held_space = text[len(kept) :]
        delta.content += kept
        self.content += kept

    def _expect(self, words: tuple[str, ...], then: _Mode) -> None:
        self._words = list(words)
        self._after_words = then
        self._mode = _Mode.WORDS

    def _expect_words(self) -> bool:
        while self._words:
            text = self._pending.lstrip()
            word = self._words[0]
            if text.startswith(word):
                self._pending = text[len(word) :]
                self._words.pop(0)
            elif word.startswith(text):
                return False  # wait for more
            else:
                self._mode = _Mode.DONE
                return True
        self._mode = self._after_words
        return True

    def _call_head(self, delta: ParserDelta) -> bool:
        text = self._pending.lstrip()
        if not text:
            return False
        if not text.startswith("{"):
            self._mode = _Mode.DONE
            return True
        head = _HEADER.match(text)
        if head is not None:
            call = ParsedCall(new_tool_call_id(), json.loads(f'"{head.group(1)}"'))
            self.calls.append(call)
            delta.calls.append(CallDelta(len(self.calls) - 1, id=call.id, name=call.name))
            self._pending = text[head.end() :]
            self._args = JsonValueEnd()
            self._mode = _Mode.ARGUMENTS
            return True
        scanner = JsonValueEnd()
        _start, end = scanner.feed(text)
        if scanner.done:  # the whole object, in another key order
            self._call_from_object(delta, text[:end])
            self._pending = text[end:]
            self._after_call()
            return True
        return False

    def _call_from_object(self, delta: ParserDelta, text: str) -> None:
        """A call parsed from its whole object (``{"parameters": ..., "name": ...}``); nothing if it is not
        one."""
        try:
            obj = json.loads(text)
        except ValueError:
            return
        key = (
            next((k for k in ("arguments", "parameters") if k in obj), None)
            if isinstance(obj, dict)
            else None
        )
        if key is None or not isinstance(obj.get("name"), str):
            return
        arguments = json.dumps(obj[key], ensure_ascii=False)
        call = ParsedCall(new_tool_call_id(), obj["name"], arguments, complete=True)
        self.calls.append(call)
        delta.calls.append(CallDelta(len(self.calls) - 1, arguments, id=call.id, name=call.name))

    def _arguments(self, delta: ParserDelta) -> bool:
        if not self._pending:
            return False
        start, end = self._args.feed(self._pending)
        piece = self._pending[start:end]
        if piece:
            self.calls[-1].arguments += piece
            delta.calls.append(CallDelta(len(self.calls) - 1, piece))
        self._pending = self._pending[end:]
        if not self._args.done:
            return False
        self._mode = _Mode.CALL_END
        return True

    def _call_end(self) -> bool:
        text = self._pending.lstrip()
        if not text:
            return False
        if text[0] != "}":
            self._mode = _Mode.DONE
            return True
        self.calls[-1].complete = True
        self._pending = text[1:]
        self._after_call()
        return True

    def _after_call(self) -> None:
        self._expect(self.format.close_words, _Mode.BETWEEN)

    def _between(self, final: bool) -> bool:
        text = self._pending.lstrip()
        fmt = self.format
        if fmt.next_call and text.startswith(fmt.next_call):
            self._pending = text[len(fmt.next_call) :]
            self._mode = _Mode.CALL
            return True
        if fmt.end_word and text.startswith(fmt.end_word):
            self._pending = ""
            self._mode = _Mode.DONE
            return True
        words = (fmt.next_call, fmt.end_word or "")
        waiting = not text or any(word.startswith(text) for word in words if word)
        if waiting and not final:
            return False
        self._mode = _Mode.DONE
        return True


def _partial_suffix(text: str, word: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``word``."""
    for size in range(min(len(word) - 1, len(text)), 0, -1):
        if word.startswith(text[-size:]):
            return size
    return 0
