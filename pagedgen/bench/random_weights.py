"""Random-weight checkpoints from a config alone: ``pagedgen bench throughput --random-weights CONFIG_DIR``.

Why: a lent GPU machine can download nothing and receives at most a small tree, so a model's weights cannot
travel with it; its ``config.json`` (a few kB) can. Throughput depends on the shapes, not on the values, and
the greedy-match oracle against transformers only needs both systems to run the *same* weights. So this
module builds a transformers model from the config with a seeded random init, writes it as an ordinary
safetensors checkpoint (fp32), and both pagedgen and the transformers baselines load that directory.

Without tokenizer files in ``CONFIG_DIR`` the prompts are made by :class:`ByteTokenizer` (the bench text's
UTF-8 bytes as token ids): random weights make every text equally meaningless, so any fixed ids will do.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedgen.models.model import Model
    from pagedgen.models.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
BYTE_OFFSET = 3  # keep ids clear of the usual specials 0..2 (bos / eos / pad in most configs)


def random_checkpoint(config_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """Write a checkpoint of ``config_dir/config.json`` with seeded random weights into ``out_dir``.

    The weights are transformers' own initialisation of ``AutoModelForCausalLM.from_config`` after
    ``torch.manual_seed(seed)``, so the same config and seed give the same weights on any machine. Tokenizer
    files found in ``config_dir`` are copied. Returns ``out_dir``. Raises ``ValueError`` when there is no
    ``config.json``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config_path = Path(config_dir) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"--random-weights {config_dir}: no config.json there")
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(config_dir) / name).is_file():
            shutil.copy(Path(config_dir) / name, out_dir / name)
    meta = {"random_weights": {"config_dir": str(config_dir), "seed": seed}}
    (out_dir / "pagedgen_random_weights.json").write_text(json.dumps(meta) + "\n")
    return out_dir


def has_tokenizer(checkpoint_dir: Path) -> bool:
    return (Path(checkpoint_dir) / "tokenizer.json").is_file() or (
        Path(checkpoint_dir) / "tokenizer.model"
    ).is_file()


class ByteTokenizer:
    """Text -> its UTF-8 bytes shifted past the special ids (``byte + 3``), for checkpoints without a
    tokenizer. Only what the bench's workloads call: ``encode`` and ``decode``."""

    def __init__(self, vocab_size: int):
        if vocab_size < 256 + BYTE_OFFSET:
            raise ValueError(f"ByteTokenizer needs a vocab of at least {256 + BYTE_OFFSET}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(t - BYTE_OFFSET for t in token_ids if BYTE_OFFSET <= t < 256 + BYTE_OFFSET)
        return data.decode("utf-8", errors="replace")


def bench_tokenizer(model: Model, checkpoint_dir: Path) -> Tokenizer | ByteTokenizer:
    """The model's tokenizer when the checkpoint has one, else a :class:`ByteTokenizer`."""
    if has_tokenizer(checkpoint_dir):
        from pagedgen.models.tokenizer import Tokenizer

        return Tokenizer(model)
    return ByteTokenizer(int(model.vocab_size))
