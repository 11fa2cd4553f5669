"""Text <-> token ids for a model, its chat template, and streaming detokenisation.

:class:`Tokenizer` reads the HF files (through the ``tokenizers`` library) from the model's checkpoint
directory, :class:`IncrementalDetokenizer` turns growing ids into correct text deltas, and text a client
wrote is always encoded as text (only the template's markup yields special tokens). Why each works the way
it does: docs/models.md, "Tokenizer, streaming text and content as text".
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedgen.core.decoder import TextTokenizer
from pagedgen.core.json_value import JsonValue
from pagedgen.errors import ModelLoadError, TokenizerError
from pagedgen.models.chat_template import RenderedChat, render_chat, render_chat_spans
from pagedgen.models.hf_loader import read_json

if TYPE_CHECKING:
    from tokenizers import Tokenizer as Backend

    from pagedgen.models.config import ModelConfig

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Tokens chat templates close a turn with; one the template uses also ends generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
_REPLACEMENT = "\ufffd"
_MAX_CHAR_TOKENS = 4  # a UTF-8 character is at most 4 bytes, so at most 4 byte-tokens
_GIL_FREE_CHARS = 4096  # texts at least this long are encoded through the GIL-releasing batch call
# Template variables that hold the client's text (besides the messages), located like message content.
_CLIENT_VARIABLES = ("tools", "documents")
# Normalizers that never delete characters; composition (NF*C) can merge a few into one, hence the factor.
_KEEPING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace"}
_NORMALIZED_CHAR_FACTOR = 4
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


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered chat prompt and the special tokens its template wrote: ``(start, end, token_id)`` in
    text order. ``markup`` None means the text is encoded with every special-token string recognised (no
    client string held one, or the caller opted in)."""

    text: str
    markup: tuple[tuple[int, int, int], ...] | None = None


@dataclass(frozen=True, slots=True)
class _SpecialTokens:
    """A regex with one group per special token (longest first, with the whitespace an ``lstrip`` /
    ``rstrip`` token absorbs around it) and the token id of each group."""

    pattern: re.Pattern[str]
    ids: tuple[int, ...]
    contents: tuple[str, ...]

    def search(self, text: str) -> bool:
        """Whether ``text`` holds a special-token string (substring search: the regex took 0.7 s on 600k
        characters, holding the GIL)."""
        return any(content in text for content in self.contents)

    def find(self, text: str, begin: int, end: int) -> list[tuple[int, int, int]]:
        """``(start, end, token_id)`` of every special token in ``text[begin:end]``."""
        matches = self.pattern.finditer(text, begin, end)
        return [(m.start(), m.end(), self.ids[(m.lastindex or 1) - 1]) for m in matches]


