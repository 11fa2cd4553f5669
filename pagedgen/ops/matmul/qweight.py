"""A weight matrix kept in the format it is stored in: GGUF quant blocks, f16 or bf16.

Why: the default model's weights are Q4_1/Q8_0 in its GGUF file (85 MB); dequantised to fp32 they are 538 MB,
and a batch-1 decode step is bound by streaming them. :func:`pagedgen.ops.matmul.linear.linear` recognises a
:class:`QuantizedWeight` and runs :mod:`pagedgen.ops.matmul.quant_gemm`, whose kernel expands each weight to
fp32 in registers/L1 exactly as ``gguf.quants.dequantize`` would. Nothing about the model changes: no
re-quantisation. docs/performance.md, "Module notes: ops and bench", has the rest.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch


class QType(enum.Enum):
    """Stored formats with a native kernel; the value is ``(ggml type id, block elements, block bytes)``."""

    F16 = (1, 1, 2)
    Q4_0 = (2, 32, 18)
    Q4_1 = (3, 32, 20)
    Q5_0 = (6, 32, 22)
    Q5_1 = (7, 32, 24)
    Q8_0 = (8, 32, 34)
    Q2_K = (10, 256, 84)
    Q3_K = (11, 256, 110)
    Q4_K = (12, 256, 144)
    Q5_K = (13, 256, 176)
    Q6_K = (14, 256, 210)
    BF16 = (30, 1, 2)

    @property
    def ggml_id(self) -> int:
        return self.value[0]

    @property
    def block_elems(self) -> int:
        return self.value[1]

    @property
    def block_bytes(self) -> int:
        return self.value[2]

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block_elems * self.block_bytes


# The GGUF type names (``gguf.GGMLQuantizationType(...).name``) run natively; the rest are dequantised.
NATIVE_GGUF_TYPES = {q.name: q for q in QType}

# Formats with an 8-bit-activation kernel (``kernels/quant_q8.c``, ``pg.Model(..., activations="q8")``), and
# the flag a weight's kernel id carries when it takes that path.
# The 32-block formats pair with 32-element activation blocks, the K-quants with 256-element ones, as
# llama.cpp pairs them.
Q8_ACTIVATION_TYPES = frozenset(
    {QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K}
)
Q8_ACTIVATIONS_FLAG = 0x100


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """``[out, in]`` weights as raw blocks: ``data [out, row_bytes]`` uint8 in ``qtype``'s block format.

    Raises ``ValueError`` naming the field when ``in`` is not a whole number of blocks or ``data`` does not
    hold exactly ``out`` rows of ``row_bytes``.
    """

    qtype: QType
    shape: tuple[int, int]  # (out_features, in_features), as the fp32 weight would be
    data: torch.Tensor  # [out, row_bytes] uint8, CPU, rows contiguous
    q8_activations: bool = False  # multiply with 8-bit activations (approximate; Q8_ACTIVATION_TYPES only)

    def __post_init__(self) -> None:
        if self.q8_activations and self.qtype not in Q8_ACTIVATION_TYPES:
            raise ValueError(
                f"QuantizedWeight.q8_activations: {self.qtype.name} has no 8-bit-activation kernel"
            )
        out, k = self.shape
        if k <= 0 or k % self.qtype.block_elems:
            raise ValueError(f"QuantizedWeight.shape: in={k} is not a multiple of {self.qtype.name} blocks")
        expected = (out, self.qtype.row_bytes(k))
        if self.data.dtype is not torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(
                f"QuantizedWeight.data must be uint8 {expected} for {self.qtype.name} {self.shape}, "
                f"got {self.data.dtype} {tuple(self.data.shape)}"
            )
        if self.data.device.type != "cpu" or self.data.stride(1) != 1 or self.data.stride(0) != expected[1]:
            raise ValueError("QuantizedWeight.data must be a contiguous CPU tensor")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def kernel_id(self) -> int:
        """The type id the native GEMM is called with: ggml's, with the 8-bit-activations flag when set."""
        return self.qtype.ggml_id | (Q8_ACTIVATIONS_FLAG if self.q8_activations else 0)

    def rows(self, start: int, end: int) -> QuantizedWeight:
        """Output rows ``start:end`` as a view (the fused q/k/v parts keep pointing into one tensor)."""
        return QuantizedWeight(
            self.qtype, (end - start, self.shape[1]), self.data[start:end], self.q8_activations
        )

    @staticmethod
    def from_half(weight: torch.Tensor) -> QuantizedWeight:
        """A 2-D f16 or bf16 tensor kept as stored (its bytes, viewed; no copy when contiguous)."""
        qtype = {torch.float16: QType.F16, torch.bfloat16: QType.BF16}[weight.dtype]
        weight = weight.contiguous()
        return QuantizedWeight(qtype, tuple(weight.shape), weight.view(torch.uint8))


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight stacking ``parts`` by output row (all of one qtype and in size).

    A view when the parts already lie back to back in one storage (a GGUF cache entry stores each layer's
    fused projections so: :data:`pagedgen.models.native_weights.FUSED_GROUPS`), else one copy of the blocks.
    """
    first = parts[0]
    if any(p.qtype is not first.qtype or p.shape[1] != first.shape[1] for p in parts):
        raise ValueError(f"cannot stack {[(p.qtype.name, p.shape) for p in parts]}: qtype or in size differ")
    if any(p.q8_activations != first.q8_activations for p in parts):
        raise ValueError("cannot stack weights with and without q8_activations")
    rows = sum(p.shape[0] for p in parts)
    if _back_to_back(parts):
        data = first.data.as_strided((rows, first.data.shape[1]), (first.data.shape[1], 1))
    else:
        data = torch.cat([p.data for p in parts])  # [sum(out), row_bytes]
    return QuantizedWeight(first.qtype, (rows, first.shape[1]), data, first.q8_activations)


def _back_to_back(parts: list[QuantizedWeight]) -> bool:
    """Whether each part's bytes start where the previous one's end, inside one storage."""
    storage = parts[0].data.untyped_storage().data_ptr()
    for previous, part in itertools.pairwise(parts):
        if part.data.untyped_storage().data_ptr() != storage:
            return False
        if part.data.data_ptr() != previous.data.data_ptr() + previous.nbytes:
            return False
    return True
