"""/metrics of the replicated server: the ingress's outcomes and every replica's families, labelled."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedgen.server.metrics import ServerMetrics
from pagedgen.server.replicas.affinity import Route
from pagedgen.server.replicas.client import total_snapshot
from pagedgen.server.replicas.messages import ReplicaStats
from pagedgen.server.replicas.metrics import ReplicatedMetrics
from pagedgen.server.worker import EngineSnapshot


def _replica(name: str, free: int, prompt_tokens: int) -> ReplicaStats:
    metrics = ServerMetrics("m")
    snapshot = EngineSnapshot(total_blocks=10, free_blocks=free)
    metrics.bind(snapshot=lambda: snapshot, admitted=lambda: 0)
    metrics.on_started(prompt_tokens)
    return ReplicaStats(name, snapshot, metrics.render(), True)


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_every_replica_s_families_carry_its_label_and_the_ingress_keeps_its_outcomes():
    replicas = {"r1": _replica("r1", 7, 30), "r2": _replica("r2", 10, 5)}
    ingress = ReplicatedMetrics("m", lambda: replicas, lambda: {Route.PREFIX: 3, Route.NEW: 1})
    ingress.on_success("stop")
    ingress.bind(snapshot=lambda: total_snapshot([s.snapshot for s in replicas.values()]), admitted=lambda: 2)
    samples = _samples(ingress.render())
    assert samples[("pagedgen:kv_cache_blocks_free", (("model_name", "m"), ("replica", "r1")))] == 7
    assert samples[("pagedgen:kv_cache_blocks_free", (("model_name", "m"), ("replica", "r2")))] == 10
    assert samples[("pagedgen:prompt_tokens_total", (("model_name", "m"), ("replica", "r1")))] == 30
    assert samples[("pagedgen:prompt_tokens_total", (("model_name", "m"), ("replica", "r2")))] == 5
    success = ("pagedgen:request_success_total", (("finished_reason", "stop"), ("model_name", "m")))
    assert samples[success] == 1
    assert samples[("pagedgen:num_requests_admitted", (("model_name", "m"),))] == 2
    assert samples[("pagedgen:num_replicas", (("model_name", "m"),))] == 2
    routed = {
        dict(labels)["route"]: value
        for (name, labels), value in samples.items()
        if name == "pagedgen:routed_requests_total"
    }
    assert routed == {"prefix": 3, "balanced": 0, "new": 1, "random": 0}
    # no engine family from the ingress itself: each is reported once per replica
    assert [k for k in samples if k[0] == "pagedgen:kv_cache_blocks_total"] == [
        ("pagedgen:kv_cache_blocks_total", (("model_name", "m"), ("replica", "r1"))),
        ("pagedgen:kv_cache_blocks_total", (("model_name", "m"), ("replica", "r2"))),
    ]


def test_the_application_snapshot_sums_the_replicas_and_is_healthy_while_one_is():
    a = EngineSnapshot(total_blocks=10, free_blocks=4, jobs=1, healthy=False)
    b = EngineSnapshot(total_blocks=10, free_blocks=9, jobs=2)
    total = total_snapshot([a, b])
    assert (total.total_blocks, total.free_blocks, total.jobs, total.healthy) == (20, 13, 3, True)
    assert not total_snapshot([a]).healthy and not total_snapshot([]).healthy
