"""Prometheus metrics of one server: engine gauges, token counters and latency histograms.

Each server owns its own ``CollectorRegistry`` (two servers in one process, as in the tests, do not collide).
Counters and histograms are fed from the engine's owner thread as jobs progress (prometheus-client is
thread-safe); gauges are set from an :class:`EngineSnapshot` right before each scrape, because only the owner
thread may ask the engine for its stats. Names follow vLLM's (``vllm:`` becomes ``pagedgen:``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedgen.engine.events import FinishReason
from pagedgen.llm import finish_reason_text
from pagedgen.server.worker import EngineSnapshot

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0)


class ServerMetrics:
    """The server's metrics; ``render()`` is the ``/metrics`` body in the Prometheus text format."""

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(model_name)

        self.running = gauge("pagedgen:num_requests_running", "Requests generating (admitted, turn active).")
        self.waiting = gauge(
            "pagedgen:num_requests_waiting", "Requests queued in the engine, not yet admitted."
        )
        self.blocks_total = gauge("pagedgen:kv_cache_blocks_total", "KV-cache blocks in the pool.")
        self.blocks_used = gauge("pagedgen:kv_cache_blocks_used", "KV-cache blocks owned or reserved.")
        self.blocks_free = gauge("pagedgen:kv_cache_blocks_free", "KV-cache blocks free.")
        self.usage = gauge("pagedgen:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.steps = gauge("pagedgen:engine_steps", "Engine transactions run so far.")
        self.rollbacks = gauge("pagedgen:engine_rollbacks", "Engine transactions rolled back so far.")
        self.prompt_tokens = Counter(
            "pagedgen:prompt_tokens", "Prompt tokens of accepted requests.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "pagedgen:generation_tokens", "Generated tokens delivered.", labels, registry=reg
        ).labels(model_name)
        self._finished = Counter(
            "pagedgen:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self._model_name = model_name
        self.cancelled = Counter(
            "pagedgen:request_cancelled", "Requests cancelled (client disconnect).", labels, registry=reg
        ).labels(model_name)
        self.disconnects = Counter(
            "pagedgen:client_disconnects",
            "Clients that left before their response ended.",
            labels,
            registry=reg,
        ).labels(model_name)
        self.ttft = Histogram(
            "pagedgen:time_to_first_token_seconds",
            "Arrival to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.tpot = Histogram(
            "pagedgen:time_per_output_token_seconds",
            "Mean time between output tokens of a finished request.",
            labels,
            buckets=TPOT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.e2e = Histogram(
            "pagedgen:e2e_request_latency_seconds",
            "Arrival to finish.",
            labels,
            buckets=E2E_BUCKETS,
            registry=reg,
        ).labels(model_name)

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
        self._finished.labels(self._model_name, finish_reason_text(reason)).inc()
        self.e2e.observe(now - arrived_at)
        if first_token_at is not None and num_tokens > 1:
            self.tpot.observe((now - first_token_at) / (num_tokens - 1))

    def on_cancelled(self) -> None:
        self.cancelled.inc()

    # event-loop hook (called by the routes)

    def on_disconnect(self) -> None:
        self.disconnects.inc()

    # scrape

    def set_engine(self, snapshot: EngineSnapshot) -> None:
        self.running.set(max(snapshot.jobs - snapshot.queued_requests, 0))
        self.waiting.set(snapshot.queued_requests)
        self.blocks_total.set(snapshot.total_blocks)
        self.blocks_used.set(snapshot.used_blocks)
        self.blocks_free.set(snapshot.free_blocks)
        self.usage.set(snapshot.used_blocks / snapshot.total_blocks if snapshot.total_blocks else 0.0)
        self.steps.set(snapshot.steps)
        self.rollbacks.set(snapshot.rollbacks)

    def render(self) -> bytes:
        return generate_latest(self.registry)
