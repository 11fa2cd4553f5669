"""``pagedgen.Model``: a loaded decoder, its KV geometry and its tokenizer.

``Model("default")`` is the embedded SmolLM2-135M-Instruct; ``Model(dir)`` an HF checkpoint directory
(safetensors, single or sharded); ``Model(path.gguf)`` a llama.cpp file. ``weights="native"`` (the
default where the native kernels exist) keeps quantised and 16-bit weights as stored
(:mod:`pagedgen.models.native_weights`); ``weights="float32"`` dequantises them at load (a GGUF file once,
into the weight cache). The engine runs ``model.runtime`` (a :class:`pagedgen.models.base.CausalLM`) once
per step with a :class:`pagedgen.core.kv.PagedKVCache` built from ``model.kv_spec``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property
from pathlib import Path

import torch
from torch import nn

from pagedgen.core.kv import KVSpec
from pagedgen.core.state_manifest import StateManifest
from pagedgen.errors import ModelLoadError, TokenizerError
from pagedgen.models.bamba import BambaForCausalLM
from pagedgen.models.checkpoint import Checkpoint, CheckpointKind, resolve_checkpoint
from pagedgen.models.checkpoint_manifest import read_config
from pagedgen.models.config import ModelConfig
from pagedgen.models.gemma import GemmaForCausalLM
from pagedgen.models.hf_loader import read_hf_weights
from pagedgen.models.lfm2 import Lfm2ForCausalLM
from pagedgen.models.llama import LlamaForCausalLM
from pagedgen.models.native_weights import (
    WeightFormat,
    keep_half_weights,
    read_native_entry,
    resolve_weight_format,
)
from pagedgen.models.tokenizer import Tokenizer, eos_token_ids
from pagedgen.models.weights import load_weights
from pagedgen.ops.matmul.qweight import Q8_ACTIVATION_TYPES, QuantizedWeight

# Family key (ModelConfig.architecture) -> runtime class. The Llama families share one implementation, and
# Gemma 2 and 3 another.
RUNTIMES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "lfm2": Lfm2ForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "bamba": BambaForCausalLM,
    "granitemoehybrid": BambaForCausalLM,  # its dense-MLP variant: the same mixers under Granite's names
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


ACTIVATIONS = ("fp32", "q8")


def resolve_activations(activations: str, weights_format: WeightFormat, weights_reason: str) -> str:
    """``"fp32"`` (exact, the default) or ``"q8"``: llama.cpp-style 8-bit activations with integer dot
    products for the weights whose format has such a kernel (approximate; docs/performance.md). ``"q8"``
    needs native weights; anything else is a :class:`ModelLoadError` naming the problem."""
    if activations not in ACTIVATIONS:
        raise ModelLoadError(f"activations={activations!r} is not one of {list(ACTIVATIONS)}")
    if activations == "q8" and weights_format is not WeightFormat.NATIVE:
        raise ModelLoadError(
            f"activations='q8' needs native quantised weights, but this model loads weights="
            f"{weights_format.value!r} ({weights_reason}): no 8-bit-activation kernel runs on those"
        )
    return activations


def with_q8_activations(weights: dict, source: str) -> dict:
    """``weights`` with every quantised weight of a format in ``Q8_ACTIVATION_TYPES`` flagged for 8-bit
    activations; the others (Q2_K, Q3_K, f16/bf16) stay exact. Raises :class:`ModelLoadError` if none is."""
    flagged = {
        name: replace(w, q8_activations=True)
        if isinstance(w, QuantizedWeight) and w.qtype in Q8_ACTIVATION_TYPES
        else w
        for name, w in weights.items()
    }
    if not any(isinstance(w, QuantizedWeight) and w.q8_activations for w in flagged.values()):
        formats = sorted({w.qtype.name for w in weights.values() if isinstance(w, QuantizedWeight)})
        kernels = sorted(q.name for q in Q8_ACTIVATION_TYPES)
        raise ModelLoadError(
            f"activations='q8': {source} has no weight in a format with an 8-bit-activation kernel "
            f"(its formats: {formats or ['float']}; kernels exist for {kernels})"
        )
    return flagged


class Model:
    """A loaded model: ``runtime`` runs packed steps, ``tokenizer`` encodes and decodes.

    Raises :class:`ModelLoadError` (or :class:`UnsupportedArchitectureError`) naming the file and the
    problem: a missing path, an unknown architecture, an unsupported quant type, a truncated file, missing
    tensors, an embedding that does not match the vocab size, a ``weights`` other than ``"native"`` or
    ``"float32"``, or ``activations="q8"`` (see :func:`resolve_activations`) where no weight has its kernel.
    ``weights_format`` is the format actually loaded, ``weights_reason`` why (native falls
    back to float32, logged, without the native kernels or off the CPU float32 path). ``state_manifest``
    says which decoder state each layer owns (:mod:`pagedgen.models.checkpoint_manifest`); the engine picks
    its cache paths from it.
    """

    def __init__(
        self,
        name_or_path: str | Path = "default",
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        weights: str = "native",
        activations: str = "fp32",
    ):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.weights_format, self.weights_reason = resolve_weight_format(weights, self.device, self.dtype)
        self.activations = resolve_activations(activations, self.weights_format, self.weights_reason)
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

    def _load(self, checkpoint: Checkpoint) -> tuple[ModelConfig, nn.Module]:
        config, manifest = read_config(checkpoint.directory, checkpoint.source)
        self.state_manifest: StateManifest = manifest
        if self.weights_format is WeightFormat.FLOAT32:
            weights = read_hf_weights(checkpoint.directory, self.device)
        elif checkpoint.kind is CheckpointKind.GGUF:
            weights = read_native_entry(checkpoint.directory)
        else:
            weights = keep_half_weights(read_hf_weights(checkpoint.directory, self.device))
        if self.activations == "q8":
            weights = with_q8_activations(weights, str(checkpoint.source))
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
    def fixed_state_specs(self) -> tuple:
        """The runtime's fixed conv / recurrent state tensors (empty for pure attention models)."""
        return tuple(self.runtime.fixed_state_specs)

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
            tokenizer: Tokenizer | None = self.tokenizer
        except TokenizerError:
            tokenizer = None
        return eos_token_ids(self.config, tokenizer)

    def __repr__(self) -> str:
        return (
            f"Model({self.name!r}, {self.config.architecture}, dtype={self.dtype}, device={self.device}, "
            f"weights={self.weights_format.value!r}, activations={self.activations!r})"
        )
