"""bench serve: Poisson arrivals, latency statistics on synthetic records, SSE parsing, one live run
against the real server on the synthetic model (exact token counts; no latency value is asserted), and the
long-prompt arrival scenario (its gap arithmetic exactly, a live run for structure, the launcher)."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading

import numpy as np
import pytest

import pagedgen as pg
from pagedgen.bench.arrival import (
    StreamWatch,
    arrival_table,
    format_arrival,
    run_arrival,
    split_gaps,
    summarize_arrival,
)
from pagedgen.bench.cli import main
from pagedgen.bench.launch import free_port, launch, serve_command
from pagedgen.bench.serve import (
    LatencyStats,
    RequestResult,
    chunk_has_text,
    format_summary,
    parse_sse_line,
    poisson_arrivals,
    run_rate,
    served_model_name,
    summarize,
)
from pagedgen.bench.workloads import LengthRange, WorkloadSpec, build_workload
from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer
from pagedgen.server.app import ServerOptions, build_app
from tests.server.doubles import wait_until
from tests.server.live import LiveServer

VOCAB = 257  # SyntheticModel's default, so '--tokenizer synthetic' matches the server


def test_poisson_arrivals_are_seeded_cumulated_exponential_gaps():
    arrivals = poisson_arrivals(4.0, 6, seed=7)
    gaps = np.random.default_rng(7).exponential(0.25, size=6)
    assert arrivals == pytest.approx(list(np.cumsum(gaps) - gaps[0]))
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert poisson_arrivals(4.0, 6, seed=7) == arrivals
    assert poisson_arrivals(math.inf, 3) == [0.0, 0.0, 0.0]
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="request rate must be > 0"):
            poisson_arrivals(bad, 2)


def _result(index, chunks, e2e, tokens, ok=True, error=None):
    return RequestResult(index, 10, ok, error, tokens, list(chunks), e2e)


def test_summary_statistics_are_exact():
    results = [
        _result(0, [0.1, 0.2, 0.4], 0.5, 5),  # TTFT 0.1, ITL 0.1 0.2, TPOT (0.5-0.1)/4 = 0.1
        _result(1, [0.3, 0.35], 0.6, 3),  # TTFT 0.3, ITL 0.05, TPOT (0.6-0.3)/2 = 0.15
        _result(2, [0.2], 0.2, 1),  # TTFT 0.2, no ITL, no TPOT (one token)
        _result(3, [], 0.0, 0, ok=False, error="HTTP 503: busy"),
    ]
    s = summarize(results, duration_s=2.0, request_rate=4.0, max_concurrency=8)
    assert (s.completed, s.failed, s.prompt_tokens, s.output_tokens) == (3, 1, 30, 9)
    assert s.requests_per_s == 1.5 and s.output_tokens_per_s == 4.5 and s.total_tokens_per_s == 19.5
    assert s.ttft.mean_ms == pytest.approx(200.0) and s.ttft.p50_ms == pytest.approx(200.0)
    assert s.ttft.count == 3 and s.itl.count == 3 and s.tpot.count == 2 and s.e2e.count == 3
    assert s.itl.mean_ms == pytest.approx((100 + 200 + 50) / 3)
    assert s.tpot.mean_ms == pytest.approx(125.0)
    assert s.e2e.p90_ms == pytest.approx(float(np.percentile([500, 600, 200], 90)))
    assert s.errors == ("HTTP 503: busy",)
    data = s.to_dict()
    assert data["ttft"]["count"] == 3 and data["request_rate"] == 4.0 and data["errors"] == ["HTTP 503: busy"]
    assert json.loads(json.dumps(data)) == data


def test_empty_statistics_and_inf_rate():
    assert LatencyStats.of([]) == LatencyStats(None, None, None, None, 0)
    s = summarize([], duration_s=0.0, request_rate=math.inf, max_concurrency=None)
    assert s.completed == 0 and s.to_dict()["request_rate"] == "inf"


def test_sse_lines():
    assert parse_sse_line('data: {"choices": [{"text": "a"}]}') == {"choices": [{"text": "a"}]}
    assert parse_sse_line("data: [DONE]") is None
    assert parse_sse_line(": keep-alive") is None and parse_sse_line("") is None
    assert chunk_has_text({"choices": [{"text": "x"}]})
    assert not chunk_has_text({"choices": [{"text": ""}]}) and not chunk_has_text(
        {"choices": [], "usage": {}}
    )


@pytest.fixture(scope="module")
def synthetic_server():
    config = pg.EngineConfig(max_batch_size=8, num_blocks=128)
    app = build_app(
        SyntheticModel(vocab_size=VOCAB),
        config,
        ServerOptions(model_name="synthetic"),
        tokenizer=SyntheticTokenizer(VOCAB),
    )
    server = LiveServer(app).start()
    yield server
    server.stop()


def test_live_run_against_the_server_counts_every_token(synthetic_server):
    spec = WorkloadSpec("live", 6, LengthRange(4, 30), LengthRange(2, 12), seed=2)
    requests = build_workload(spec, SyntheticTokenizer(VOCAB))
    assert asyncio.run(served_model_name(synthetic_server.url)) == "synthetic"
    summary = asyncio.run(run_rate(synthetic_server.url, "synthetic", requests, 50.0, 3))
    assert (summary.completed, summary.failed) == (6, 0)
    assert summary.output_tokens == sum(r.output_len for r in requests)
    assert summary.prompt_tokens == sum(len(r.prompt_ids) for r in requests)
    assert summary.ttft.count == 6 and summary.e2e.count == 6
    assert summary.itl.count == sum(r.output_len - 1 for r in requests)  # one text chunk per token


def test_unreachable_server_is_a_failure_not_a_crash():
    requests = build_workload(
        WorkloadSpec("x", 2, LengthRange(3, 3), LengthRange(2, 2)), SyntheticTokenizer(VOCAB)
    )
    summary = asyncio.run(run_rate("http://127.0.0.1:9", "m", requests, math.inf, None, timeout_s=5.0))
    assert (summary.completed, summary.failed) == (0, 2) and summary.errors[0].startswith("ConnectError")


def test_cli_serve_writes_summaries(synthetic_server, tmp_path):
    out = tmp_path / "serve.json"
    argv = ["serve", "--base-url", synthetic_server.url, "--tokenizer", "synthetic", "--num-prompts", "3"]
    argv += ["--input-len", "5", "--output-len", "4", "--request-rate", "20", "40", "--json", str(out)]
    assert main(argv) == 0
    document = json.loads(out.read_text())
    assert document["model"] == "synthetic"
    assert [(s["request_rate"], s["completed"], s["failed"]) for s in document["summaries"]] == [
        (20.0, 3, 0),
        (40.0, 3, 0),
    ]
    assert [s["output_tokens"] for s in document["summaries"]] == [12, 12]
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_429s_count_as_rejected_not_failed():
    rejected = RequestResult(1, 10, False, "HTTP 429: queue full", rejected=True)
    results = [_result(0, [0.1], 0.1, 1), rejected, _result(2, [], 0.0, 0, ok=False, error="HTTP 500: x")]
    s = summarize(results, duration_s=1.0, request_rate=8.0, max_concurrency=None)
    assert (s.completed, s.rejected, s.failed) == (1, 1, 1)
    assert s.errors == ("HTTP 500: x",) and s.to_dict()["rejected"] == 1
    assert "1 rejected (429)" in format_summary(s)


def test_arrival_gaps_split_at_the_long_prompts_window():
    # Chunks at 1, 2, 3 (before the send at 3.5), 5, 9 (inside the window up to the first token at 9.5), 10.
    during, before = split_gaps([1.0, 2.0, 3.0, 5.0, 9.0, 10.0], sent=3.5, first=9.5)
    assert before == [1.0, 1.0] and during == [2.0, 4.0, 1.0]
    watches = [StreamWatch([1.0, 2.0, 3.0, 5.0, 9.0, 10.0]), StreamWatch([3.4, 9.6])]
    s = summarize_arrival("x", 4096, watches, sent=3.5, long_ttft_s=6.0)
    assert (s.streams, s.stream_tokens_during, s.long_ttft_s) == (2, 2, 6.0)  # 5.0 and 9.0
    assert s.itl_during.count == 4 and s.itl_during.max_ms == pytest.approx(6200.0)
    assert s.itl_before.count == 2 and s.itl_before.p50_ms == pytest.approx(1000.0)
    data = s.to_dict()
    assert data["itl_during"]["max_ms"] == pytest.approx(6200.0) and json.loads(json.dumps(data)) == data
    assert "| x | 6.0 | 2 |" in arrival_table([s]) and "6200" in format_arrival(s)
    empty = summarize_arrival("y", 8, [StreamWatch([1.0, 2.0])], sent=1.5, long_ttft_s=None, errors=["e"])
    assert empty.itl_during.count == 1 and empty.errors == ("e",)  # no first token: the window stays open


@pytest.fixture(scope="module")
def roomy_server():
    """Room for two long streams and a long prompt at once (the default engine budgets)."""
    config = pg.EngineConfig(max_batch_size=8, num_blocks=512)
    app = build_app(
        SyntheticModel(vocab_size=VOCAB),
        config,
        ServerOptions(model_name="synthetic"),
        tokenizer=SyntheticTokenizer(VOCAB),
    )
    server = LiveServer(app).start()
    yield server
    server.stop()


def _settled_free_blocks(server, disconnects: int) -> int:
    """Free blocks once the server has noticed ``disconnects`` closed streams and applied their cancels.

    The event loop sees a closed socket on its own schedule, after the client has returned; a stream
    counts its disconnect only after queueing its cancel, so a sync after the count sees the cancel applied.
    """
    state = server.server.config.app.state
    counter = state.metrics.disconnects
    wait_until(lambda: counter._value.get() >= disconnects, f"the server noticed {disconnects} disconnects")
    done = threading.Event()
    state.worker.sync(lambda _snapshot: done.set())
    assert done.wait(timeout=120)
    return state.worker.snapshot.free_blocks


def test_arrival_against_the_server_sees_the_streams_around_the_long_prompt(roomy_server):
    tokenizer = SyntheticTokenizer(VOCAB)
    streams = build_workload(WorkloadSpec("s", 2, LengthRange(16, 16), LengthRange(2000, 2000)), tokenizer)
    long_request = build_workload(
        WorkloadSpec("l", 1, LengthRange(1500, 1500), LengthRange(1, 1)), tokenizer
    )[0]
    disconnects = roomy_server.server.config.app.state.metrics.disconnects._value.get()
    s = asyncio.run(run_arrival(roomy_server.url, "synthetic", streams, long_request, label="synthetic"))
    assert s.errors == () and s.long_prompt_tokens == 1500 and s.streams == 2
    assert s.long_ttft_s is not None
    assert s.itl_before.count >= 2 * 3  # four warm-up chunks per stream before the send
    assert s.itl_during.count >= 2  # at least the gap of each stream that spans the window
    # The closed streams were cancelled and their blocks freed.
    assert _settled_free_blocks(roomy_server, disconnects + 2) == 512


def test_cli_serve_long_prompt_scenario_writes_runs(roomy_server, tmp_path, capsys):
    out = tmp_path / "arrival.json"
    argv = [
        "serve",
        "--base-url",
        roomy_server.url,
        "--tokenizer",
        "synthetic",
        "--long-prompt-tokens",
        "600",
    ]
    argv += ["--streams", "1", "--stream-tokens", "2000", "--repeats", "2", "--json", str(out)]
    assert main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["repeat"], r["label"], r["long_prompt_tokens"], r["errors"]) for r in runs] == [
        (0, roomy_server.url, 600, []),
        (1, roomy_server.url, 600, []),
    ]
    assert all(len(r["load_average"]) == 3 and r["itl_during"]["count"] >= 1 for r in runs)
    assert "| ITL p50 (ms) |" in capsys.readouterr().out


def test_launch_command_and_a_server_that_exits():
    command = serve_command("default", 8123, 512, ["--max-batch-size", "8"])
    assert command[1:] == ["-m", "pagedgen.cli", "serve", "--model", "default", "--host", "127.0.0.1"] + [
        "--port",
        "8123",
        "--log-level",
        "warning",
        "--max-mixed-step-tokens",
        "512",
        "--max-batch-size",
        "8",
    ]
    assert "--max-mixed-step-tokens" not in serve_command("default", 8123, None)
    with pytest.raises(RuntimeError, match="exited with status 3"):
        launch("broken", [sys.executable, "-c", "raise SystemExit(3)"], free_port(), timeout_s=60)
