"""What one system's run of one workload produced, and the one JSON record it becomes.

A system runner returns a :class:`SystemRun` (token outputs, wall time, cache use) or raises
:class:`SystemSkipped` with the reason it cannot run here; :func:`make_record` turns either into a
:class:`BenchRecord`, the unit of the JSON output (one record per system and workload). Every record's greedy
outputs, pagedgen's included, are compared with the fp32 reference by :func:`match_stats`, and the record
names that reference in ``reference`` (``bench throughput`` uses pagedgen's own run, in fp32, tested token
for token against transformers). The matched part of a request is its common prefix with the reference,
because once two greedy decodes diverge (a near-tie flipped by float rounding) every later token legitimately
differs. Every record also carries the CPU flags of the machine it ran on.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from pagedgen.bench.cpu import cpu_flags
from pagedgen.bench.workloads import BenchRequest, workload_totals
from pagedgen.core.json_value import JsonObject


class RunStatus(enum.Enum):
    OK = "ok"
    SKIPPED = "skipped"  # the system cannot run in this environment; ``reason`` says why
    FAILED = "failed"  # it started and raised; ``reason`` holds the error


class SystemSkipped(Exception):
    """A baseline cannot run here (not importable, unsupported on this device); the message is the reason."""


@dataclass(slots=True)
class SystemRun:
    """One system's completed run: ``outputs[i]`` are request i's generated token ids."""

    outputs: list[list[int]]
    wall_s: float
    kv_blocks_used: int | None = None  # peak blocks held at once (paged systems)
    kv_blocks_total: int | None = None
    details: JsonObject = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class MatchStats:
    """Greedy agreement with the reference: tokens in common prefixes, and requests identical throughout."""

    matched_tokens: int
    compared_tokens: int
    exact_requests: int
    num_requests: int

    @property
    def rate(self) -> float:
        return self.matched_tokens / self.compared_tokens if self.compared_tokens else 1.0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def match_stats(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> MatchStats:
    """Compare per request; ``compared_tokens`` counts ``reference``'s tokens. Raises on a count mismatch."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(candidate)} outputs to compare with {len(reference)} reference outputs")
    matched = sum(common_prefix(r, c) for r, c in zip(reference, candidate, strict=True))
    exact = sum(list(r) == list(c) for r, c in zip(reference, candidate, strict=True))
    return MatchStats(matched, sum(len(r) for r in reference), exact, len(reference))


@dataclass(slots=True)
class BenchRecord:
    """One system on one workload: the JSON record (``to_dict``) and one row of the markdown table."""

    workload: str
    system: str
    status: RunStatus
    reason: str | None
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float | None = None
    requests_per_s: float | None = None
    output_tokens_per_s: float | None = None
    total_tokens_per_s: float | None = None
    roofline_fraction: float | None = None
    peak_rss_bytes: int | None = None
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    match_rate: float | None = None  # greedy agreement with ``reference`` (None: no reference, or no run)
    matched_tokens: int | None = None
    compared_tokens: int | None = None
    exact_match_requests: int | None = None
    reference: str | None = None  # the fp32 run the match is against, e.g. "pagedgen fp32"
    cpu_flags: list[str] = field(default_factory=list)  # pagedgen.bench.cpu.RELEVANT flags this CPU has
    details: JsonObject = field(default_factory=dict)

    def to_dict(self) -> JsonObject:
        record = asdict(self)
        record["status"] = self.status.value
        return record


def make_record(
    workload: str,
    system: str,
    requests: Sequence[BenchRequest],
    run: SystemRun | None,
    *,
    status: RunStatus = RunStatus.OK,
    reason: str | None = None,
    model_flops: float | None = None,
    peak_flops: float | None = None,
    peak_rss_bytes: int | None = None,
    reference: Sequence[Sequence[int]] | None = None,
    reference_name: str | None = None,
) -> BenchRecord:
    """The record of a run (``run`` given, status OK) or of a skip/failure (``run`` None, ``reason`` given).

    Throughput counts the tokens the workload asked for (a static batch's extra tokens are waste, not output).
    ``roofline_fraction`` is ``model_flops / wall_s / peak_flops`` when both are known; the match against
    ``reference`` (outputs per request, named ``reference_name``) is filled in when it is given.
    """
    prompt_tokens, output_tokens = workload_totals(requests)
    record = BenchRecord(workload, system, status, reason, len(requests), prompt_tokens, output_tokens)
    record.cpu_flags = list(cpu_flags())
    if run is None:
        if status is RunStatus.OK:
            raise ValueError("a record without a run must be SKIPPED or FAILED")
        return record
    for i, (request, tokens) in enumerate(zip(requests, run.outputs, strict=True)):
        if len(tokens) != request.output_len:
            raise ValueError(
                f"{system}: request {i} produced {len(tokens)} tokens, the workload asked for "
                f"{request.output_len}"
            )
    wall = run.wall_s
    record.wall_s = wall
    record.requests_per_s = len(requests) / wall
    record.output_tokens_per_s = output_tokens / wall
    record.total_tokens_per_s = (prompt_tokens + output_tokens) / wall
    if model_flops is not None and peak_flops:
        record.roofline_fraction = model_flops / wall / peak_flops
    record.peak_rss_bytes = peak_rss_bytes
    record.kv_blocks_used, record.kv_blocks_total = run.kv_blocks_used, run.kv_blocks_total
    if reference is not None:
        stats = match_stats(reference, run.outputs)
        record.match_rate = stats.rate
        record.matched_tokens, record.compared_tokens = stats.matched_tokens, stats.compared_tokens
        record.exact_match_requests = stats.exact_requests
        record.reference = reference_name
    record.details = dict(run.details)
    return record
