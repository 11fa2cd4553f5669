"""``pagedgen bench serve``: drive a running OpenAI-compatible server with Poisson arrivals; measure latency.

Like ``vllm bench serve``: request ``i`` is sent at the ``i``-th arrival of a Poisson process of
``request_rate`` per second (all at once for ``inf``), at most ``max_concurrency`` in flight, each a
streaming ``/v1/completions`` call with the workload's token-id prompt, greedy, EOS ignored and exactly its
output length. Per request it records the time to the first streamed token (TTFT), the gaps between streamed
chunks (ITL), the mean time per output token after the first (TPOT) and the end-to-end latency; failures
are counted, never retried. A 429 (the server's admission queue was full) counts as *rejected*, not failed:
under overload a server is meant to refuse work it cannot admit, and the latency of what it admitted is
what the statistics describe. The statistics are plain functions of those records, testable without a server.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedgen.bench.extras import require
from pagedgen.bench.workloads import BenchRequest
from pagedgen.core.json_value import JsonObject

if TYPE_CHECKING:
    import httpx

PERCENTILES = (50, 90, 99)


def poisson_arrivals(rate: float, count: int, seed: int = 0) -> list[float]:
    """Send offsets (seconds from the start) of ``count`` requests: cumulated exponential gaps, mean 1/rate.

    ``rate = inf`` sends everything at 0. Raises ValueError for a non-positive rate.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return [float(t) for t in np.cumsum(gaps) - gaps[0]]  # the first request goes at once


@dataclass(slots=True)
class RequestResult:
    """One request's timeline; times in seconds, ``chunk_times`` relative to its send time."""

    index: int
    prompt_tokens: int
    ok: bool = False
    error: str | None = None
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    rejected: bool = False  # answered 429: refused by admission control, not a failure

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per output token after the first (None with fewer than 2 tokens)."""
        ttft = self.ttft_s
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - ttft) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Mean, percentiles and maximum (milliseconds) of one latency metric; all None without samples."""

    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    count: int
    max_ms: float | None = None

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats:
        if not seconds:
            return cls(None, None, None, None, 0)
        ms = np.asarray(seconds, dtype=np.float64) * 1e3
        p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(float(ms.mean()), p50, p90, p99, len(seconds), float(ms.max()))


def record_dict(record: Any) -> JsonObject:
    """A slotted bench record as JSON-ready values: LatencyStats as dicts, tuples as lists, inf as None."""
    out: JsonObject = {}
    for name in record.__slots__:
        value = getattr(record, name)
        if isinstance(value, LatencyStats):
            value = {k: getattr(value, k) for k in value.__slots__}
        elif isinstance(value, tuple):
            value = list(value)
        out[name] = None if isinstance(value, float) and math.isinf(value) else value
    return out


@dataclass(frozen=True, slots=True)
class ServeSummary:
    """What one rate produced: counts, throughput over the run's duration, and the four latency metrics."""

    request_rate: float
    max_concurrency: int | None
    duration_s: float
    completed: int
    failed: int  # neither completed nor rejected
    prompt_tokens: int
    output_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    errors: tuple[str, ...] = ()
    rejected: int = 0  # answered 429 (admission queue full)

    def to_dict(self) -> JsonObject:
        out = record_dict(self)
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return out


def summarize(
    results: Sequence[RequestResult], duration_s: float, request_rate: float, max_concurrency: int | None
) -> ServeSummary:
    """Aggregate per-request records; throughput counts completed requests' tokens over ``duration_s``."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok and not r.rejected]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    span = duration_s if duration_s > 0 else float("nan")
    return ServeSummary(
        request_rate=request_rate,
        max_concurrency=max_concurrency,
        duration_s=duration_s,
        completed=len(done),
        failed=len(failed),
        prompt_tokens=prompt,
        output_tokens=output,
        requests_per_s=len(done) / span,
        output_tokens_per_s=output / span,
        total_tokens_per_s=(prompt + output) / span,
        ttft=LatencyStats.of([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=LatencyStats.of([r.tpot_s for r in done if r.tpot_s is not None]),
        itl=LatencyStats.of([gap for r in done for gap in r.itl_s]),
        e2e=LatencyStats.of([r.e2e_s for r in done]),
        errors=tuple(sorted({r.error or "unknown error" for r in failed})),
        rejected=sum(r.rejected for r in results),
    )


def parse_sse_line(line: str) -> JsonObject | None:
    """The JSON payload of a ``data: {...}`` SSE line; None for ``[DONE]``, comments and blank lines."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


