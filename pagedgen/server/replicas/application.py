"""The replicated application: an ingress serving the single server's app, over N engine replicas.

:func:`build_application` turns a :class:`ReplicaSetup` into a Serve application (what ``serve.run`` takes);
:func:`builder` is the same from :class:`ApplicationArgs` (plain values, which Serve validates into it), for
``serve run`` / ``serve deploy`` with a YAML file (``deploy/serve.yaml``) or
``serve run pagedgen.server.replicas.application:builder model=default``.
The ingress deployment builds the FastAPI app with :func:`pagedgen.server.app.create_app` (the single
server's routes, guard and lifespan) over a :class:`ReplicaSetWorker` and the model's
:class:`~pagedgen.server.replicas.setup.ModelCard` (no weights); its ``drain`` is the single server's graceful
shutdown, which ``pagedgen serve --replicas`` calls before deleting the application; the replica deployment
(:class:`EngineReplica`) runs one engine per replica, routed by :class:`CacheAffinityRouter`.
"""

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from pagedgen.engine.config import EngineConfig
from pagedgen.llm import context_length
from pagedgen.server.app import ServerOptions, create_app
from pagedgen.server.lifecycle import DELIVERY_GRACE_S, drain
from pagedgen.server.replicas.client import ReplicaSetWorker
from pagedgen.server.replicas.metrics import ReplicatedMetrics
from pagedgen.server.replicas.registry import route_counts
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
# Serve's graceful_shutdown_timeout_s beyond --shutdown-timeout: the ingress's drain has ended every request
# by then (its wait, then DELIVERY_GRACE_S for the ended responses), so Serve never cuts one off itself.
SHUTDOWN_MARGIN_S = DELIVERY_GRACE_S + 5.0


def ingress_app(
    replicas: DeploymentHandle, setup: ReplicaSetup, app_name: str
) -> tuple[ReplicaSetWorker, FastAPI]:
    """The ingress's worker and the single server's app over it, built from the model's card: the
    replicas load the weights, the ingress reads only the config and tokenizer files."""
    card = setup.source.describe()
    capacity = setup.engine.max_batch_size * setup.max_replicas
    worker = ReplicaSetWorker(replicas, card, app_name, REPLICA_DEPLOYMENT, capacity)
    metrics = ReplicatedMetrics(
        setup.options.model_name,
        lambda: worker.replica_stats,
        lambda: route_counts(app_name, REPLICA_DEPLOYMENT),
    )
    app = create_app(
        worker,
        card.tokenizer,
        metrics,
        setup.options,
        context=context_length(card),
        vocab_size=card.vocab_size,
    )
    return worker, app


@serve.ingress()
class PagedgenIngress:
    """The HTTP entry: the single server's FastAPI app, its engine the replica deployment."""

    def __init__(self, replicas: DeploymentHandle, setup: ReplicaSetup, app_name: str):
        self.worker, self._app = ingress_app(replicas, setup, app_name)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app

    async def drain(self, timeout: float) -> None:
        """The single server's graceful shutdown: refuse new requests at once (503 ``shutting_down``, and
        ``/health`` says so), wait up to ``timeout`` s for those in flight, then end the rest with the
        ``shutting_down`` error (an error event in a stream, a 503 otherwise) and give those answers
        ``DELIVERY_GRACE_S`` to go out. It runs on the event loop that serves the app, as its requests do."""
        state = self._app.state
        await drain(state.admission, self.worker.abort, timeout, lambda: False)


def build_application(setup: ReplicaSetup, app_name: str = APP_NAME) -> Application:
    """The Serve application of ``setup`` (bind it with ``serve.run(app, name=app_name)``)."""
    shutdown = setup.options.shutdown_timeout + SHUTDOWN_MARGIN_S
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
        graceful_shutdown_timeout_s=shutdown,
    )
    if setup.autoscaling_config is not None:  # Serve's own settings, as given: they decide the count
        replica = replica.options(autoscaling_config=setup.autoscaling_config)
    else:
        replica = replica.options(num_replicas=setup.num_replicas)
    ingress = serve.deployment(PagedgenIngress, name=INGRESS_DEPLOYMENT).options(
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=REPLICA_MAX_ONGOING * setup.max_replicas,
        graceful_shutdown_timeout_s=shutdown,
    )
    return ingress.bind(replica.bind(setup.source, setup.engine, setup.options), setup, app_name)


class ApplicationArgs(BaseModel):
    """``serve run``'s application arguments (a YAML file's ``args``), checked by pydantic before anything
    starts: an unknown key or a value of the wrong type is an error naming it. Each means what the
    ``pagedgen serve`` option of the same name means (docs/replicas.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "default"
    weights: str = "native"
    served_model_name: str | None = None
    chat_template: str | None = None  # the synthetic model's (a real model brings its own)
    replicas: int = 2
    replica_cpus: float = 1.0
    autoscaling_config: AutoscalingConfig | None = None
    routing: str = "affinity"
    imbalance: int = 8
    max_batch_size: int | None = None
    num_blocks: int | None = None
    block_size: int | None = None
    api_key: str | None = None
    max_queued_requests: int | None = None
    shutdown_timeout: float | None = None
    app_name: str = APP_NAME

    def setup(self) -> ReplicaSetup:
        """The application these arguments describe (the unset engine and server fields keep their
        defaults)."""
        engine = {
            key: value
            for key in ("max_batch_size", "num_blocks", "block_size")
            if (value := getattr(self, key)) is not None
        }
        options = {
            key: value
            for key in ("api_key", "max_queued_requests", "shutdown_timeout")
            if (value := getattr(self, key)) is not None
        }
        return ReplicaSetup(
            source=ModelSource(self.model, self.weights, chat_template=self.chat_template),
            engine=EngineConfig(**engine),
            options=ServerOptions(model_name=self.served_model_name or self.model, **options),
            num_replicas=self.replicas,
            replica_cpus=self.replica_cpus,
            autoscaling_config=self.autoscaling_config,
            routing=self.routing,
            imbalance=self.imbalance,
        )


def builder(args: ApplicationArgs) -> Application:
    """``serve run``'s application builder (``deploy/serve.yaml``): Serve validates the YAML's ``args``
    into :class:`ApplicationArgs` (the annotation tells it to), then this builds the application."""
    return build_application(args.setup(), args.app_name)
