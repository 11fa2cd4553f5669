"""``pagedgen serve --replicas N``: start or join a Ray cluster, deploy the application, serve until a signal.

Without ``--ray-address`` Ray starts a cluster of this machine; with one (``auto``, or ``HOST:6379`` of a
running head) the replicas are placed across that cluster's nodes. Serve's proxy listens on
``host:port``. SIGTERM or SIGINT deletes the application, which Serve shuts down gracefully: each replica
and the ingress get the ``--shutdown-timeout`` to finish their requests in flight.
"""

from __future__ import annotations

import logging
import signal
import threading

from pagedgen.server.replicas.application import APP_NAME, build_application
from pagedgen.server.replicas.setup import ReplicaSetup

log = logging.getLogger("pagedgen.server")


def serve_replicas(setup: ReplicaSetup, *, host: str, port: int, ray_address: str | None) -> int:
    """Deploy ``setup`` behind Serve's proxy on ``host:port`` and block until SIGTERM or SIGINT."""
    import ray
    from ray import serve

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if ray_address is None:
        ray.init(include_dashboard=False)  # a cluster of this machine, for this process
    else:
        ray.init(address=ray_address)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_application(setup), name=APP_NAME, route_prefix="/", blocking=False)
        count = setup.num_replicas if setup.autoscaling_config is None else "autoscaled"
        log.info("serving %s replicas of %r at http://%s:%d", count, setup.source.name, host, port)
        stop.wait()
        log.info("shutting down: the application drains (up to %.0f s)", setup.options.shutdown_timeout)
        serve.delete(APP_NAME)
        if ray_address is None:
            serve.shutdown()
    finally:
        ray.shutdown()
    return 0
