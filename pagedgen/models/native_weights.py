"""Which weights a model keeps in their stored format (``pg.Model(..., weights="native")``), and reading them.

Weights whose format has a kernel stay as stored (expanded exactly inside the kernels) and are mapped from
the cache entry rather than copied; everything else becomes float32. The formats and the mapping:
docs/models.md, "Native weights".
"""

from __future__ import annotations

import enum
import json
import logging
import struct
from pathlib import Path

import numpy as np
import torch

from pagedgen.errors import ModelLoadError
from pagedgen.models.config import ModelConfig
from pagedgen.models.gguf_reader import GGUFFile, WeightPlan, unpermute_qk
from pagedgen.models.safetensors_stream import TensorSpec, write_safetensors
from pagedgen.ops.matmul.qweight import NATIVE_GGUF_TYPES, QuantizedWeight

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
    from pagedgen.ops.kernels.native import native_status
    from pagedgen.ops.matmul.quant_gemm import quant_kernels

    if quant_kernels() is None:
        reason = f"native weights need the native kernels, which are off: {native_status().detail}"
        log.warning("pagedgen loads float32 weights: %s", reason)
        return WeightFormat.FLOAT32, reason
    return WeightFormat.NATIVE, "native kernels available"


# Projections a runtime stacks into one weight (``_fuse_linears``), in its row order. The native file stores
# each layer's group back to back, so when their formats match the stacked weight is a view of the file's
# mapping, not a copy.
FUSED_GROUPS = (
    ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
)
_FUSED_RANK = {suffix: (g, i) for g, group in enumerate(FUSED_GROUPS) for i, suffix in enumerate(group)}


def native_shape(plan: WeightPlan) -> tuple[int, int] | None:
    """``(out, row_bytes)`` of the blocks of a 2-D tensor of a native type, else ``None`` (dequantised)."""
    qtype = NATIVE_GGUF_TYPES.get(plan.ggml_type)
    if qtype is None or len(plan.shape) != 2 or plan.shape[1] % qtype.block_elems:
        return None
    return plan.shape[0], qtype.row_bytes(plan.shape[1])


def native_blocks(file: GGUFFile, plan: WeightPlan, config: ModelConfig) -> np.ndarray | None:
    """A 2-D tensor of a native type as ``[out, row_bytes]`` uint8 blocks in HF row order, else ``None``.

    llama.cpp's Q/K row permutation is undone on whole rows (each output row is whole blocks). The result
    is a read-only view of the file's mapping unless rows were permuted.
    """
    shape = native_shape(plan)
    if shape is None:
        return None
    blocks = np.asarray(file.reader.tensors[plan.index].data).view(np.uint8).reshape(shape)
    if file.architecture == "llama" and plan.name.endswith(("q_proj.weight", "k_proj.weight")):
        blocks = unpermute_qk(blocks, config.num_heads if ".q_proj." in plan.name else config.num_kv_heads)
    return np.ascontiguousarray(blocks)


def native_file_order(plans: list[WeightPlan]) -> list[WeightPlan]:
    """``plans`` with each layer's :data:`FUSED_GROUPS` members adjacent, in stacking order; the rest keep
    their place (a group sits where its first member was)."""
    first: dict[tuple[str, int], int] = {}  # (layer prefix, group) -> position of its first member
    keys = []
    for position, plan in enumerate(plans):
        member = next(
            ((plan.name[: -len(s)], rank) for s, rank in _FUSED_RANK.items() if plan.name.endswith(s)), None
        )
        if member is None:
            keys.append((position, 0))
            continue
        (prefix, (group, index)) = member
        keys.append((first.setdefault((prefix, group), position), 1 + index))
    return [plan for _, plan in sorted(zip(keys, plans, strict=True), key=lambda item: item[0])]


def write_native_file(directory: Path, file: GGUFFile, plans: list[WeightPlan], config: ModelConfig) -> None:
    """Write ``NATIVE_FILE``: the blocks of every native-type 2-D tensor (in :func:`native_file_order`),
    their qtypes in the metadata. One tensor's blocks are in memory at a time."""
    kept = [plan for plan in native_file_order(plans) if native_shape(plan) is not None]
    qtypes = {plan.name: plan.ggml_type for plan in kept}
    specs = [TensorSpec(plan.name, "U8", native_shape(plan)) for plan in kept]
    tensors = ((plan.name, torch.from_numpy(np.array(native_blocks(file, plan, config)))) for plan in kept)
    write_safetensors(directory / NATIVE_FILE, specs, tensors, {QTYPES_KEY: json.dumps(qtypes)})


def read_native_entry(directory: Path) -> dict[str, WeightValue]:
    """A GGUF cache entry's tensors: native blocks from ``NATIVE_FILE``, the rest float32 from the weights.

    The blocks are views of one read-only mapping of ``NATIVE_FILE`` (:func:`map_native_file`): nothing is
    copied, pages are read on first use and shared with every process mapping the same entry. Only the
    float32 tensors not held as blocks are read from ``model.safetensors`` (norms: kilobytes). Raises
    :class:`ModelLoadError` naming the file when either is missing or damaged.
    """
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, WeightValue] = dict(map_native_file(directory / NATIVE_FILE))
    path = directory / WEIGHTS_FILE
    try:
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                if name not in tensors:
                    tensors[name] = f.get_tensor(name)
    except (SafetensorError, OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"{path}: missing, truncated or corrupt cache file ({exc})") from exc
    return tensors


def map_native_file(path: Path) -> dict[str, QuantizedWeight]:
    """Every tensor of ``NATIVE_FILE`` as a :class:`QuantizedWeight` over one ``mmap`` of the file.

    Raises :class:`ModelLoadError` naming the file when it is missing, its header does not parse, or a
    tensor's bytes fall outside the file or disagree with its qtype.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a {size}-byte file")
            header = json.loads(f.read(header_len))
        qtypes = json.loads(header.pop("__metadata__")[QTYPES_KEY])
        whole = torch.empty(0, dtype=torch.uint8)
        whole.set_(torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size))  # [size] uint8
        weights = {}
        for name, qtype in qtypes.items():
            entry = header[name]
            start, end = (8 + header_len + offset for offset in entry["data_offsets"])
            rows, row_bytes = entry["shape"]
            if entry["dtype"] != "U8" or end > size or end - start != rows * row_bytes:
                raise ValueError(f"tensor {name!r} {entry} does not fit the {size}-byte file")
            data = whole[start:end].view(rows, row_bytes)
            weights[name] = QuantizedWeight(NATIVE_GGUF_TYPES[qtype], _shape(data, qtype), data)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, struct.error) as exc:
        raise ModelLoadError(f"{path}: missing, truncated or corrupt cache file ({exc})") from exc
    return weights


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
