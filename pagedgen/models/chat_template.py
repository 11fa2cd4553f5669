"""Render a model's own Jinja chat template in a sandbox, the way transformers does.

The template is untrusted text from the checkpoint, so it runs in jinja2's immutable sandbox with
transformers' environment (same string out), and :func:`render_chat_spans` says where the client's strings
landed so they are encoded as text. The environment and the span check: docs/models.md, "Chat templates".
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING

from pagedgen.core.json_value import JsonValue
from pagedgen.errors import TokenizerError

if TYPE_CHECKING:
    import jinja2


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: JsonValue,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Unlike jinja's own filter, does not HTML-escape (a prompt is not HTML)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled sandboxed template (cached per source); raises :class:`TokenizerError` on bad syntax."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"the chat template does not compile: {exc}") from exc


def render_chat(
    source: str,
    messages: Sequence[Mapping[str, JsonValue]],
    add_generation_prompt: bool,
    variables: Mapping[str, JsonValue],
) -> str:
    """The prompt text for ``messages``; the template also sees ``variables`` (special tokens, tools).

    Raises :class:`TokenizerError` if a message is not a mapping or the template raises while rendering.
    """
    import jinja2

    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizerError(
                f"chat message {index} must be a mapping with 'role'/'content', got {message!r}"
            )
    template = compile_template(source)
    try:
        return template.render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"the chat template failed to render: {exc}") from exc


_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: no template writes them


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A rendered prompt and the ``[start, end)`` character spans of the client strings in it, in order."""

    text: str
    client_spans: tuple[tuple[int, int], ...] = ()


def render_chat_spans(
    source: str,
    messages: Sequence[Mapping[str, JsonValue]],
    add_generation_prompt: bool,
    variables: Mapping[str, JsonValue],
    selected: Callable[[str], bool],
    client_variables: Sequence[str] = (),
) -> RenderedChat:
    """Render, and locate every string of ``messages`` (and of the ``client_variables`` entries of
    ``variables``, e.g. ``tools``) for which ``selected`` is true.

    Raises :class:`TokenizerError` as :func:`render_chat` does, and when the template rewrote a selected
    string (so its place in the text is unknown).
    """
    text = render_chat(source, messages, add_generation_prompt, variables)
    nonce = secrets.token_hex(6)
    originals: list[str] = []

    def mark(value: JsonValue) -> JsonValue:
        if isinstance(value, str):
            if not selected(value):
                return value
            originals.append(value)
            return f"{_OPEN}{nonce}:{len(originals) - 1}{_CLOSE}"
        if isinstance(value, Mapping):
            return {key: mark(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [mark(item) for item in value]
        return value

    marked_messages = [mark(dict(m)) if isinstance(m, Mapping) else m for m in messages]
    marked_vars = {k: mark(v) if k in client_variables else v for k, v in variables.items()}
    if not originals:
        return RenderedChat(text)
    marked = render_chat(source, marked_messages, add_generation_prompt, marked_vars)
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    length = position = 0
    for match in re.finditer(f"{_OPEN}{nonce}:(\\d+){_CLOSE}", marked):
        before = marked[position : match.start()]
        original = originals[int(match.group(1))]
        pieces += [before, original]
        length += len(before)
        spans.append((length, length + len(original)))
        length += len(original)
        position = match.end()
    pieces.append(marked[position:])
    if "".join(pieces) != text:
        raise TokenizerError(
            "the chat template rewrites message text that contains special-token strings, so that text "
            "cannot be kept apart from the template's markup"
        )
    return RenderedChat(text, tuple(spans))
