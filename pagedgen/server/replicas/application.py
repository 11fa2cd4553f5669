"""The replicated application: an ingress serving the single server's app, over N engine replicas.

:func:`build_application` turns a :class:`ReplicaSetup` into a Serve application (what ``serve.run`` takes);
:func:`builder` is the same from a dict of plain values, for ``serve run`` with a YAML file
(``deploy/serve.yaml``) or ``serve run pagedgen.server.replicas.application:builder model=default``.
The ingress deployment builds the FastAPI app with :func:`pagedgen.server.app.create_app` (the single
server's routes, guard and lifespan) over a :class:`ReplicaSetWorker`; the replica deployment
(:class:`EngineReplica`) runs one engine per replica, routed by :class:`CacheAffinityRouter`.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from pagedgen.engine.config import EngineConfig
from pagedgen.llm import context_length
from pagedgen.server.app import ServerOptions, create_app
from pagedgen.server.replicas.client import ReplicaSetWorker
from pagedgen.server.replicas.metrics import ReplicatedMetrics
from pagedgen.server.replicas.replica import EngineReplica
from pagedgen.server.replicas.router import CacheAffinityRouter
from pagedgen.server.replicas.setup import ModelSource, ReplicaSetup

APP_NAME = "pagedgen"
REPLICA_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "PagedgenIngress"
# The engine's admission queues requests itself: a replica takes up to this many calls at once (Serve's
# default of 5 would hold requests back at the router instead of batching them).
REPLICA_MAX_ONGOING = 1024
STATS_PERIOD_S = 1.0


@serve.ingress()
class PagedgenIngress:
    """The HTTP entry: the single server's FastAPI app, its engine the replica deployment."""

    def __init__(self, replicas: DeploymentHandle, setup: ReplicaSetup, app_name: str):
        model, tokenizer = setup.source.load()
        capacity = setup.engine.max_batch_size * setup.max_replicas
        self.worker = ReplicaSetWorker(replicas, model, app_name, REPLICA_DEPLOYMENT, capacity)
        metrics = ReplicatedMetrics(setup.options.model_name, lambda: self.worker.replica_stats)
        self._app = create_app(
            self.worker,  # type: ignore[arg-type]  # the EngineWorker interface, over the replicas
            tokenizer,
            metrics,
            setup.options,
            context=context_length(model),
            vocab_size=model.vocab_size,
        )

    def __serve_build_asgi_app__(self) -> Any:
        return self._app


def build_application(setup: ReplicaSetup, app_name: str = APP_NAME) -> Any:
    """The Serve application of ``setup`` (bind it with ``serve.run(app, name=app_name)``)."""
    shutdown = {"graceful_shutdown_timeout_s": setup.options.shutdown_timeout}
    scaling: dict[str, Any] = (
        {"autoscaling_config": setup.autoscaling_config}
        if setup.autoscaling_config is not None
        else {"num_replicas": setup.num_replicas}
    )
    router = RequestRouterConfig(
        request_router_class=CacheAffinityRouter,
        request_router_kwargs={
            "block_size": setup.engine.block_size,
            "imbalance": setup.imbalance,
            "routing": setup.routing,
        },
        request_routing_stats_period_s=STATS_PERIOD_S,
    )
    replica = serve.deployment(EngineReplica, name=REPLICA_DEPLOYMENT).options(
        ray_actor_options={"num_cpus": setup.replica_cpus},
        max_ongoing_requests=REPLICA_MAX_ONGOING,
        request_router_config=router,
        **scaling,
        **shutdown,
    )
    ingress = serve.deployment(PagedgenIngress, name=INGRESS_DEPLOYMENT).options(
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=REPLICA_MAX_ONGOING * setup.max_replicas,
        **shutdown,
    )
    return ingress.bind(replica.bind(setup.source, setup.engine, setup.options), setup, app_name)


def builder(args: dict[str, Any]) -> Any:
    """``serve run``'s application builder: plain values (YAML ``args``) into :func:`build_application`.

    Keys: ``model``, ``weights``, ``served_model_name``, ``replicas``, ``replica_cpus``,
    ``autoscaling_config`` (a mapping of Serve's fields), ``routing``, ``imbalance``, ``max_batch_size``,
    ``num_blocks``, ``block_size``, ``api_key``, ``max_queued_requests``, ``shutdown_timeout``,
    ``app_name``; an unknown key is an error naming it."""
    known = {
        "model", "weights", "served_model_name", "replicas", "replica_cpus", "autoscaling_config", "routing",
        "imbalance", "max_batch_size", "num_blocks", "block_size", "api_key", "max_queued_requests",
        "shutdown_timeout", "app_name",
    }  # fmt: skip
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown application argument(s) {unknown}; known: {sorted(known)}")
    model = str(args.get("model", "default"))
    engine = {key: args[key] for key in ("max_batch_size", "num_blocks", "block_size") if key in args}
    options = {
        key: args[key] for key in ("api_key", "max_queued_requests", "shutdown_timeout") if key in args
    }
    setup = ReplicaSetup(
        source=ModelSource(model, str(args.get("weights", "native"))),
        engine=EngineConfig(**engine),
        options=ServerOptions(model_name=str(args.get("served_model_name", model)), **options),
        num_replicas=int(args.get("replicas", 2)),
        replica_cpus=float(args.get("replica_cpus", 1.0)),
        autoscaling_config=args.get("autoscaling_config"),
        routing=str(args.get("routing", "affinity")),
        imbalance=int(args.get("imbalance", 8)),
    )
    return build_application(setup, str(args.get("app_name", APP_NAME)))
