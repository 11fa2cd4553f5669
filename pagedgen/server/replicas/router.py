"""The Ray Serve ``RequestRouter`` of the replica deployment: cache affinity, then the power of two choices.

Serve calls :meth:`CacheAffinityRouter.choose_replicas` in the ingress process for every call on the replica
deployment's handle. A generation call carries a :class:`ReplicaJob` whose prompt ids the router hashes into
the prefix cache's block digests (:mod:`pagedgen.server.replicas.affinity` decides); a stats call carries a
:class:`ReplicaTarget` naming the replica it is for, which is how the ingress reads every replica's counters.
Load is the router's own count of calls in flight per replica (sent minus completed, hooks Serve calls for
every request), so it needs no probe. The first choice is returned as its own rank and the others as the
next: Serve sends to the first unless it refuses (full, ``max_ongoing_requests``), then to the least loaded
of the rest.

Each router registers in :mod:`pagedgen.server.replicas.registry`, where the ingress lists the live
replicas; Serve creates one per handle, in the handle's process.
"""

from __future__ import annotations

import random
from collections import Counter

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedgen.server.replicas import registry
from pagedgen.server.replicas.affinity import AffinityTable, Route, choose
from pagedgen.server.replicas.messages import ReplicaJob, ReplicaTarget


class CacheAffinityRouter(RequestRouter):
    """Cache-affinity routing over the replicas of one deployment (kwargs from ``request_router_kwargs``)."""

    def initialize_state(
        self, block_size: int = 16, imbalance: int = 8, routing: str = "affinity", seed: int | None = None
    ) -> None:
        self._block_size = block_size
        self._imbalance = imbalance
        self._affinity = routing == "affinity"
        self._rng = random.Random(seed)
        self._table = AffinityTable()
        self._in_flight: dict[str, int] = {}
        self._routes: Counter[Route] = Counter()  # generation calls by how their replica was chosen
        registry.register(self._deployment_id.app_name, self._deployment_id.name, self)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_name = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if not by_name:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # a refused round waits before the next
        message = _message_of(pending_request)
        if isinstance(message, ReplicaTarget) and message.replica is not None:
            target = by_name.get(message.replica)
            return [[target]] if target is not None else []
        prompt = message.prompt_ids if isinstance(message, ReplicaJob) else None
        loads = {name: self._in_flight.get(name, 0) for name in by_name}
        routing = choose(
            self._table,
            prompt,
            loads,
            block_size=self._block_size,
            imbalance=self._imbalance,
            affinity=self._affinity,
            rng=self._rng,
        )
        if isinstance(message, ReplicaJob):
            self._routes[routing.route] += 1
        order = routing.order
        ranks = [[by_name[order[0]]]]
        if len(order) > 1:
            ranks.append([by_name[name] for name in order[1:]])
        return ranks

    def route_counts(self) -> dict[Route, int]:
        """Generation calls routed so far, by how their replica was chosen (every route, zeros too)."""
        return {route: self._routes[route] for route in Route}

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        name = replica_id.unique_id
        self._in_flight[name] = self._in_flight.get(name, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        name = replica_id.unique_id
        if self._in_flight.get(name, 0) > 0:
            self._in_flight[name] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._table.forget(replica_id.unique_id)
        self._in_flight.pop(replica_id.unique_id, None)


def _message_of(pending_request: PendingRequest | None) -> ReplicaJob | ReplicaTarget | None:
    """The call's record (its first argument), or None for a call that carries neither."""
    if pending_request is None or not pending_request.args:
        return None
    message = pending_request.args[0]
    return message if isinstance(message, (ReplicaJob, ReplicaTarget)) else None
