"""The cache-affinity routers of this process, by deployment: how the ingress lists the live replicas.

Serve creates a deployment handle's router in the handle's process, from a copy of the router's module
(it pickles that module by value), so the registry lives here, in a module the copy imports by name.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router registers itself here, so it imports this module
    from pagedgen.server.replicas.affinity import Route
    from pagedgen.server.replicas.router import CacheAffinityRouter

_ROUTERS: dict[tuple[str, str], CacheAffinityRouter] = {}
_LOCK = threading.Lock()


def register(app_name: str, deployment: str, router: CacheAffinityRouter) -> None:
    with _LOCK:
        _ROUTERS[(app_name, deployment)] = router


def _router(app_name: str, deployment: str) -> CacheAffinityRouter | None:
    with _LOCK:
        return _ROUTERS.get((app_name, deployment))


def route_counts(app_name: str, deployment: str) -> dict[Route, int]:
    """The generation calls this process's router for the deployment has routed, by route (none before
    the router exists)."""
    router = _router(app_name, deployment)
    return {} if router is None else router.route_counts()


def live_replicas(app_name: str, deployment: str) -> list[str]:
    """The unique ids of the replicas this process's router for the deployment knows now (none before the
    router exists: Serve builds it on the handle's first use)."""
    router = _router(app_name, deployment)
    if router is None:
        return []
    return sorted(replica_id.unique_id for replica_id in list(router.curr_replicas))
