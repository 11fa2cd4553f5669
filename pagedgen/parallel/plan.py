"""Which heads and MLP channels each tensor-parallel rank owns: pure arithmetic over the model's sizes.

The unit of the attention split is a KV group (one KV head and the query heads that read it), so each
rank's attention is an ordinary grouped-query attention over its own heads and its KV cache holds only those
KV heads. With at least as many KV heads as ranks the groups are dealt out contiguously, as evenly as they
go (3 KV heads over 2 ranks: 2 and 1, the default model's case); with fewer KV heads than ranks each KV head
is replicated on ``T / K`` ranks, which split its query heads (``T`` a multiple of ``K`` and the group size
a multiple of ``T / K``, else refused). The MLP's inner channels are dealt out in units of the down
projection's quant block (a stored weight is cut on block boundaries only), as evenly as they go.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedgen.errors import TensorParallelError as TensorParallelError


@dataclass(frozen=True, slots=True)
class RankShard:
    """One rank's share: query heads ``q_heads``, KV heads ``kv_heads``, inner channels ``inner``
    (half-open ranges) and whether it adds the row-parallel layers' biases (rank 0 only)."""

    rank: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inner: tuple[int, int]
    adds_bias: bool

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_inner(self) -> int:
        return self.inner[1] - self.inner[0]


def even_ranges(count: int, parts: int) -> list[tuple[int, int]]:
    """``count`` items in ``parts`` contiguous ranges, the first ``count % parts`` one longer."""
    base, extra = divmod(count, parts)
    ranges, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def _head_ranges(
    num_heads: int, num_kv_heads: int, world: int
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each rank's (query heads, KV heads) under the module docstring's rule."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        return [((a * group, b * group), (a, b)) for a, b in even_ranges(num_kv_heads, world)]
    replicas = world // num_kv_heads
    if world % num_kv_heads or group % replicas:
        raise TensorParallelError(
            f"tensor_parallel_size={world} cannot split {num_kv_heads} KV heads of {group} query heads each: "
            f"with fewer KV heads than ranks, the size must be a multiple of the KV heads and each group's "
            f"query heads a multiple of {replicas}"
        )
    per_rank = group // replicas
    shards = []
    for rank in range(world):
        kv, part = divmod(rank, replicas)
        start = kv * group + part * per_rank
        shards.append(((start, start + per_rank), (kv, kv + 1)))
    return shards


def plan_shards(
    num_heads: int, num_kv_heads: int, intermediate_size: int, world: int, inner_unit: int = 1
) -> list[RankShard]:
    """Every rank's :class:`RankShard`; ``inner_unit`` is the down projection's block size along its input
    (1 for a float weight). Raises :class:`TensorParallelError` naming the sizes that do not split."""
    if world < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {world}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise TensorParallelError(f"{num_heads} query heads do not form groups over {num_kv_heads} KV heads")
    units, rest = divmod(intermediate_size, inner_unit)
    if rest or units < world:
        raise TensorParallelError(
            f"tensor_parallel_size={world} cannot split the MLP's {intermediate_size} channels in blocks of "
            f"{inner_unit}"
        )
    heads = _head_ranges(num_heads, num_kv_heads, world)
    inner = even_ranges(units, world)
    return [
        RankShard(rank, q, kv, (a * inner_unit, b * inner_unit), rank == 0)
        for rank, ((q, kv), (a, b)) in enumerate(zip(heads, inner, strict=True))
    ]
