"""``pagedgen serve --replicas N``: start or join a Ray cluster, deploy the application, serve until a signal.

Without ``--ray-address`` Ray starts a cluster of this machine; with one (``auto``, or ``HOST:6379`` of a
running head) the replicas are placed across that cluster's nodes. Serve's proxy listens on
``host:port``. SIGTERM or SIGINT first drains the ingress the way the single server drains (new requests
503 ``shutting_down``, those in flight get ``--shutdown-timeout``, then end with the ``shutting_down``
error), then deletes the application, which by then has nothing in flight.
"""

from __future__ import annotations

import logging
import signal
import threading

from pagedgen.server.lifecycle import DELIVERY_GRACE_S
from pagedgen.server.replicas.application import APP_NAME, SHUTDOWN_MARGIN_S, build_application
from pagedgen.server.replicas.setup import ReplicaSetup

log = logging.getLogger("pagedgen.server")


START_ATTEMPTS = 3


def start_local_ray(
    num_cpus: int | None = None, *, log_to_driver: bool = True, configure_logging: bool = True
) -> None:
    """``ray.init`` of a new local cluster, retried (bounded) when its node times out starting: Ray gives
    its raylet a fixed 30 s to register, which a loaded machine can exceed; any other error is raised."""
    import ray

    for attempt in range(START_ATTEMPTS):
        try:
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=log_to_driver,
                configure_logging=configure_logging,
            )
            return
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == START_ATTEMPTS - 1:
                raise
            log.warning("the local Ray cluster timed out starting (attempt %d); retrying", attempt + 1)
            ray.shutdown()


def drain_ingress(timeout: float, app_name: str = APP_NAME) -> None:
    """Run the ingress's drain (:meth:`PagedgenIngress.drain`) and wait for it, bounded by the drain's own
    bounds; an ingress that cannot be reached (it died) is logged and the deletion goes on."""
    from ray import serve

    bound = timeout + DELIVERY_GRACE_S + SHUTDOWN_MARGIN_S
    try:
        serve.get_app_handle(app_name).drain.remote(timeout).result(timeout_s=bound)
    except Exception as exc:
        log.warning("the ingress did not drain: %r; deleting the application", exc)


def serve_replicas(setup: ReplicaSetup, *, host: str, port: int, ray_address: str | None) -> int:
    """Deploy ``setup`` behind Serve's proxy on ``host:port`` and block until SIGTERM or SIGINT."""
    import ray
    from ray import serve

    stop = threading.Event()
    if ray_address is None:
        start_local_ray()  # a cluster of this machine, for this process
    else:
        ray.init(address=ray_address)
    try:
        serve.start(http_options={"host": host, "port": port})
        for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own (abort)
            signal.signal(signum, lambda *_: stop.set())
        serve.run(build_application(setup), name=APP_NAME, route_prefix="/", blocking=False)
        count = setup.num_replicas if setup.autoscaling_config is None else "autoscaled"
        log.info("serving %s replicas of %r at http://%s:%d", count, setup.source.name, host, port)
        stop.wait()
        log.info("shutting down: the application drains (up to %.0f s)", setup.options.shutdown_timeout)
        drain_ingress(setup.options.shutdown_timeout)
        serve.delete(APP_NAME)
        if ray_address is None:
            serve.shutdown()
    finally:
        ray.shutdown()
    return 0