def chunk_has_text(payload: JsonObject) -> bool:
    return any(choice.get("text") for choice in payload.get("choices") or ())


async def send_request(
    client: httpx.AsyncClient, url: str, model: str, request: BenchRequest, headers: dict[str, str]
) -> RequestResult:
    """One streaming completion; never raises (a failure is recorded in the result)."""
    result = RequestResult(request.index, len(request.prompt_ids))
    body = {
        "model": model,
        "prompt": list(request.prompt_ids),
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                result.error = f"HTTP {response.status_code}: {text}"
                result.rejected = response.status_code == 429
                return result
            async for line in response.aiter_lines():
                payload = parse_sse_line(line)
                if payload is None:
                    continue
                if chunk_has_text(payload):
                    result.chunk_times.append(time.perf_counter() - start)
                usage = payload.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens", 0))
        result.e2e_s = time.perf_counter() - start
        result.ok = result.output_tokens == request.output_len
        if not result.ok:
            result.error = f"got {result.output_tokens} output tokens, asked for {request.output_len}"
    except Exception as exc:  # network errors are results, not crashes
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_rate(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    request_rate: float,
    max_concurrency: int | None,
    *,
    api_key: str | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> ServeSummary:
    """Send every request at its Poisson arrival time (bounded by ``max_concurrency``) and summarise."""
    httpx = require("httpx", "pagedgen bench serve")

    arrivals = poisson_arrivals(request_rate, len(requests), seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=max_concurrency or len(requests))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(request: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            async with limit:
                return await send_request(client, url, model, request, headers)

        results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, arrivals, strict=True)))
        duration = time.perf_counter() - start
    return summarize(results, duration, request_rate, max_concurrency)


async def served_model_name(base_url: str, api_key: str | None = None) -> str:
    """The first model id ``GET /v1/models`` lists (raises RuntimeError if the server lists none)."""
    httpx = require("httpx", "pagedgen bench serve")

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


def format_summary(summary: ServeSummary) -> str:
    rate = "inf" if math.isinf(summary.request_rate) else f"{summary.request_rate:g}"
    lines = [
        f"rate {rate} req/s, concurrency {summary.max_concurrency or 'unbounded'}: "
        f"{summary.completed} ok, {summary.rejected} rejected (429), {summary.failed} failed "
        f"in {summary.duration_s:.2f} s; "
        f"{summary.requests_per_s:.2f} req/s, {summary.output_tokens_per_s:.1f} out tok/s, "
        f"{summary.total_tokens_per_s:.1f} total tok/s",
        "  metric      mean      p50      p90      p99      max  (ms)",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats: LatencyStats = getattr(summary, name)
        cells = [stats.mean_ms, stats.p50_ms, stats.p90_ms, stats.p99_ms, stats.max_ms]
        lines.append(f"  {name:<6}" + "".join("        —" if c is None else f"{c:9.1f}" for c in cells))
    for error in summary.errors:
        lines.append(f"  error: {error}")
    return "\n".join(lines)


def plot_latency_vs_rate(summaries: Sequence[ServeSummary], path: Path) -> bool:
    """TTFT / TPOT / E2E (p50 and p99) against request rate; False with fewer than two finite rates."""
    points = [s for s in summaries if not math.isinf(s.request_rate) and s.completed]
    if len(points) < 2:
        return False
    require("matplotlib", "the latency chart").use("Agg")
    import matplotlib.pyplot as plt

    points.sort(key=lambda s: s.request_rate)
    rates = [s.request_rate for s in points]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, name in zip(axes, ("ttft", "tpot", "e2e"), strict=True):
        for pct in ("p50_ms", "p99_ms"):
            ax.plot(rates, [getattr(getattr(s, name), pct) for s in points], marker="o", label=pct[:3])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.legend(fontsize=8)
    fig.suptitle("pagedgen bench serve: latency vs request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
