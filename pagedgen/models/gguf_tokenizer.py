"""Turn the tokenizer a GGUF file describes into ``tokenizer.json`` + ``tokenizer_config.json``.

A GGUF carries its vocabulary, merges, token types, special ids and chat template as ``tokenizer.*``
metadata. transformers already knows how to build the matching fast tokenizer from those (its GGUF
converter); we feed it the metadata we read ourselves and save the result in the HF file format, so the
runtime :class:`pagedgen.models.tokenizer.Tokenizer` reads one format only and the conversion (seconds)
happens once per file.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from pagedgen.core.json_value import JsonValue
from pagedgen.errors import TokenizerError
from pagedgen.models.gguf_reader import GGUFFile

if TYPE_CHECKING:
    from tokenizers.processors import PostProcessor

_ARRAY_KEYS = ("tokens", "scores", "token_type", "merges")
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _converter() -> tuple[dict[str, JsonValue], Callable[..., tuple[dict[str, JsonValue], JsonValue]]]:
    """transformers' GGUF tokenizer mapping and converter (moved between transformers 4.x and 5.x)."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    return GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer


def gguf_tokenizer_files(file: GGUFFile) -> tuple[str, dict[str, JsonValue]] | None:
    """``(tokenizer.json text, tokenizer_config dict)``, or None for a file without a vocabulary.

    Raises :class:`TokenizerError` if the file has a vocabulary the converter cannot build.
    """
    from tokenizers import processors

    mapping, convert = _converter()
    tokenizer_dict: dict[str, JsonValue] = {}
    for key, name in mapping["tokenizer"].items():
        full = f"tokenizer.{key}"
        if name in _ARRAY_KEYS:
            value = file.array(full)
            if value is not None:
                tokenizer_dict[name] = value
        elif full in file.metadata:
            tokenizer_dict[name] = file.metadata[full]
    tokens = tokenizer_dict.get("tokens")
    if not tokens:
        return None
    try:
        backend, _ = convert(file.architecture, tokenizer_dict)
    except Exception as exc:  # the converter raises ValueError/KeyError/... for files it cannot read
        raise TokenizerError(f"{file.path}: cannot build the tokenizer from GGUF metadata ({exc})") from exc
    config = _tokenizer_config(file, tokens)
    backend.post_processor = _post_processor(processors, config, tokens)
    return backend.to_str(), config


def _tokenizer_config(file: GGUFFile, tokens: list[str]) -> dict[str, JsonValue]:
    meta = file.metadata
    config: dict[str, JsonValue] = {
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
        "add_bos_token": bool(
            meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
        ),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    for name, key in _SPECIAL_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    return config


def _post_processor(processors: ModuleType, config: dict[str, JsonValue], tokens: list[str]) -> PostProcessor:
    """BOS/EOS insertion exactly as the file's ``add_bos_token``/``add_eos_token`` flags say."""
    specials = []
    single, pair = ["$A:0"], ["$A:0", "$B:1"]
    if config["add_bos_token"] and "bos_token" in config:
        specials.append(config["bos_token"])
        single, pair = [f"{config['bos_token']}:0", *single], [f"{config['bos_token']}:0", *pair]
    if config["add_eos_token"] and "eos_token" in config:
        specials.append(config["eos_token"])
        single, pair = [*single, f"{config['eos_token']}:0"], [*pair, f"{config['eos_token']}:1"]
    ids = {token: index for index, token in enumerate(tokens) if token in specials}
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(token, ids[token]) for token in dict.fromkeys(specials)]
    )
