"""Paged KV-cache ownership: block pool, block tables, step planning, reservations, the manager facade.

Pure Python bookkeeping; the K/V tensors themselves live in ``pagedgen.core.kv.PagedKVCache``.
"""

from pagedgen.cache.block_pool import BlockPool, BlockState, num_blocks_for_budget
from pagedgen.cache.block_table import BlockTable, blocks_for_tokens, slot_of_position
from pagedgen.cache.manager import CacheStats, PagedCacheManager
from pagedgen.cache.paged import CacheCandidate, DeferReason, PlanLimits, ResourcePlan, plan_resources
from pagedgen.cache.reservation import Reservation, ReservationState, ReservedRow
from pagedgen.cache.window_ring import WindowRingSpec

__all__ = [
    "BlockPool",
    "BlockState",
    "BlockTable",
    "CacheCandidate",
    "CacheStats",
    "DeferReason",
    "PagedCacheManager",
    "PlanLimits",
    "Reservation",
    "ReservationState",
    "ReservedRow",
    "ResourcePlan",
    "WindowRingSpec",
    "blocks_for_tokens",
    "num_blocks_for_budget",
    "plan_resources",
    "slot_of_position",
]
