"""The paged KV cache's geometry (:class:`KVSpec`) and storage (:class:`PagedKVCache`).

A model declares its ``KVSpec``; the executor allocates one ``PagedKVCache`` from it and hands it to every
forward call; the attention ops read and write it. Which request owns which block is ``pagedgen.cache``'s job.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Geometry of the paged KV cache a model needs: one K and one V tensor per attention layer.

    ``window_layers`` attend only to the last ``window_size`` positions (sliding window); the engine may keep
    them in a ring of blocks from a separate pool (:mod:`pagedgen.core.window_geometry`) instead of growing
    blocks.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    window_size: int | None = None
    window_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"KVSpec.{name} must be positive, got {value}")
        if (self.window_size is None) != (not self.window_layers):
            raise ValueError(
                f"KVSpec.window_size ({self.window_size}) and window_layers ({self.window_layers}) "
                "must be given together"
            )
        if self.window_size is not None and self.window_size <= 0:
            raise ValueError(f"KVSpec.window_size must be positive, got {self.window_size}")
        if any(not 0 <= i < self.num_layers for i in self.window_layers) or len(
            set(self.window_layers)
        ) != len(self.window_layers):
            raise ValueError(
                f"KVSpec.window_layers {self.window_layers} must be distinct layers 0..{self.num_layers - 1}"
            )

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Layers that attend to the whole sequence."""
        return tuple(i for i in range(self.num_layers) if i not in self.window_layers)

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one physical block costs across all layers, K and V together."""
        return self._bytes(self.num_layers, block_size)

    def bytes_per_full_block(self, block_size: int) -> int:
        """Bytes of one block of the full-context pool: the layers that attend to the whole sequence."""
        return self._bytes(len(self.full_layers), block_size)

    def bytes_per_window_block(self, block_size: int) -> int:
        """Bytes of one block of the window-ring pool: the sliding-window layers."""
        return self._bytes(len(self.window_layers), block_size)

    def _bytes(self, layers: int, block_size: int) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * layers * block_size * self.num_kv_heads * self.head_dim * element


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor; on CPU its pages are zeroed lazily, when first touched, 4 KiB at a time.

    ``torch.zeros`` writes every byte up front: for a multi-GB KV pool that cost ~15 s of page faults at
    start-up here. An anonymous mapping is zero by definition and only paid for as pages are touched. It is
    advised against transparent huge pages: the block allocator spreads a batch's blocks over the pool, and
    with huge pages each first write to a block faults in (and zeroes, often after compacting memory for)
    the whole 2 MiB around it. numpy's ``zeros`` asks for exactly that on large arrays (``madvise
    (MADV_HUGEPAGE)``): the first 32-prompt prefill of Gemma 3 270M spent 7.0 of its 12.7 s writing keys
    and values, against 0.10 s of 6.3 s on this mapping. Zeros (not garbage) matter: attention multiplies
    masked-out positions by a zero weight, and ``0 * NaN`` would poison the row.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes)  # anonymous: zero-filled on first touch; the tensor keeps it alive
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


class PagedKVCache:
    """The long-lived physical K/V tensors: per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    With ``window_blocks``, the spec's sliding-window layers get ``[window_blocks, ...]`` tensors instead: the
    storage of the separate window-ring pool (``window_ring`` is then True). Without it, windowed layers are
    stored like full ones and only masked. Ownership of blocks lives in ``pagedgen.cache``; this object only
    holds the storage.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        window_blocks: int | None = None,
    ):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        if window_blocks is not None and (window_blocks <= 0 or not spec.window_layers):
            raise ValueError(f"window_blocks {window_blocks} needs a positive count and windowed layers")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window_blocks = window_blocks
        self.window_ring = window_blocks is not None
        windowed = set(spec.window_layers) if self.window_ring else set()
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for layer in range(spec.num_layers):
            count = window_blocks if layer in windowed else num_blocks
            shape = (count, block_size, spec.num_kv_heads, spec.head_dim)
            self.keys.append(zeroed_tensor(shape, spec.dtype, device))
            self.values.append(zeroed_tensor(shape, spec.dtype, device))
