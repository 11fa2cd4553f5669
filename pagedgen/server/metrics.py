"""Prometheus metrics of one server: engine levels, request outcome counters and latency histograms.

Outcomes and latencies are fed as requests progress; the engine's levels and step counts are read at
scrape time from the worker's published snapshot, never from the engine, so a scrape does not wait for a
step and still answers once the engine is unhealthy. docs/server.md, "Metrics", lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedgen.engine.events import FinishReason
from pagedgen.server.worker import EngineSnapshot

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0)

REJECT_REASONS = {401: "unauthorized", 413: "too_large", 429: "queue_full"}  # other 4xx: "invalid"
FAILURE_REASONS = {503: "unhealthy"}  # other 5xx: "internal"


_GAUGES = {
    "num_requests_running": "Requests generating (turn accepted by the engine, not queued).",
    "num_requests_waiting": "Requests queued in the engine, not yet scheduled.",
    "num_requests_admitted": "Requests admitted by the server whose response has not ended.",
    "kv_cache_blocks_total": "KV-cache blocks in the pool.",
    "kv_cache_blocks_used": "KV-cache blocks owned or reserved.",
    "kv_cache_blocks_free": "KV-cache blocks free.",
    "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (0..1).",
    "window_cache_blocks_total": "Sliding-window ring blocks in their pool (0 for a model without windows).",
    "window_cache_blocks_free": "Sliding-window ring blocks free (each resident owns one ring).",
    "fixed_state_slots_total": "Fixed conv/recurrent state slots (0 for a model without fixed state).",
    "fixed_state_slots_free": "Fixed conv/recurrent state slots free (each resident owns one).",
    "healthy": "1 while the engine is healthy, 0 once it failed.",
    "spec_decode_draft_acceptance_rate": "Accepted / verified speculative draft tokens (0 before any).",
    "num_requests_kept": "Finished Responses-API turns whose engine Request stays open for a follow-up.",
}
_COUNTERS = {
    "engine_steps": "Engine transactions committed.",
    "engine_rollbacks": "Engine transactions rolled back.",
    "spec_decode_num_draft_tokens": "Speculative draft tokens verified by committed steps.",
    "spec_decode_num_accepted_tokens": "Speculative draft tokens accepted.",
    "prefix_cache_queries": "Prompt tokens whose admission looked up the prefix cache.",
    "prefix_cache_hits": "Prompt tokens served from the prefix cache instead of computed.",
    "num_preemptions": "Running requests preempted (sent back to the queue, re-prefilled later).",
    "num_turns_resumed": "Follow-up turns (previous_response_id) continued in the previous turn's Request.",
}


class _EngineCollector(Collector):
    """Scrape-time samples from the latest published snapshot and the admission count."""

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name
        self.snapshot: Callable[[], EngineSnapshot] = EngineSnapshot
        self.admitted: Callable[[], int] = lambda: 0

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        levels = {
            "num_requests_running": max(snap.jobs - snap.queued_requests, 0),
            "num_requests_waiting": snap.queued_requests,
            "num_requests_admitted": self.admitted(),
            "kv_cache_blocks_total": snap.total_blocks,
            "kv_cache_blocks_used": snap.used_blocks,
            "kv_cache_blocks_free": snap.free_blocks,
            "kv_cache_usage_perc": snap.used_blocks / snap.total_blocks if snap.total_blocks else 0.0,
            "window_cache_blocks_total": snap.window_total_blocks,
            "window_cache_blocks_free": snap.window_free_blocks,
            "fixed_state_slots_total": snap.fixed_total_slots,
            "fixed_state_slots_free": snap.fixed_free_slots,
            "healthy": int(snap.healthy),
            "spec_decode_draft_acceptance_rate": (
                snap.drafts_accepted / snap.drafts_proposed if snap.drafts_proposed else 0.0
            ),
            "num_requests_kept": snap.kept_requests,
        }
        for name, value in levels.items():
            yield self._sample(
                GaugeMetricFamily(f"pagedgen:{name}", _GAUGES[name], labels=["model_name"]), value
            )
        counts = {
            "engine_steps": snap.steps,
            "engine_rollbacks": snap.rollbacks,
            "spec_decode_num_draft_tokens": snap.drafts_proposed,
            "spec_decode_num_accepted_tokens": snap.drafts_accepted,
            "prefix_cache_queries": snap.prefix_queried_tokens,
            "prefix_cache_hits": snap.prefix_hit_tokens,
            "num_preemptions": snap.preemptions,
            "num_turns_resumed": snap.resumed_turns,
        }
        for name, value in counts.items():
            family = CounterMetricFamily(f"pagedgen:{name}", _COUNTERS[name], labels=["model_name"])
            yield self._sample(family, value)

    def _sample(self, family: GaugeMetricFamily | CounterMetricFamily, value: float) -> Metric:
        family.add_metric([self._model_name], value)
        return family


class ServerMetrics:
    """The server's metrics; ``render()`` is the ``/metrics`` body in the Prometheus text format.

    Each server owns its ``CollectorRegistry`` (two servers in one process, as in the tests, do not
    collide). Counters and histograms are fed from the engine's owner thread (token counts, latencies) and
    by the routes once a response is decided (prometheus-client is thread-safe). Monotonic values are
    counters (``*_total``), gauges are levels only; the names are vLLM's with ``pagedgen:`` for ``vllm:``.
    """

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens delivered.")
        self._success = self._counter_family(
            "request_success", "Requests answered in full, by finish reason.", "finished_reason"
        )
        self._failure = self._counter_family(
            "request_failure", "Admitted requests that ended in a server-side error, by reason.", "reason"
        )
        self._rejected = self._counter_family(
            "request_rejected", "Requests refused with a 4xx before generating, by reason.", "reason"
        )
        self.cancelled = self._counter("request_cancelled", "Requests cancelled (client disconnect).")
        self.disconnects = self._counter(
            "client_disconnects", "Clients that left before their response ended."
        )
        self.ttft = self._histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.tpot = self._histogram(
            "time_per_output_token_seconds",
            "Mean time between output tokens of a finished request.",
            TPOT_BUCKETS,
        )
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(f"pagedgen:{name}", doc, ["model_name"], registry=self.registry).labels(
            self._model_name
        )

    def _counter_family(self, name: str, doc: str, label: str) -> Counter:
        return Counter(f"pagedgen:{name}", doc, ["model_name", label], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        metric = Histogram(f"pagedgen:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry)
        return metric.labels(self._model_name)

    def bind(self, snapshot: Callable[[], EngineSnapshot], admitted: Callable[[], int]) -> None:
        """Where scrapes read the engine's levels and the admission count (both cheap, never blocking)."""
        self._engine.snapshot = snapshot
        self._engine.admitted = admitted

    # owner-thread hooks (called by EngineWorker)

    def on_started(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_tokens(self, count: int) -> None:
        self.generation_tokens.inc(count)

    def on_finished(
        self,
        reason: FinishReason,
        arrived_at: float,
        first_token_at: float | None,
        num_tokens: int,
        now: float,
    ) -> None:
        """Latencies of a finished turn; whether the request succeeded is the route's call (on_success)."""
        self.e2e.observe(now - arrived_at)
        if first_token_at is not None and num_tokens > 1:
            self.tpot.observe((now - first_token_at) / (num_tokens - 1))

    def on_cancelled(self) -> None:
        self.cancelled.inc()

    # event-loop hooks (called by the guard and the routes)

    def on_disconnect(self) -> None:
        self.disconnects.inc()

    def on_success(self, finished_reason: str) -> None:
        self._success.labels(self._model_name, finished_reason).inc()

    def on_rejected(self, reason: str) -> None:
        self._rejected.labels(self._model_name, reason).inc()

    def on_failed(self, reason: str) -> None:
        self._failure.labels(self._model_name, reason).inc()

    def on_error_status(self, status: int) -> None:
        """Count a request answered with an error status: 4xx rejected, 5xx failed."""
        if status < 500:
            self.on_rejected(REJECT_REASONS.get(status, "invalid"))
        else:
            self.on_failed(FAILURE_REASONS.get(status, "internal"))

    # scrape

    def render(self) -> bytes:
        return generate_latest(self.registry)
