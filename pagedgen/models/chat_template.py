"""Render a model's own Jinja chat template in a sandbox, the way transformers does.

The template comes from the checkpoint (untrusted text), so it runs in jinja2's
``ImmutableSandboxedEnvironment`` (no attribute access to Python internals, no mutation of the messages).
The environment mirrors transformers' (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a ``tojson``
that does not escape HTML, ``raise_exception``, ``strftime_now``) so a template renders to the same string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from pagedgen.errors import TokenizerError


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
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
def compile_template(source: str) -> Any:
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
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
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
