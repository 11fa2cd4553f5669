"""The default model's tokenizer (from GGUF metadata) against transformers' tokenizer for the same file."""

from __future__ import annotations

import pytest

from pagedgen.models.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.model

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "<|im_start|>user\nhi<|im_end|>",
    "naïve café — 你好，世界 😀🎉 Ünïcödé",
    "def f(x):\n    return x ** 2  # comment",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 猫."},
    ],
]


def test_encode_decode_match_transformers(default_model, hf_default_tokenizer):
    tok = default_model.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_default_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf_default_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(default_model, hf_default_tokenizer, add_generation_prompt):
    for messages in CONVERSATIONS:
        ours = default_model.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt
        )
        theirs = hf_default_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs
    ids = default_model.tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=True)
    assert ids == default_model.tokenizer.encode(
        default_model.tokenizer.apply_chat_template(CONVERSATIONS[0])
    )


def test_special_ids(default_model):
    tok = default_model.tokenizer
    assert (tok.vocab_size, tok.bos_token_id) == (49152, tok.token_to_id("<|im_start|>"))
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"),) == default_model.eos_token_ids
    assert Tokenizer("default").encode(TEXTS[3]) == tok.encode(TEXTS[3])


def test_incremental_detokenizer_on_multibyte_text(default_model):
    tok = default_model.tokenizer
    text = "Emoji 😀🎉 and CJK 你好世界, then ünïcödé and 🚀!"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # a character spanning tokens was held back, not split
    assert sum(1 for d in deltas if d) > len(ids) // 2  # and the text streamed, not all at the end
