"""The cache-affinity routers of this process, by deployment: how the ingress lists the live replicas.

Serve creates a deployment handle's router in the handle's process, from a copy of the router's module
(it pickles that module by value), so the registry lives here, in a module the copy imports by name.
"""

from __future__ import annotations

import threading

from ray.serve.request_router import RequestRouter

_ROUTERS: dict[tuple[str, str], RequestRouter] = {}
_LOCK = threading.Lock()


def register(app_name: str, deployment: str, router: RequestRouter) -> None:
    with _LOCK:
        _ROUTERS[(app_name, deployment)] = router


def live_replicas(app_name: str, deployment: str) -> list[str]:
    """The unique ids of the replicas this process's router for the deployment knows now (none before the
    router exists: Serve builds it on the handle's first use)."""
    with _LOCK:
        router = _ROUTERS.get((app_name, deployment))
    if router is None:
        return []
    return sorted(replica_id.unique_id for replica_id in list(router.curr_replicas))
