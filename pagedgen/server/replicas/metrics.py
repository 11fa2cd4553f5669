"""``/metrics`` of the replicated application: the ingress's request outcomes and every replica's engine.

Each replica keeps the single server's :class:`~pagedgen.server.metrics.ServerMetrics` (token counts,
latencies, engine levels); the ingress keeps the request outcomes it decides (success, rejected, failed,
disconnects) and the admission level. A scrape renders the ingress's families and, from the last poll,
each replica's exposition with a ``replica`` label added to every sample, merged by family, plus
``pagedgen:num_replicas`` and the router's ``pagedgen:routed_requests`` by ``route`` (how each generation
call's replica was chosen: to its prefix's holder, balanced away from it, new, or random).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from pagedgen.server.metrics import ServerMetrics
from pagedgen.server.replicas.affinity import Route
from pagedgen.server.replicas.messages import ReplicaStats

# The families the ingress decides; every other family is an engine's, reported per replica.
INGRESS_FAMILIES = frozenset(
    {
        "pagedgen:request_success",
        "pagedgen:request_failure",
        "pagedgen:request_rejected",
        "pagedgen:client_disconnects",
        "pagedgen:num_requests_admitted",
    }
)


def merged_families(own: bytes, replicas: dict[str, ReplicaStats], model_name: str) -> list[Metric]:
    """The ingress's own families and the replicas' (labelled), one family per name."""
    merged: dict[str, Metric] = {}
    for family in text_string_to_metric_families(own.decode()):
        if family.name in INGRESS_FAMILIES:
            merged[family.name] = family
    for name in sorted(replicas):
        for family in text_string_to_metric_families(replicas[name].metrics.decode()):
            if family.name in INGRESS_FAMILIES:
                continue
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                labels = {**sample.labels, "replica": name}
                target.samples.append(Sample(sample.name, labels, sample.value, sample.timestamp))
    count = GaugeMetricFamily(
        "pagedgen:num_replicas", "Replicas answering the ingress.", labels=["model_name"]
    )
    count.add_metric([model_name], len(replicas))
    return [*merged.values(), count]


def routed_family(routes: Mapping[Route, int], model_name: str) -> Metric:
    """``pagedgen:routed_requests_total`` by ``route``: every route, zeros too."""
    family = CounterMetricFamily(
        "pagedgen:routed_requests",
        "Generation calls routed to a replica, by how it was chosen.",
        labels=["model_name", "route"],
    )
    for route in Route:
        family.add_metric([model_name, route.value], routes.get(route, 0))
    return family


class _Merged(Collector):
    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


class ReplicatedMetrics(ServerMetrics):
    """The ingress's metrics; ``render`` adds the replicas' from ``replicas()`` (the last poll) and the
    router's counts from ``routes()`` (read when scraped)."""

    def __init__(
        self,
        model_name: str,
        replicas: Callable[[], dict[str, ReplicaStats]],
        routes: Callable[[], Mapping[Route, int]],
    ):
        super().__init__(model_name)
        self._replicas = replicas
        self._routes = routes
        self._name = model_name

    def render(self) -> bytes:
        families = merged_families(super().render(), self._replicas(), self._name)
        registry = CollectorRegistry()
        registry.register(_Merged([*families, routed_family(self._routes(), self._name)]))
        return generate_latest(registry)
