"""Paged KV-cache ownership: block pool, block tables, prefix cache, step planning, reservations, the manager.

Block ownership is pure Python bookkeeping (the K/V tensors live in ``pagedgen.core.kv.PagedKVCache``); the
fixed-state pool (``fixed_state``) owns its conv / recurrent state banks itself.
"""

from pagedgen.cache.block_pool import BlockPool, BlockState, num_blocks_for_budget
from pagedgen.cache.block_table import BlockTable, blocks_for_tokens, slot_of_position
from pagedgen.cache.fixed_state_pool import FixedStatePool, FixedStateReservation
from pagedgen.cache.manager import CacheStats, PagedCacheManager
from pagedgen.cache.paged import CacheCandidate, DeferReason, PlanLimits, ResourcePlan, plan_resources
from pagedgen.cache.prefix import BlockHashes, PrefixCache, PrefixStats, block_hash
from pagedgen.cache.reservation import Reservation, ReservationState, ReservedRow
from pagedgen.cache.window_pool import WindowRingSpec

__all__ = [
    "BlockHashes",
    "BlockPool",
    "BlockState",
    "BlockTable",
    "CacheCandidate",
    "CacheStats",
    "DeferReason",
    "FixedStatePool",
    "FixedStateReservation",
    "PagedCacheManager",
    "PlanLimits",
    "PrefixCache",
    "PrefixStats",
    "Reservation",
    "ReservationState",
    "ReservedRow",
    "ResourcePlan",
    "WindowRingSpec",
    "block_hash",
    "blocks_for_tokens",
    "num_blocks_for_budget",
    "plan_resources",
    "slot_of_position",
]
