"""Which replica a prompt goes to: the one that holds its prefix, unless that one is much busier.

The key is the prefix cache's own name for a block (:func:`pagedgen.cache.prefix.block_hash`, chained over
full blocks of the engine's ``block_size``): a replica that was sent a prompt computed and cached exactly
those blocks, so a later prompt that starts with them (the next turn of a conversation, a shared system
prompt) finds them there. :class:`AffinityTable` remembers, for each block digest routed, the replica it
went to (bounded, least recently routed forgotten first); it is routing history, the way Ray's
``PrefixCacheAffinityRouter`` keeps a tree of routed text, not a mirror of each engine's cache, which may
have evicted a block since. :func:`choose` is the decision, pure so its boundaries are unit-tested; it says
how it decided (:class:`Route`), which ``/metrics`` counts (``pagedgen:routed_requests``).
"""

from __future__ import annotations

import enum
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedgen.cache.prefix import BlockHashes

DEFAULT_TABLE_BLOCKS = 1 << 18  # 262,144 digests (~16 MiB): millions of cached tokens at 16 per block


class Route(enum.Enum):
    """How a request's replica was chosen (the ``route`` label of ``pagedgen:routed_requests``)."""

    PREFIX = "prefix"  # to the replica that was sent the prompt's longest routed prefix
    BALANCED = "balanced"  # that replica was too busy: the power of two choices instead
    NEW = "new"  # no routed prefix (or not one full block): the power of two choices
    RANDOM = "random"  # routing="random": uniformly at random, the prompt ignored


@dataclass(frozen=True, slots=True)
class Routing:
    """:func:`choose`'s answer: the replicas in the order to try them, and how the first was chosen."""

    order: list[str]
    route: Route


class AffinityTable:
    """Block digest -> the replica (its id string) the block was last routed to."""

    def __init__(self, capacity: int = DEFAULT_TABLE_BLOCKS):
        if capacity < 1:
            raise ValueError(f"AffinityTable capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._holder: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holder)

    def holder(self, digests: Sequence[bytes], live: Mapping[str, int]) -> tuple[str | None, int]:
        """The live replica holding the longest prefix of ``digests`` and how many blocks it holds."""
        for count in range(len(digests), 0, -1):
            replica = self._holder.get(digests[count - 1])
            if replica is not None and replica in live:
                return replica, count
        return None, 0

    def record(self, digests: Sequence[bytes], replica: str) -> None:
        for digest in digests:
            self._holder[digest] = replica
            self._holder.move_to_end(digest)
        while len(self._holder) > self._capacity:
            self._holder.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop a replica that died: its cache died with it."""
        for digest in [d for d, r in self._holder.items() if r == replica]:
            del self._holder[digest]


def prompt_digests(prompt_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The prefix cache's digests of the prompt's full blocks (the engine hashes unsalted)."""
    hashes = BlockHashes(list(prompt_ids), block_size)
    return hashes.upto(hashes.num_full_blocks)


def power_of_two(loads: Mapping[str, int], rng: random.Random) -> str:
    """Two replicas at random, the less loaded one (a tie: the first drawn)."""
    names = sorted(loads)
    if len(names) == 1:
        return names[0]
    first, second = rng.sample(names, 2)
    return second if loads[second] < loads[first] else first


def choose(
    table: AffinityTable,
    prompt_ids: Sequence[int] | None,
    loads: Mapping[str, int],
    *,
    block_size: int,
    imbalance: int,
    affinity: bool,
    rng: random.Random,
) -> Routing:
    """The replicas in the order to try them (``loads``: requests in flight per live replica, not empty).

    With ``affinity`` the first is the holder of the prompt's longest routed prefix, unless it has more than
    ``imbalance`` requests in flight beyond the least-loaded replica; otherwise (or without a full block)
    the power of two choices; without ``affinity``, uniformly at random. The prompt's blocks are then
    recorded as routed to the first. The rest follow by load, for when the first refuses (full)."""
    digests = prompt_digests(prompt_ids, block_size) if prompt_ids and affinity else []
    holder, _ = table.holder(digests, loads)
    if not affinity:
        first, route = rng.choice(sorted(loads)), Route.RANDOM
    elif holder is not None and loads[holder] - min(loads.values()) <= imbalance:
        first, route = holder, Route.PREFIX
    else:
        first = power_of_two(loads, rng)
        route = Route.NEW if holder is None else Route.BALANCED
    if digests:
        table.record(digests, first)
    rest = sorted((name for name in loads if name != first), key=lambda name: (loads[name], name))
    return Routing([first, *rest], route)
