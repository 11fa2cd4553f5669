"""Text <-> token ids for a model, its chat template, and streaming detokenisation.

:class:`Tokenizer` reads the HF file format (``tokenizer.json`` through the ``tokenizers`` library, plus
``tokenizer_config.json`` for the chat template and special tokens) from the model's checkpoint directory;
a GGUF model's directory is its cache entry, where :mod:`pagedgen.models.gguf_tokenizer` wrote those files.

:class:`IncrementalDetokenizer` turns a growing list of generated ids into text deltas. Decoding one token
at a time is wrong twice over: a multi-byte UTF-8 character can span tokens (its first token decodes to
U+FFFD) and some decoders drop or add a leading space depending on what precedes. So it decodes a short
window of recent ids in context and emits only the text past what was already emitted, holding back while
the window's text ends with U+FFFD.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pagedgen.errors import ModelLoadError, TokenizerError
from pagedgen.models.chat_template import render_chat
from pagedgen.models.hf_loader import read_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Tokens chat templates close a turn with; one the template uses also ends generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
_REPLACEMENT = "\ufffd"
_MAX_CHAR_TOKENS = 4  # a UTF-8 character is at most 4 bytes, so at most 4 byte-tokens
# transformers' clean_up_tokenization, applied only when the tokenizer config asks for it.
_CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class Tokenizer:
    """A model's tokenizer: ``Tokenizer(model)`` for a :class:`pagedgen.Model`, or a checkpoint path/name.

    Raises :class:`TokenizerError` if ``tokenizer.json`` is missing or invalid.
    """

    def __init__(self, model: Any):
        directory, config_eos = _tokenizer_source(model)
        self.directory = directory
        self._backend = _load_backend(directory / TOKENIZER_FILE)
        config_path = directory / TOKENIZER_CONFIG_FILE
        self._config: dict[str, Any] = _read_config(config_path) if config_path.is_file() else {}
        self.chat_template: str | None = _chat_template(directory, self._config)
        self.special_tokens: dict[str, str] = _special_tokens(self._config)
        self.vocab_size: int = self._backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self.token_to_id(self.special_tokens.get("bos_token"))
        self.eos_token_ids: tuple[int, ...] = self._eos_ids(config_eos)
        self._cleanup = bool(self._config.get("clean_up_tokenization_spaces", False))

    def to_json(self) -> str:
        """The ``tokenizer.json`` text of this tokenizer (what llguidance builds its vocabulary view from)."""
        return self._backend.to_str()

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognised as such."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; raises :class:`TokenizerError` for an id outside the vocabulary."""
        text = self.decode_raw(ids, skip_special_tokens)
        if self._cleanup:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    def decode_raw(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode without the optional space clean-up (which would rewrite already streamed text)."""
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if i < 0 or i >= self.vocab_size)
            raise TokenizerError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_vars: Any,
    ) -> str | list[int]:
        """The prompt for ``messages`` as the model's own template writes it (ids if ``tokenize``).

        Extra keyword arguments (``tools``, ``documents``, ...) are passed to the template. Raises
        :class:`TokenizerError` if the model has no chat template or the template fails.
        """
        if self.chat_template is None:
            raise TokenizerError(f"{self.directory}: the model has no chat template")
        variables = {**self.special_tokens, **template_vars}
        text = render_chat(self.chat_template, messages, add_generation_prompt, variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _eos_ids(self, config_eos: Sequence[int]) -> tuple[int, ...]:
        """Config EOS ids, the tokenizer's ``eos_token`` and end-of-turn tokens the chat template emits."""
        ids = [int(i) for i in config_eos]
        candidates = [self.special_tokens.get("eos_token")]
        template = self.chat_template or ""
        candidates += [token for token in END_OF_TURN_TOKENS if token in template]
        ids += [i for i in (self.token_to_id(t) for t in candidates) if i is not None]
        return tuple(dict.fromkeys(ids))


class IncrementalDetokenizer:
    """Streams the text of generated ids as deltas whose concatenation equals the full decode.

    ``context_ids`` (e.g. the last few prompt ids) are decoded for context only, never emitted, so the first
    generated token gets the spacing it has in the full text. Mutates only itself.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()):
        # Any tokenizer with ``decode(ids, skip_special_tokens)`` works (the synthetic model's too); ours
        # exposes ``decode_raw`` so already streamed text is never rewritten by the space clean-up.
        self._decode = getattr(tokenizer, "decode_raw", tokenizer.decode)
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in context_ids]
        self._prefix = 0  # start of the decode window
        self._read = len(self._ids)  # ids before this index are already emitted (or context)

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Append ids; return the new complete text (empty while a character is still incomplete)."""
        self._ids.extend([int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids])
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes to U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        """Emit the text of the ids up to the last complete character (all of them when ``final``).

        The held-back tail is at most one UTF-8 character, i.e. at most ``_MAX_CHAR_TOKENS`` ids.
        """
        decode = self._decode
        lowest = max(self._read, len(self._ids) - _MAX_CHAR_TOKENS)
        for end in range(len(self._ids), lowest, -1):
            text = decode(self._ids[self._prefix : end], self._skip)
            if final or not text.endswith(_REPLACEMENT):
                break
        else:
            return ""  # nothing new, or only an incomplete character
        emitted = decode(self._ids[self._prefix : self._read], self._skip)
        if len(text) <= len(emitted):
            return ""  # e.g. a skipped special token: nothing visible yet
        self._prefix, self._read = self._read, end
        return text[len(emitted) :]


def _tokenizer_source(model: Any) -> tuple[Path, tuple[int, ...]]:
    """The directory holding the tokenizer files and the model config's EOS ids."""
    if isinstance(model, str | os.PathLike):
        from pagedgen.models.checkpoint import resolve_checkpoint

        try:
            directory = resolve_checkpoint(model).directory
        except ModelLoadError as exc:
            raise TokenizerError(str(exc)) from exc
        return directory, _config_eos(directory)
    directory = getattr(model, "checkpoint_dir", None)
    if directory is None:
        raise TokenizerError(
            f"Tokenizer expects a pagedgen.Model or a checkpoint path, got {type(model).__name__}"
        )
    return Path(directory), tuple(model.config.eos_token_ids)


def _config_eos(directory: Path) -> tuple[int, ...]:
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = directory / name
        if path.is_file():
            value = _read_config(path).get("eos_token_id")
            ids += [] if value is None else [value] if isinstance(value, int) else list(value)
    return tuple(dict.fromkeys(ids))


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return read_json(path)
    except ModelLoadError as exc:
        raise TokenizerError(str(exc)) from exc


def _load_backend(path: Path) -> Any:
    from tokenizers import Tokenizer as Backend

    if not path.is_file():
        raise TokenizerError(f"{path}: tokenizer file not found")
    try:
        return Backend.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise TokenizerError(f"{path}: invalid tokenizer file ({exc})") from exc


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The template from ``chat_template.jinja``, ``tokenizer_config.json`` or ``chat_template.json``."""
    jinja_file = directory / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None and (directory / CHAT_TEMPLATE_JSON).is_file():
        template = _read_config(directory / CHAT_TEMPLATE_JSON).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in _SPECIAL_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):  # serialised AddedToken
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens
