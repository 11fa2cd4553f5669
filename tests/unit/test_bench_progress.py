"""bench progress lines: throttled by an injected clock, and a real run on the synthetic model counts
exactly its workload's tokens and requests. No timing is asserted: the clock is a counter."""

from __future__ import annotations

from pagedgen.bench.progress import ProgressLine
from pagedgen.bench.throughput import PagedgenOptions, run_pagedgen
from pagedgen.bench.workloads import LengthRange, WorkloadSpec, build_workload
from pagedgen.models.synthetic import SyntheticModel


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_is_logged_only_once_the_interval_has_passed():
    clock, lines = FakeClock(), []
    progress = ProgressLine("pagedgen", 512, 4, lines.append, interval_s=10.0, clock=clock)
    clock.now = 105.0
    progress.advance(tokens=100)
    assert lines == []
    clock.now = 110.0
    progress.advance(tokens=100, finished=1)
    assert lines == ["  pagedgen       ... 200/512 tokens, 1/4 requests done, 10 s (20.0 tok/s)"]
    clock.now = 115.0
    progress.advance(tokens=12)
    assert len(lines) == 1
    clock.now = 120.5
    progress.advance(tokens=0, finished=3)
    assert lines[-1] == "  pagedgen       ... 212/512 tokens, 4/4 requests done, 20 s (10.3 tok/s)"


def test_a_run_reports_every_token_and_request_of_its_workload():
    model = SyntheticModel()
    spec = WorkloadSpec("tiny", 5, LengthRange(3, 12), LengthRange(2, 7), seed=3)
    requests = build_workload(spec, model.tokenizer)
    lines: list[str] = []
    progress = ProgressLine("pagedgen", sum(r.output_len for r in requests), len(requests), lines.append, 0.0)
    run = run_pagedgen(
        model, requests, PagedgenOptions(max_batch_size=2, num_blocks=32).engine_config(), progress=progress
    )
    assert progress.tokens == sum(map(len, run.run.outputs)) == progress.total_tokens
    assert progress.finished == len(requests)
    assert lines and lines[-1].startswith(
        f"  pagedgen       ... {progress.total_tokens}/{progress.total_tokens} tokens, 5/5"
    )
