"""``pagedgen bench serve --long-prompt-tokens N``: what running streams see while one long prompt arrives.

A few streams are started (greedy, EOS ignored, long outputs) and, once each has streamed a few tokens, one
prompt of ``N`` tokens is sent beside them. The figure that matters is the streams' inter-token latency
while that prompt is prefilled: every gap between two of a stream's chunks that overlaps the window from
the long prompt's send to its first token. A server that prefills the prompt in one huge step shows one
gap as long as the whole prefill; one that interleaves chunks with decode steps (``max_mixed_step_tokens``)
shows many short ones. Gaps before the send are the steady decode ITL, for reference. Once the long prompt
has its first token and every stream one more chunk, the streams are closed (the server cancels them).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedgen.bench.extras import require
from pagedgen.bench.serve import LatencyStats, chunk_has_text, parse_sse_line, record_dict, send_request
from pagedgen.bench.workloads import BenchRequest
from pagedgen.core.json_value import JsonObject

if TYPE_CHECKING:
    import httpx

POLL_S = 0.01  # how often the scenario looks at the streams' progress


@dataclass(slots=True)
class StreamWatch:
    """One running stream: absolute ``perf_counter`` times of its text chunks, and how it ended."""

    chunk_times: list[float] = field(default_factory=list)
    ended: bool = False  # the server finished it (all its tokens, or an error)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ArrivalSummary:
    """One run of the scenario: the streams' gaps during and before the long prompt's prefill."""

    label: str
    long_prompt_tokens: int
    streams: int
    long_ttft_s: float | None  # the long prompt's time to its first token
    itl_during: LatencyStats  # stream gaps that overlap [long prompt sent, its first token]
    itl_before: LatencyStats  # stream gaps that ended before the long prompt was sent
    stream_tokens_during: int  # stream chunks that arrived inside that window
    errors: tuple[str, ...] = ()

    def to_dict(self) -> JsonObject:
        return record_dict(self)


def split_gaps(chunk_times: Sequence[float], sent: float, first: float) -> tuple[list[float], list[float]]:
    """``(during, before)``: the gaps between consecutive chunks that overlap ``[sent, first]``, and those
    that ended at or before ``sent``."""
    during, before = [], []
    for a, b in zip(chunk_times, chunk_times[1:], strict=False):
        if b <= sent:
            before.append(b - a)
        elif a < first:
            during.append(b - a)
    return during, before


def summarize_arrival(
    label: str,
    long_prompt_tokens: int,
    watches: Sequence[StreamWatch],
    sent: float,
    long_ttft_s: float | None,
    errors: Sequence[str] = (),
) -> ArrivalSummary:
    """The statistics of one run (times absolute, as recorded); without a first token the window is open."""
    first = math.inf if long_ttft_s is None else sent + long_ttft_s
    during: list[float] = []
    before: list[float] = []
    inside = 0
    for watch in watches:
        d, b = split_gaps(watch.chunk_times, sent, first)
        during += d
        before += b
        inside += sum(sent < t <= first for t in watch.chunk_times)
    return ArrivalSummary(
        label,
        long_prompt_tokens,
        len(watches),
        long_ttft_s,
        LatencyStats.of(during),
        LatencyStats.of(before),
        inside,
        tuple(errors),
    )


async def _watch_stream(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    request: BenchRequest,
    headers: dict[str, str],
    watch: StreamWatch,
) -> None:
    body = {
        "model": model,
        "prompt": list(request.prompt_ids),
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                watch.error = f"HTTP {response.status_code}: {text}"
                return
            async for line in response.aiter_lines():
                payload = parse_sse_line(line)
                if payload is not None and chunk_has_text(payload):
                    watch.chunk_times.append(time.perf_counter())
    except Exception as exc:  # network errors are results, not crashes
        watch.error = f"{type(exc).__name__}: {exc}"
    finally:
        watch.ended = True


async def _until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``condition()`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.perf_counter() + timeout_s
    while not condition():
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True


async def run_arrival(
    base_url: str,
    model: str,
    streams: Sequence[BenchRequest],
    long_request: BenchRequest,
    *,
    label: str = "",
    api_key: str | None = None,
    warmup_tokens: int = 4,
    timeout_s: float = 600.0,
) -> ArrivalSummary:
    """Start ``streams``, wait for ``warmup_tokens`` chunks of each, send ``long_request``, then close the
    streams once the long prompt has its first token and each stream one chunk after it. Never raises for
    a failed request: what went wrong is in ``errors``."""
    httpx = require("httpx", "pagedgen bench serve")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/completions"
    watches = [StreamWatch() for _ in streams]
    errors: list[str] = []
    limits = httpx.Limits(max_connections=len(streams) + 1)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        tasks = [
            asyncio.create_task(_watch_stream(client, url, model, r, headers, w))
            for r, w in zip(streams, watches, strict=True)
        ]
        try:
            if not await _until(
                lambda: all(w.ended or len(w.chunk_times) >= warmup_tokens for w in watches), timeout_s
            ):
                errors.append(f"the streams did not reach {warmup_tokens} tokens within {timeout_s:g} s")
            sent = time.perf_counter()
            result = await send_request(client, url, model, long_request, headers)
            if not result.ok:
                errors.append(f"long prompt: {result.error}")
            if result.ttft_s is not None:
                first = sent + result.ttft_s
                await _until(lambda: all(w.ended or w.chunk_times[-1] > first for w in watches), timeout_s)
                if any(w.ended and w.chunk_times[-1:] < [first] for w in watches):
                    errors.append(
                        "a stream ended before the long prompt's first token (raise --stream-tokens)"
                    )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    errors += sorted({f"stream: {w.error}" for w in watches if w.error})
    return summarize_arrival(label, len(long_request.prompt_ids), watches, sent, result.ttft_s, errors)


def format_arrival(summary: ArrivalSummary) -> str:
    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value:.0f}"

    during, before = summary.itl_during, summary.itl_before
    ttft = "—" if summary.long_ttft_s is None else f"{summary.long_ttft_s:.2f} s"
    lines = [
        f"{summary.label}: {summary.long_prompt_tokens}-token prompt beside {summary.streams} stream(s): "
        f"its TTFT {ttft}; the streams got {summary.stream_tokens_during} tokens meanwhile",
        f"  stream ITL while it prefilled: p50 {ms(during.p50_ms)}  p99 {ms(during.p99_ms)}  "
        f"max {ms(during.max_ms)} ms ({during.count} gaps); before it: p50 {ms(before.p50_ms)} ms",
    ]
    lines += [f"  error: {e}" for e in summary.errors]
    return "\n".join(lines)


def arrival_table(summaries: Sequence[ArrivalSummary]) -> str:
    """A markdown table, one row per run."""
    head = "| server | long-prompt TTFT (s) | stream tokens meanwhile | ITL p50 (ms) | p99 (ms) | max (ms) |"
    rows = [head, "|---|---|---|---|---|---|"]
    for s in summaries:
        cells = [s.itl_during.p50_ms, s.itl_during.p99_ms, s.itl_during.max_ms]
        ttft = "—" if s.long_ttft_s is None else f"{s.long_ttft_s:.1f}"
        rows.append(
            f"| {s.label} | {ttft} | {s.stream_tokens_during} | "
            + " | ".join("—" if c is None else f"{c:.0f}" for c in cells)
            + " |"
        )
    return "\n".join(rows)
