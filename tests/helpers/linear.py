"""Weights and tiny runtimes that the linear-layer, GEMM and quantisation unit tests share.

``random_weight`` writes blocks as gguf writes them; ``QuantRuntime`` and ``TinyRuntime`` are the smallest
models whose linear layers the GEMM and quantisation tables are calibrated over; ``all_logits`` runs one
packed step of a whole prompt through a loaded model.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from torch import nn

from pagedgen.core.kv import PagedKVCache
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.models.llama import Linear, _fuse_linears, _set_weight
from pagedgen.models.model import Model
from pagedgen.ops.matmul.qweight import QType, QuantizedWeight

# Byte offsets of each K-quant super-block's f16 scales (d, and dmin where there is one).
K_SCALE_OFFSETS = {QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2)}
K_SCALE_OFFSETS[QType.Q6_K] = (208,)


def random_weight(qtype: QType, out: int, k: int, seed: int = 0) -> QuantizedWeight:
    """Blocks as gguf writes them (its own quantiser where it has one; random blocks with finite f16 scales
    for the K-quants, which gguf-py cannot quantise)."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((out, k)) * 0.5).astype(np.float32)
    values[0, :4] = [1e-6, -3e-7, 0.0, -0.0]  # f16 subnormals and zeros
    if qtype in (QType.F16, QType.BF16):
        half = torch.from_numpy(values).to(torch.float16 if qtype is QType.F16 else torch.bfloat16)
        return QuantizedWeight.from_half(half)
    if qtype in K_SCALE_OFFSETS:
        blocks = rng.integers(0, 256, (out, k // 256, qtype.block_bytes), dtype=np.uint8)
        scales = (rng.standard_normal((out, k // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
        scales[0, 0, :2] = np.array([3e-7], dtype=np.float16).view(np.uint8)  # an f16 subnormal scale
        for i, offset in enumerate(K_SCALE_OFFSETS[qtype]):
            blocks[..., offset : offset + 2] = scales[..., 2 * i : 2 * i + 2]
        data = blocks.reshape(out, -1)
    else:
        data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype.name])
    return QuantizedWeight(qtype, (out, k), torch.from_numpy(np.ascontiguousarray(data)))


def quant_linear(qtype: QType, out_f: int, in_f: int, seed: int) -> Linear:
    layer = Linear(in_f, out_f, False, torch.float32)
    _set_weight(layer, random_weight(qtype, out_f, in_f, seed=seed))
    return layer


class QuantRuntime(nn.Module):
    """Layers of a fused q/k/v (Q4_1, 32 -> 32 + 16 + 16) and an output projection (Q4_1, 32 -> 32); a tied
    Q8_0 embedding as the head."""

    def __init__(self, layers: int = 2, fuse: bool = True):
        super().__init__()
        self.embed = random_weight(QType.Q8_0, 40, 32, seed=99)  # [vocab, hidden]
        self.blocks = nn.ModuleList()
        for i in range(layers):
            block = nn.Module()
            block.q, block.k, block.v = (quant_linear(QType.Q4_1, n, 32, 10 * i + n) for n in (32, 16, 16))
            block.o = quant_linear(QType.Q4_1, 32, 32, 10 * i + 5)
            if fuse:
                block.qkv = _fuse_linears([block.q, block.k, block.v])
            self.blocks.append(block)

    @property
    def head_weight(self):
        return self.embed


def float_linear(in_f: int, out_f: int, seed: int) -> Linear:
    layer = Linear(in_f, out_f, False, torch.float32)
    layer.weight = nn.Parameter(
        torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)), False
    )
    return layer


class TinyRuntime(nn.Module):
    """Layers of q/k/v (16 -> 8 + 4 + 4, fused or not) and an output projection (8 -> 16); a tied head."""

    def __init__(self, layers: int = 2, fuse: bool = True):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(40, 16), requires_grad=False)  # [vocab, hidden]
        self.blocks = nn.ModuleList()
        for i in range(layers):
            block = nn.Module()
            block.q, block.k, block.v = (
                float_linear(16, 8, i),
                float_linear(16, 4, i + 10),
                float_linear(16, 4, i + 20),
            )
            block.o = float_linear(8, 16, i + 30)
            if fuse:
                block.qkv = _fuse_linears([block.q, block.k, block.v])
            self.blocks.append(block)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed


PROMPT_IDS = list(range(0, 260, 7))  # a prompt every tiny checkpoint's vocabulary holds


def all_logits(model: Model, ids: list[int]) -> torch.Tensor:
    cache = PagedKVCache(model.kv_spec, num_blocks=8, block_size=16)
    inputs = pack_step([SequenceChunk(ids, 0, [5, 2, 7], all_logits=True)], block_size=16)
    return model.runtime.forward(inputs, cache)
