"""Engine configuration and the rules that size the KV-cache block pool and a mixed step's token budget.

One frozen, validated ``EngineConfig`` is the whole of what a caller chooses; the two values it may leave as
None are resolved here from the model and its device (:func:`resolve_num_blocks`,
:func:`resolve_mixed_step_tokens`), so the engine never guesses elsewhere. The rules and why:
docs/cache.md, "Sizing the block pool", and docs/engine.md, "Latency fairness".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedgen.engine.isolation import DEFAULT_MAX_STEP_RETRIES
from pagedgen.errors import InvalidArgumentError
from pagedgen.parallel.launch import Launcher, Placement

DEFAULT_MAX_SCHEDULED_TOKENS = 2048
AUTO_KV_MEMORY_FRACTION = 0.25
DEFAULT_MAX_DRAFT_TOKENS = 8
TENSOR_PARALLEL_LAUNCHERS = tuple(m.value for m in Launcher)
TENSOR_PARALLEL_PLACEMENTS = tuple(m.value for m in Placement)
DEFAULT_CPU_MIXED_STEP_TOKENS = 512  # docs/performance.md, "Latency fairness": about 0.6 s on 2 cores


def _positive_int(name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"EngineConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine batches and how large its KV cache is (validated on construction).

    ``max_batch_size`` bounds both the scheduled rows of one step and the number of cache-resident requests;
    ``max_scheduled_tokens`` bounds the query tokens of one model run; ``chunk_size`` optionally bounds one
    request's prefill contribution per step (for a model with sliding-window layers it is also the ``C`` of
    their rings, capped to ``max_scheduled_tokens``, which it defaults to; docs/cache.md);
    ``dynamic_batching=False`` selects the static path;
    ``debug_invariants`` validates cache and request accounting after every step (raises on a violation);
    ``max_step_retries`` is how often an unattributed rollback is retried as is before the engine narrows the
    batch to find the request that causes it (:mod:`pagedgen.engine.isolation`);
    ``max_draft_tokens`` is the most speculative draft tokens one ``request.set_draft_tokens`` proposal may
    carry (0 turns caller-supplied drafts off; ``engine.max_draft_tokens_per_proposal()`` reports it, or 0
    where the model's state cannot commit an accepted prefix);
    ``prefix_caching`` shares the K/V of identical prompt prefixes across requests (full blocks, hash-chained;
    docs/cache.md). It applies to the dynamic path of a purely paged model only: with sliding-window rings or
    fixed conv / recurrent state the engine turns it off (``engine.stats().prefix_caching`` says which);
    ``cuda_graphs`` replays captured CUDA graphs for pure decode steps on a CUDA device (ignored on the CPU,
    and for models with sliding-window or fixed state; :mod:`pagedgen.executor.cuda_graphs`);
    ``tensor_parallel_size`` splits the model over that many ranks (over torch.distributed, Llama family
    only; docs/tensor-parallel.md); ``tensor_parallel_launcher`` starts ranks ``1..T-1`` as ``"local"``
    processes on this machine (the default) or as ``"ray"`` actors in a placement group whose strategy is
    ``tensor_parallel_placement`` (``"STRICT_PACK"``, the default: one node; ``"SPREAD"``, ``"PACK"`` or
    ``"STRICT_SPREAD"`` to use other machines).
    """

    max_batch_size: int = 16
    max_scheduled_tokens: int = DEFAULT_MAX_SCHEDULED_TOKENS
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    chunk_size: int | None = None
    max_mixed_step_tokens: int | None = None
    dynamic_batching: bool = True
    debug_invariants: bool = False
    max_step_retries: int = DEFAULT_MAX_STEP_RETRIES
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS
    prefix_caching: bool = True
    cuda_graphs: bool = True
    tensor_parallel_size: int = 1
    tensor_parallel_launcher: str = "local"
    tensor_parallel_placement: str = "STRICT_PACK"

    def __post_init__(self) -> None:
        _positive_int("max_batch_size", self.max_batch_size)
        _positive_int("max_scheduled_tokens", self.max_scheduled_tokens)
        _positive_int("block_size", self.block_size)
        _positive_int("num_blocks", self.num_blocks, optional=True)
        _positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, optional=True)
        _positive_int("chunk_size", self.chunk_size, optional=True)
        _positive_int("max_mixed_step_tokens", self.max_mixed_step_tokens, optional=True)
        _positive_int("max_step_retries", self.max_step_retries)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if (
            isinstance(self.max_draft_tokens, bool)
            or not isinstance(self.max_draft_tokens, int)
            or self.max_draft_tokens < 0
        ):
            raise InvalidArgumentError(
                f"EngineConfig.max_draft_tokens must be an int >= 0, got {self.max_draft_tokens!r}"
            )
        for name, choices in (
            ("tensor_parallel_launcher", TENSOR_PARALLEL_LAUNCHERS),
            ("tensor_parallel_placement", TENSOR_PARALLEL_PLACEMENTS),
        ):
            if getattr(self, name) not in choices:
                raise InvalidArgumentError(
                    f"EngineConfig.{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}"
                )
        for name in ("dynamic_batching", "debug_invariants", "prefix_caching", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")


def resolve_mixed_step_tokens(config: EngineConfig, device: torch.device) -> int:
    """The query-token budget of a step that carries a decode row (rule in the module docstring): the
    configured value, else ``DEFAULT_CPU_MIXED_STEP_TOKENS`` on the CPU and no extra bound elsewhere; never
    more than ``max_scheduled_tokens``."""
    if config.max_mixed_step_tokens is not None:
        budget = config.max_mixed_step_tokens
    elif device.type == "cpu":
        budget = DEFAULT_CPU_MIXED_STEP_TOKENS
    else:
        budget = config.max_scheduled_tokens
    return min(budget, config.max_scheduled_tokens)


def available_memory_bytes(device: torch.device) -> int:
    """Bytes free for new allocations on ``device`` right now (host RAM for CPU)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_num_blocks(
    config: EngineConfig,
    bytes_per_block: int,
    max_context: int,
    device: torch.device,
    reserved_bytes: int = 0,
) -> int:
    """The block-pool size for ``config`` (rule in the module docstring).

    Raises ``ValueError`` if not one block fits, :class:`InvalidArgumentError` if the byte budget does not
    even hold the reserved storage (the sliding-window rings, the fixed-state slots).
    """
    from pagedgen.cache import blocks_for_tokens, num_blocks_for_budget

    if config.num_blocks is not None:
        return config.num_blocks
    ceiling = config.max_batch_size * blocks_for_tokens(max_context, config.block_size)
    explicit = config.kv_cache_memory_bytes is not None
    if config.kv_cache_memory_bytes is not None:
        budget, source = config.kv_cache_memory_bytes, f"kv_cache_memory_bytes {config.kv_cache_memory_bytes}"
    else:
        budget = int(available_memory_bytes(device) * AUTO_KV_MEMORY_FRACTION)
        source = f"the automatic KV budget ({budget} bytes, a quarter of the free memory)"
    if reserved_bytes > budget or (reserved_bytes == budget and bytes_per_block > 0):
        raise InvalidArgumentError(
            f"{source} does not hold the sliding-window rings and fixed-state slots ({reserved_bytes} "
            "bytes: one of each per max_batch_size request) and a block more; lower max_batch_size or "
            "chunk_size, or raise it",
            "kv_cache_memory_bytes",
        )
    if bytes_per_block == 0:
        return ceiling
    num_blocks = num_blocks_for_budget(budget - reserved_bytes, bytes_per_block)
    return num_blocks if explicit else min(ceiling, num_blocks)
