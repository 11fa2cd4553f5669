"""Write a safetensors file one tensor at a time.

``safetensors.torch.save_file`` needs every tensor in memory at once; dequantising a GGUF file to float32
would then need the whole model twice. The format is simple (8-byte little-endian header length, a JSON
header of names/dtypes/shapes/offsets padded to 8 bytes, then the raw bytes in order), so when shapes and
dtypes are known up front the header can be written first and each tensor streamed after it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, safetensors dtype (``F32``/``F16``/``BF16``, ``U8`` for quant blocks) and shape of a tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"TensorSpec.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=_DTYPES[self.dtype]).element_size()


def write_safetensors(
    path: Path,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor | Iterable[torch.Tensor]]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``tensors`` (yielded in ``specs`` order) to ``path``; each is cast to its spec's dtype.

    A tensor may come whole or as an iterable of consecutive row chunks (so a large one is never in memory
    at once).

    Raises ``ValueError`` if a yielded tensor's name or shape differs from its spec or the counts differ;
    the partly written file is then left for the caller to discard (write to a temporary path).
    """
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for spec, (name, tensor) in zip(specs, tensors, strict=True):
            if name != spec.name:
                raise ValueError(f"tensor {name!r} does not match spec {spec}")
            _write_rows(f, spec, [tensor] if isinstance(tensor, torch.Tensor) else tensor)


def _write_rows(f: BinaryIO, spec: TensorSpec, chunks: Iterable[torch.Tensor]) -> None:
    """Write one tensor given whole or as consecutive chunks of its rows (dim 0); checks the shape."""
    rows = 0
    for chunk in chunks:
        if tuple(chunk.shape[1:]) != spec.shape[1:] or (not spec.shape and chunk.dim()):
            raise ValueError(f"tensor {spec.name!r} {tuple(chunk.shape)} does not match spec {spec}")
        rows += chunk.shape[0] if spec.shape else 1
        data = chunk.detach().to(device="cpu", dtype=_DTYPES[spec.dtype]).contiguous()
        f.write(data.view(torch.uint8).numpy())
    if rows != (spec.shape[0] if spec.shape else 1):
        raise ValueError(f"tensor {spec.name!r} of {rows} rows does not match spec {spec}")