class Tokenizer:
    """A model's tokenizer: ``Tokenizer(model)`` for a :class:`pagedgen.Model`, or a checkpoint path/name.

    Raises :class:`TokenizerError` if ``tokenizer.json`` is missing or invalid.
    """

    def __init__(self, model: object):
        directory, config_eos = _tokenizer_source(model)
        self.directory = directory
        self._backend = _load_backend(directory / TOKENIZER_FILE)
        config_path = directory / TOKENIZER_CONFIG_FILE
        self._config: dict[str, JsonValue] = _read_config(config_path) if config_path.is_file() else {}
        self.chat_template: str | None = _chat_template(directory, self._config)
        self.special_tokens: dict[str, str] = _special_tokens(self._config)
        self.vocab_size: int = self._backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self.token_to_id(self.special_tokens.get("bos_token"))
        self.eos_token_ids: tuple[int, ...] = self._eos_ids(config_eos)
        self._cleanup = bool(self._config.get("clean_up_tokenization_spaces", False))
        self._specials = _special_token_pattern(self._backend)
        self._text_backend: Backend | None = (
            None  # a copy that reads special-token strings as text, made on first use
        )
        self._text_lock = threading.Lock()
        self.max_token_chars: int | None = _max_token_chars(self._backend)

    def to_json(self) -> str:
        """The ``tokenizer.json`` text of this tokenizer (what llguidance builds its vocabulary view from)."""
        return self._backend.to_str()

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False, *, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``. With ``parse_special`` (the default, for text a template or the caller
        wrote) special-token strings in it become their tokens; without, they are encoded as plain text
        (what client text needs). ``add_special_tokens`` adds what the tokenizer puts around a sequence."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        backend = self._backend if parse_special else self._text_only()
        if len(text) < _GIL_FREE_CHARS:
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def _text_only(self) -> Backend:
        """The backend copy that encodes special-token strings as text (a flag on the shared backend would
        race with other threads' encodes)."""
        with self._text_lock:
            if self._text_backend is None:
                from tokenizers import Tokenizer as Backend

                backend = Backend.from_str(self._backend.to_str())
                backend.encode_special_tokens = True
                self._text_backend = backend
            return self._text_backend

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
        messages: Sequence[Mapping[str, JsonValue]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        parse_special_in_content: bool = False,
        **template_vars: JsonValue,
    ) -> str | list[int]:
        """The prompt for ``messages`` as the model's own template writes it (ids if ``tokenize``: the
        client's text encoded as text, see :meth:`encode_chat`).

        Extra keyword arguments (``tools``, ``documents``, ...) are passed to the template. Raises
        :class:`TokenizerError` if the model has no chat template or the template fails.
        """
        if not tokenize:
            variables = {**self.special_tokens, **template_vars}
            return render_chat(self._template(), messages, add_generation_prompt, variables)
        prompt = self.render_chat(
            messages,
            add_generation_prompt,
            parse_special_in_content=parse_special_in_content,
            **template_vars,
        )
        return self.encode_chat(prompt)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, JsonValue]],
        add_generation_prompt: bool = True,
        *,
        parse_special_in_content: bool = False,
        **template_vars: JsonValue,
    ) -> ChatPrompt:
        """The rendered prompt with the special tokens the template itself wrote (see :class:`ChatPrompt`).

        Raises :class:`TokenizerError` as :meth:`apply_chat_template` does, and when a message holding a
        special-token string is rewritten by the template (its text cannot then be told from markup).
        """
        variables = {**self.special_tokens, **template_vars}
        template = self._template()
        if parse_special_in_content or self._specials is None:
            return ChatPrompt(render_chat(template, messages, add_generation_prompt, variables))
        specials = self._specials
        rendered = render_chat_spans(
            template,
            messages,
            add_generation_prompt,
            variables,
            specials.search,
            _CLIENT_VARIABLES,
        )
        if not rendered.client_spans:
            return ChatPrompt(rendered.text)
        return ChatPrompt(rendered.text, self._markup(rendered))

    def encode_chat(self, prompt: ChatPrompt, start: int = 0) -> list[int]:
        """Ids of ``prompt.text[start:]``: the template's markup tokens as special tokens, everything else
        (the client's text with it) as text. ``start`` lets a chat session encode only what is new."""
        if prompt.markup is None:
            return self.encode(prompt.text[start:])
        ids: list[int] = []
        position = start
        for begin, end, token in prompt.markup:
            if begin < position:
                continue  # before ``start`` (or cut by it: then its text is part of what came before)
            if begin > position:
                ids += self.encode(prompt.text[position:begin], parse_special=False)
            ids.append(token)
            position = end
        if position < len(prompt.text):
            ids += self.encode(prompt.text[position:], parse_special=False)
        return ids

    def _template(self) -> str:
        if self.chat_template is None:
            raise TokenizerError(f"{self.directory}: the model has no chat template")
        return self.chat_template

    def _markup(self, rendered: RenderedChat) -> tuple[tuple[int, int, int], ...]:
        """The special tokens written outside the client's spans: the template's own markup."""
        assert self._specials is not None
        markup: list[tuple[int, int, int]] = []
        gaps = [0]
        for begin, end in rendered.client_spans:
            gaps += [begin, end]
        gaps.append(len(rendered.text))
        for begin, end in zip(gaps[::2], gaps[1::2], strict=True):
            markup += self._specials.find(rendered.text, begin, end)
        return tuple(markup)

    def _eos_ids(self, config_eos: Sequence[int]) -> tuple[int, ...]:
        """Config EOS ids, the tokenizer's ``eos_token`` and end-of-turn tokens the chat template emits."""
        ids = [int(i) for i in config_eos]
        candidates = [self.special_tokens.get("eos_token")]
        template = self.chat_template or ""
        candidates += [token for token in END_OF_TURN_TOKENS if token in template]
        ids += [i for i in (self.token_to_id(t) for t in candidates) if i is not None]
        return tuple(dict.fromkeys(ids))


def eos_token_ids(config: ModelConfig, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """Ids that end a turn of a model with ``config``: the tokenizer's (the config's EOS, its
    ``eos_token`` and the chat template's end-of-turn tokens), or the config's EOS alone where the
    checkpoint has no tokenizer files (``None``). Ids outside the vocabulary are dropped. The loaded model
    and the ingress's card both take their EOS ids from here, so the two never disagree."""
    ids = config.eos_token_ids if tokenizer is None else tokenizer.eos_token_ids
    return tuple(i for i in ids if 0 <= i < config.vocab_size)


class IncrementalDetokenizer:
    """Streams the text of generated ids as deltas whose concatenation equals the full decode.

    ``context_ids`` (e.g. the last few prompt ids) are decoded for context only, never emitted, so the first
    generated token gets the spacing it has in the full text. Mutates only itself. Raises
    :class:`TokenizerError` for an id outside the vocabulary, as :meth:`Tokenizer.decode` does.
    """

    def __init__(
        self, tokenizer: TextTokenizer, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()
    ):
        # Every tokenizer with ``decode(ids, skip_special_tokens)`` works (the synthetic model's too); ours
        # exposes ``decode_raw`` so already streamed text is never rewritten by the space clean-up.
        self._decode = getattr(tokenizer, "decode_raw", tokenizer.decode)
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in context_ids]
        self._prefix = 0  # start of the decode window
        self._read = len(self._ids)  # ids before this index are already emitted (or context)
        self._stream: _Stream | None = None
        # DecodeStream would emit a context that ends in an incomplete character: the window reads it.
        cut_context = self._decode(self._ids, self._skip).endswith(_REPLACEMENT)
        if isinstance(tokenizer, Tokenizer) and not cut_context:
            self._stream = _Stream(tokenizer, skip_special_tokens, self._ids)

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Append ids; return the new complete text (empty while a character is still incomplete)."""
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        if self._stream is None:
            self._ids.extend(ids)
            return self._advance(final=False)
        self._stream.check(ids)
        deltas = []
        for position, token in enumerate(ids):  # one at a time: a list streams as its ids one by one would
            self._ids.append(token)
            try:
                delta = self._stream.step(token)
            except Exception:  # a decoder whose text is not prefix-stable: the window algorithm goes on
                self._stream = None
                self._ids.extend(ids[position + 1 :])
                return "".join(deltas) + self._advance(final=False)
            if delta is not None:
                deltas.append(delta)
                self._prefix, self._read = self._read, len(self._ids)
        return "".join(deltas)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes to U+FFFD)."""
        text = self._advance(final=True)
        if text:
            self._stream = None  # the stream still holds what was just emitted: the window reads on
        return text

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


