"""The paged KV cache's geometry (:class:`KVSpec`) and storage (:class:`PagedKVCache`).

A model declares its ``KVSpec``; the executor allocates one ``PagedKVCache`` from it and hands it to every
forward call; the attention ops read and write it. Which request owns which block is ``pagedgen.cache``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Geometry of the paged KV cache a model needs: one K and one V tensor per attention layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"KVSpec.{name} must be positive, got {value}")

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one physical block costs across all layers, K and V together."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * element


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor; on CPU its pages are zeroed lazily, when first touched.

    ``torch.zeros`` writes every byte up front: for a multi-GB KV pool that cost ~15 s of page faults at
    start-up here. numpy's ``zeros`` uses ``calloc``, which guarantees zeros but maps large buffers straight
    from the kernel's zero pages, so memory is only paid for as blocks are used. Zeros (not garbage) matter:
    attention multiplies masked-out positions by a zero weight, and ``0 * NaN`` would poison the row.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    if dtype == torch.bfloat16:  # numpy has no bfloat16: same-width zeros, reinterpreted
        return torch.from_numpy(np.zeros(shape, dtype=np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.zeros(shape, dtype=torch.empty((), dtype=dtype).numpy().dtype))


class PagedKVCache:
    """The long-lived physical K/V tensors: per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Ownership of blocks lives in ``pagedgen.cache``; this object only holds the storage.
    """

    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int, device: torch.device | str = "cpu"):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.keys = [zeroed_tensor(shape, spec.dtype, device) for _ in range(spec.num_layers)]
        self.values = [zeroed_tensor(shape, spec.dtype, device) for _ in range(spec.num_layers)]
