"""Which weights a model keeps in their stored format (``pg.Model(..., weights="native")``), and reading them.

``"native"`` keeps every 2-D weight whose format has a kernel (GGUF Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, F16, BF16
blocks; f16/bf16 safetensors) as a :class:`~pagedgen.ops.qweight.QuantizedWeight`; other tensors (norms,
biases, formats without a kernel such as Q5_K) become float32 as before. ``"float32"`` dequantises
everything at load (the behaviour before native weights, and the only one without the native kernels).

For a GGUF file the blocks are copied once into its cache entry (:mod:`pagedgen.models.gguf_cache`) as
``native.safetensors``, beside the dequantised ``model.safetensors``: a warm load reads them without
parsing the GGUF file (seconds, for its vocabulary) and reads from the float32 file only the rest.
"""

from __future__ import annotations

import enum
import json
import logging
from pathlib import Path

import numpy as np
import torch

from pagedgen.errors import ModelLoadError
from pagedgen.models.config import ModelConfig
from pagedgen.models.gguf_reader import GGUFFile, WeightPlan, unpermute_qk
from pagedgen.models.safetensors_stream import TensorSpec, write_safetensors
from pagedgen.ops.qweight import NATIVE_GGUF_TYPES, QuantizedWeight

log = logging.getLogger(__name__)

WeightValue = torch.Tensor | QuantizedWeight
NATIVE_FILE = "native.safetensors"
WEIGHTS_FILE = "model.safetensors"
QTYPES_KEY = "pagedgen_qtypes"  # metadata: JSON {name: GGUF type name}


class WeightFormat(enum.Enum):
    NATIVE = "native"  # kept as stored where a kernel exists
    FLOAT32 = "float32"  # dequantised at load to the model's dtype (float32 on CPU)


def resolve_weight_format(
    weights: str | WeightFormat, device: torch.device, dtype: torch.dtype
) -> tuple[WeightFormat, str]:
    """The format to load with and why: native needs fp32 activations on the CPU and the native kernels.

    Raises :class:`ModelLoadError` naming the argument for anything but ``"native"`` or ``"float32"``.
    """
    if isinstance(weights, str) and weights.lower() in {f.value for f in WeightFormat}:
        weights = WeightFormat(weights.lower())
    if not isinstance(weights, WeightFormat):
        raise ModelLoadError(f"weights={weights!r} is not supported (use 'native' or 'float32')")
    if weights is WeightFormat.FLOAT32:
        return weights, "requested"
    if device.type != "cpu" or dtype is not torch.float32:
        return WeightFormat.FLOAT32, f"native weights run on CPU float32 only, not {device.type} {dtype}"
    from pagedgen.ops.native import native_status
    from pagedgen.ops.quant_gemm import quant_kernels

    if quant_kernels() is None:
        reason = f"native weights need the native kernels, which are off: {native_status().detail}"
        log.warning("pagedgen loads float32 weights: %s", reason)
        return WeightFormat.FLOAT32, reason
    return WeightFormat.NATIVE, "native kernels available"


def native_blocks(file: GGUFFile, plan: WeightPlan, config: ModelConfig) -> np.ndarray | None:
    """A 2-D tensor of a native type as ``[out, row_bytes]`` uint8 blocks in HF row order, else ``None``.

    llama.cpp's Q/K row permutation is undone on whole rows (each output row is whole blocks).
    """
    qtype = NATIVE_GGUF_TYPES.get(plan.ggml_type)
    if qtype is None or len(plan.shape) != 2 or plan.shape[1] % qtype.block_elems:
        return None
    blocks = np.asarray(file.reader.tensors[plan.index].data).view(np.uint8)
    blocks = blocks.reshape(plan.shape[0], qtype.row_bytes(plan.shape[1]))  # [out, row_bytes]
    if file.architecture == "llama" and plan.name.endswith(("q_proj.weight", "k_proj.weight")):
        blocks = unpermute_qk(blocks, config.num_heads if ".q_proj." in plan.name else config.num_kv_heads)
    return np.ascontiguousarray(blocks)


def write_native_file(directory: Path, file: GGUFFile, plans: list[WeightPlan], config: ModelConfig) -> None:
    """Write ``NATIVE_FILE``: the blocks of every native-type 2-D tensor, their qtypes in the metadata."""
    blocks = {plan.name: native_blocks(file, plan, config) for plan in plans}
    blocks = {name: b for name, b in blocks.items() if b is not None}
    qtypes = {plan.name: plan.ggml_type for plan in plans if plan.name in blocks}
    specs = [TensorSpec(name, "U8", b.shape) for name, b in blocks.items()]
    tensors = ((name, torch.from_numpy(b.copy())) for name, b in blocks.items())  # b: a read-only map
    write_safetensors(directory / NATIVE_FILE, specs, tensors, {QTYPES_KEY: json.dumps(qtypes)})


def read_native_entry(directory: Path) -> dict[str, WeightValue]:
    """A GGUF cache entry's tensors: native blocks from ``NATIVE_FILE``, the rest float32 from the weights.

    Only the float32 tensors not held as blocks are read from ``model.safetensors`` (norms: kilobytes).
    Raises :class:`ModelLoadError` naming the file when either is missing or damaged.
    """
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, WeightValue] = {}
    path = directory / NATIVE_FILE
    try:
        with safe_open(path, "pt") as f:
            qtypes = json.loads((f.metadata() or {})[QTYPES_KEY])
            for name, qtype in qtypes.items():
                data = f.get_tensor(name)
                tensors[name] = QuantizedWeight(NATIVE_GGUF_TYPES[qtype], _shape(data, qtype), data)
        path = directory / WEIGHTS_FILE
        with safe_open(path, "pt") as f:
            names = f.keys()
            for name in names:
                if name not in tensors:
                    tensors[name] = f.get_tensor(name)
    except (SafetensorError, OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"{path}: missing, truncated or corrupt cache file ({exc})") from exc
    return tensors


def _shape(data: torch.Tensor, qtype: str) -> tuple[int, int]:
    q = NATIVE_GGUF_TYPES[qtype]
    return data.shape[0], data.shape[1] // q.block_bytes * q.block_elems


def keep_half_weights(tensors: dict[str, torch.Tensor]) -> dict[str, WeightValue]:
    """HF tensors with each 2-D f16/bf16 weight kept as stored; the rest unchanged (cast at assignment)."""
    return {
        name: QuantizedWeight.from_half(t)
        if t.dim() == 2 and t.dtype in (torch.float16, torch.bfloat16) and t.device.type == "cpu"
        else t
        for name, t in tensors.items()
    }
