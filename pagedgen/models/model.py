"""``pagedgen.Model``: a loaded decoder, its KV geometry and its tokenizer.

``Model("default")`` is the embedded SmolLM2-135M-Instruct; ``Model(dir)`` an HF checkpoint directory
(safetensors, single or sharded); ``Model(path.gguf)`` a llama.cpp file, dequantised once into the weight
cache. The engine runs ``model.runtime`` (a :class:`pagedgen.models.base.CausalLM`) once per step with a
:class:`pagedgen.core.kv.PagedKVCache` built from ``model.kv_spec``.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch

from pagedgen.core.kv import KVSpec
from pagedgen.errors import ModelLoadError, TokenizerError
from pagedgen.models.checkpoint import Checkpoint, CheckpointKind, resolve_checkpoint
from pagedgen.models.config import ModelConfig
from pagedgen.models.hf_loader import read_hf_config, read_hf_weights
from pagedgen.models.llama import LlamaForCausalLM
from pagedgen.models.tokenizer import Tokenizer
from pagedgen.models.weights import load_weights

# Family key (ModelConfig.architecture) -> runtime class. All current families share one implementation.
RUNTIMES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``None`` picks CUDA when present, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``None`` is float32 on CPU and bfloat16 on CUDA; names like ``"bf16"`` are accepted."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPE_NAMES:
            raise ModelLoadError(f"dtype {dtype!r} is not supported (use one of {sorted(_DTYPE_NAMES)})")
        return _DTYPE_NAMES[dtype.lower()]
    if dtype not in _DTYPE_NAMES.values():
        raise ModelLoadError(f"dtype {dtype} is not supported (float32, float16 or bfloat16)")
    return dtype


class Model:
    """A loaded model: ``runtime`` runs packed steps, ``tokenizer`` encodes and decodes.

    Raises :class:`ModelLoadError` (or :class:`UnsupportedArchitectureError`) naming the file and the
    problem: a missing path, an unknown architecture, an unsupported quant type, a truncated file, missing
    tensors, or an embedding that does not match the vocab size.
    """

    def __init__(
        self,
        name_or_path: str | Path = "default",
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
    ):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        checkpoint = resolve_checkpoint(name_or_path)
        try:
            self.config, self.runtime = self._load(checkpoint)
        except ModelLoadError:
            if checkpoint.kind is not CheckpointKind.GGUF or checkpoint.built:
                raise
            # An earlier cache entry that fails to load (damaged on disk) is rebuilt once from the GGUF file.
            checkpoint = resolve_checkpoint(name_or_path, rebuild_cache=True)
            self.config, self.runtime = self._load(checkpoint)
        self.checkpoint = checkpoint
        self.name = checkpoint.name

    def _load(self, checkpoint: Checkpoint) -> tuple[ModelConfig, LlamaForCausalLM]:
        config = read_hf_config(checkpoint.directory)
        weights = read_hf_weights(checkpoint.directory, self.device)
        runtime = RUNTIMES[config.architecture](config, self.dtype, self.device)
        load_weights(runtime, weights, str(checkpoint.source), self.device)
        runtime.fuse_projections()
        return config, runtime.eval()

    @property
    def checkpoint_dir(self) -> Path:
        """The HF-style directory the weights and tokenizer files were read from (a GGUF's cache entry)."""
        return self.checkpoint.directory

    @property
    def kv_spec(self) -> KVSpec:
        return self.runtime.kv_spec

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.config.max_context

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self)

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a turn: the config's EOS plus the chat template's end-of-turn token.

        A checkpoint without tokenizer files still has the config's EOS ids.
        """
        try:
            ids = self.tokenizer.eos_token_ids
        except TokenizerError:
            ids = self.config.eos_token_ids
        return tuple(i for i in ids if 0 <= i < self.vocab_size)

    def __repr__(self) -> str:
        return f"Model({self.name!r}, {self.config.architecture}, dtype={self.dtype}, device={self.device})"
