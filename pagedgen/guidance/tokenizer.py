"""The llguidance view of a model's tokenizer, built once per model and shared by every grammar on it.

llguidance masks over token bytes, so it needs the whole vocabulary; building that view costs ~0.2 s, so it
is cached per model object. Slices, the vocabulary width and EOS: docs/engine.md, "The llguidance tokenizer
view".
"""

from __future__ import annotations

import threading
import weakref

import llguidance

from pagedgen.core.decoder import DecoderModel, TextTokenizer
from pagedgen.errors import GuidanceError, TokenizerError

_lock = threading.Lock()
_by_model: dict[int, tuple[weakref.ref[DecoderModel], dict[bool, llguidance.LLTokenizer]]] = {}


def guidance_tokenizer(model: DecoderModel, json: bool = False) -> llguidance.LLTokenizer:
    """The cached llguidance tokenizer of ``model`` (``json``: with JSON slices); :class:`GuidanceError` if
    the model has no tokenizer llguidance can read."""
    key = id(model)
    with _lock:
        entry = _by_model.get(key)
        if entry is not None and entry[0]() is model:
            return entry[1][json]
    general = _build(model)
    views = {False: general, True: general.with_slices(llguidance.LLTokenizer.json_slices())}
    with _lock:
        _by_model[key] = (weakref.ref(model, lambda _ref, key=key: _by_model.pop(key, None)), views)
    return views[json]


def _build(model: DecoderModel) -> llguidance.LLTokenizer:
    n_vocab = int(model.vocab_size)
    eos = [int(e) for e in model.eos_token_ids] or None
    try:
        tokenizer = model.tokenizer
        if hasattr(tokenizer, "to_json"):
            source = tokenizer.to_json()
        else:
            source = llguidance.TokenizerWrapper(_ByteVocab(tokenizer, n_vocab, eos))
        return llguidance.LLTokenizer(source, n_vocab=n_vocab, eos_token=eos)
    except (TokenizerError, ValueError, TypeError) as exc:
        raise GuidanceError(
            f"guidance needs the model's tokenizer, which llguidance cannot read: {exc}"
        ) from exc


class _ByteVocab:
    """A vocabulary as llguidance's ``TokenizerWrapper`` reads it: ``tokens[t]`` is token t's bytes.

    For tokenizers without a ``tokenizer.json`` (the synthetic model's): each token's text is its
    ``decode([t])``; EOS ids are special tokens (never text), so a grammar cannot spell them.
    """

    def __init__(self, tokenizer: TextTokenizer, n_vocab: int, eos: list[int] | None):
        self._tokenizer = tokenizer
        special = sorted(set(eos or ()))
        self.tokens = [
            f"<|eos_{t}|>".encode() if t in special else tokenizer.decode([t], False).encode("utf-8")
            for t in range(n_vocab)
        ]
        self.special_token_ids = special
        self.eos_token_id = special[0] if special else None
        self.bos_token_id = None

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text))
