"""A synthetic model whose tokens decode to several characters (or to partial UTF-8), for stop-text tests.

The synthetic tokenizer maps each token to one character, so a stop string can never begin inside a token.
Here tokens below 95 are still one printable character (prompts are typed with them), every higher token
decodes to two characters, and ``pieces`` overrides chosen tokens with any bytes (e.g. half of a UTF-8
character). The greedy continuation is the synthetic model's closed formula, so the text is known exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagedgen.models.synthetic import SyntheticModel, synthetic_greedy

VOCAB = 257
_ASCII = 95


class PiecesTokenizer:
    """Token t < 95 is ``chr(32 + t)``; a higher one two letters, unless ``pieces`` gives its bytes."""

    eos_token_ids: tuple[int, ...] = ()

    def __init__(self, vocab_size: int = VOCAB, pieces: Mapping[int, bytes] | None = None):
        self.vocab_size = vocab_size
        self._pieces = dict(pieces or {})

    def piece(self, token: int) -> bytes:
        if token in self._pieces:
            return self._pieces[token]
        if token < _ASCII:
            return chr(32 + token).encode()
        k = token - _ASCII
        return (chr(97 + k % 26) + chr(65 + k // 26 % 26)).encode()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """One token per printable ASCII character (the only text the tests encode)."""
        if not all(32 <= ord(ch) < 32 + _ASCII for ch in text):
            raise ValueError(f"PiecesTokenizer encodes printable ASCII only, got {text!r}")
        return [ord(ch) - 32 for ch in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.piece(int(t)) for t in token_ids).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class PiecesModel(SyntheticModel):
    """The synthetic model with a :class:`PiecesTokenizer` (which the engine's stop matcher uses too)."""

    vocab_size: int = VOCAB
    pieces: dict[int, bytes] = field(default_factory=dict)

    @property
    def tokenizer(self) -> PiecesTokenizer:  # type: ignore[override]
        return PiecesTokenizer(self.vocab_size, self.pieces)

    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        return synthetic_greedy(prompt, max_new_tokens, self.vocab_size)


def straddling_stop(tokenizer: PiecesTokenizer, tokens: Sequence[int]) -> tuple[str, str]:
    """A stop string that first occurs starting inside a multi-character token of ``tokens`` (after its
    first character) and ends in the next token, and the text before it: ``(stop, text cut at stop)``."""
    texts = [tokenizer.decode([t]) for t in tokens]
    text = "".join(texts)
    offset = 0
    for here, after in zip(texts, texts[1:], strict=False):
        stop = here[1:] + after[:1]
        if len(here) > 1 and text.find(stop) == offset + 1:
            return stop, text[: offset + 1]
        offset += len(here)
    raise AssertionError(f"no token of {texts} can hold the start of a stop string")