class _Stream:
    """``tokenizers``' ``DecodeStream`` over a :class:`Tokenizer`'s backend: the window algorithm in Rust."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool, context_ids: Sequence[int]):
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer._backend
        self._vocab_size = tokenizer.vocab_size
        self._stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)

    def check(self, ids: Sequence[int]) -> None:
        """Refuse an id outside the vocabulary before any is taken (the stream would skip it silently)."""
        bad = next((i for i in ids if not 0 <= i < self._vocab_size), None)
        if bad is not None:
            raise TokenizerError(f"token id {bad} is outside the vocabulary [0, {self._vocab_size})")

    def step(self, token: int) -> str | None:
        return self._stream.step(self._backend, token)


def _tokenizer_source(model: object) -> tuple[Path, tuple[int, ...]]:
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


def _read_config(path: Path) -> dict[str, JsonValue]:
    try:
        return read_json(path)
    except ModelLoadError as exc:
        raise TokenizerError(str(exc)) from exc


def _special_token_pattern(backend: Backend) -> _SpecialTokens | None:
    """The tokenizer's special tokens as it matches them in text; None when it has none."""
    tokens = [(i, t) for i, t in backend.get_added_tokens_decoder().items() if t.special and t.content]
    if not tokens:
        return None
    tokens.sort(key=lambda pair: len(pair[1].content), reverse=True)  # longest first, as the tokenizer
    parts = []
    for _, token in tokens:
        left = r"\s*" if token.lstrip else ""
        right = r"\s*" if token.rstrip else ""
        parts.append(f"{left}({re.escape(token.content)}){right}")
    return _SpecialTokens(
        re.compile("|".join(parts)), tuple(i for i, _ in tokens), tuple(t.content for _, t in tokens)
    )


def _max_token_chars(backend: Backend) -> int | None:
    """An upper bound on the characters of input one token can stand for; None when there is none.

    A token's vocabulary string is at least as long as the text it encodes for byte-level BPE (one symbol per
    byte) and SentencePiece-style BPE (``▁`` for a space, ``<0x41>`` for a byte). A normalizer that composes
    characters (NFC) can merge a few into one, hence a factor; one that may delete text, an unknown token
    that swallows a whole unknown run, or another model type (WordPiece maps a long word to one ``[UNK]``)
    leaves no bound.
    """
    config = json.loads(backend.to_str())
    model = config.get("model") or {}
    if model.get("type") != "BPE":
        return None
    if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None
    factor = _normalizer_factor(config.get("normalizer"))
    if factor is None:
        return None
    longest = max((len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1)
    return max(longest, 1) * factor


def _normalizer_factor(normalizer: JsonValue) -> int | None:
    """How many input characters one normalized character can stand for; None when unbounded."""
    if normalizer is None:
        return 1
    children = normalizer.get("normalizers") or () if normalizer.get("type") == "Sequence" else (normalizer,)
    for child in children:
        if child.get("type") not in _KEEPING_NORMALIZERS:
            return None
        if child.get("type") == "Replace" and not child.get("content"):
            return None  # a Replace with "" deletes what it matches
    return _NORMALIZED_CHAR_FACTOR


def _load_backend(path: Path) -> Backend:
    from tokenizers import Tokenizer as Backend

    if not path.is_file():
        raise TokenizerError(f"{path}: tokenizer file not found")
    try:
        return Backend.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise TokenizerError(f"{path}: invalid tokenizer file ({exc})") from exc


def _chat_template(directory: Path, config: Mapping[str, JsonValue]) -> str | None:
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


def _special_tokens(config: Mapping[str, JsonValue]) -> dict[str, str]:
    tokens = {}
    for name in _SPECIAL_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):  # serialised AddedToken
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens
