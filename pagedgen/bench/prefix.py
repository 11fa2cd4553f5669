"""``pagedgen bench prefix``: what automatic prefix caching saves, with caching on and off in one run.

Why both runs on fresh engines over the same loaded model, with the same requests in the same closed-loop
arrival pattern: then the only difference between them is the cache, and the two runs must generate identical
tokens (checked). docs/performance.md, "Module notes: ops and bench", has the rest.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedgen.bench.workloads import text_tokens
from pagedgen.core.json_value import JsonObject
from pagedgen.errors import EngineError

if TYPE_CHECKING:
    from pagedgen.bench.loaded import BenchModel, BenchTokenizer
    from pagedgen.engine.config import EngineConfig
    from pagedgen.engine.engine import Engine
    from pagedgen.engine.request import Request

SHARED_PROMPT = "shared-prompt"
MULTI_TURN = "multi-turn"
WORKLOADS = (SHARED_PROMPT, MULTI_TURN)


@dataclass(frozen=True, slots=True)
class PrefixWorkload:
    """Clients, each a sequence of turns ``(new input ids, output length)``; ``keep_history``: a turn's
    prompt is the client's whole conversation so far plus its input (else the shared ``system`` prefix
    plus its input)."""

    name: str
    system: tuple[int, ...]
    clients: tuple[tuple[tuple[tuple[int, ...], int], ...], ...]
    keep_history: bool

    @property
    def num_requests(self) -> int:
        return sum(len(turns) for turns in self.clients)

    def describe(self) -> str:
        turns = {len(t) for t in self.clients}
        return (
            f"{len(self.clients)} clients x {'/'.join(map(str, sorted(turns)))} turns, system prompt "
            f"{len(self.system)} tokens, {'history re-sent' if self.keep_history else 'no history'}"
        )


def build_prefix_workload(
    name: str,
    tokenizer: BenchTokenizer,
    *,
    concurrency: int = 4,
    system_len: int = 1024,
    requests: int = 32,
    turns: int = 4,
    question_len: int = 24,
    output_len: int = 16,
) -> PrefixWorkload:
    """The named workload built from the benchmark text: deterministic for a given tokenizer.

    ``shared-prompt``: ``requests`` questions dealt round-robin to ``concurrency`` clients. ``multi-turn``:
    ``concurrency`` conversations of ``turns`` turns. Raises ValueError for an unknown name.
    """
    stream = text_tokens(tokenizer)
    need = system_len + question_len * (requests + concurrency * turns + 1)
    stream = stream * (1 + need // len(stream))
    system = tuple(stream[:system_len])

    def question(i: int) -> tuple[int, ...]:
        start = system_len + (i + 1) * question_len + i  # each its own window of the text
        return tuple(stream[start : start + question_len])

    if name == SHARED_PROMPT:
        clients = tuple(
            tuple((question(i), output_len) for i in range(c, requests, concurrency))
            for c in range(concurrency)
        )
        return PrefixWorkload(name, system, clients, keep_history=False)
    if name == MULTI_TURN:
        clients = tuple(
            tuple((question(c * turns + t), output_len) for t in range(turns)) for c in range(concurrency)
        )
        return PrefixWorkload(name, system, clients, keep_history=True)
    raise ValueError(f"unknown prefix workload {name!r}; workloads: {', '.join(WORKLOADS)}")


@dataclass(slots=True)
class PrefixRun:
    """One run of a workload: per request (client order, then turn order) its TTFT and output."""

    caching: bool
    ttft_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    prompt_tokens: int = 0
    prefill_computed: int = 0  # prompt tokens the engine computed (not served by the prefix cache)
    wall_s: float = 0.0

    def ttft_quantile(self, q: float) -> float:
        values = sorted(self.ttft_s)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    @property
    def ttft_p50(self) -> float:
        return statistics.median(self.ttft_s) if self.ttft_s else float("nan")

    def to_dict(self) -> JsonObject:
        return {
            "prefix_caching": self.caching,
            "requests": len(self.ttft_s),
            "ttft_p50_ms": 1e3 * self.ttft_p50,
            "ttft_p90_ms": 1e3 * self.ttft_quantile(0.9),
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens_computed": self.prefill_computed,
            "wall_s": self.wall_s,
        }


@dataclass(slots=True)
class _Client:
    turns: tuple[tuple[tuple[int, ...], int], ...]
    history: list[int]
    next_turn: int = 0
    request: Request | None = None
    submitted: float = 0.0
    first_token: bool = False
    slots: list[int] = field(default_factory=list)  # result index of each of its turns


def run_prefix_workload(model: BenchModel, workload: PrefixWorkload, config: EngineConfig) -> PrefixRun:
    """Run every client's turns to completion on a fresh Engine (closed loop); raises EngineError on a
    failure or a turn that ends before its output length."""
    from pagedgen.engine.engine import Engine

    engine = Engine(model, config)
    try:
        return _drive(engine, model, workload, config.prefix_caching)
    finally:
        engine.close()


def _drive(engine: Engine, model: BenchModel, workload: PrefixWorkload, caching: bool) -> PrefixRun:
    from pagedgen.engine.events import EngineEventFlags, FinishReason
    from pagedgen.engine.request import GeneratorParams, RequestOptions, TurnOptions

    params = GeneratorParams(model)
    params.set_search_options(do_sample=False, ignore_eos=True)
    run = PrefixRun(caching)
    clients = [_Client(turns, list(workload.system)) for turns in workload.clients]
    by_request: dict[int, _Client] = {}

    def submit(client: _Client) -> None:
        ids, output_len = client.turns[client.next_turn]
        prompt = client.history + list(ids)
        if workload.keep_history:
            client.history = prompt
        client.request = engine.create_request(params, RequestOptions())
        options = TurnOptions(client.request)
        options.set_max_generated_tokens(output_len)
        client.slots.append(len(run.outputs))
        run.outputs.append([])
        run.ttft_s.append(float("nan"))
        run.prompt_tokens += len(prompt)
        client.first_token = False
        client.submitted = time.perf_counter()
        client.request.begin_turn(prompt, options)
        by_request[id(client.request)] = client

    start = time.perf_counter()
    for client in clients:
        submit(client)
    buffer = engine.create_event_buffer(256)
    while engine.has_pending_requests():
        for event in engine.run(buffer):
            if event.request is None:
                if event.flags & EngineEventFlags.FAILED:
                    raise EngineError(f"the engine failed: {event.error_code.value}")
                continue
            client = by_request[id(event.request)]
            slot = client.slots[-1]
            if event.token is not None:
                if not client.first_token:
                    run.ttft_s[slot] = time.perf_counter() - client.submitted
                    client.first_token = True
                run.outputs[slot].append(event.token)
            if event.flags & EngineEventFlags.TURN_FINISHED:
                if event.finish_reason is not FinishReason.MAX_GENERATED_TOKENS:
                    raise EngineError(f"a turn finished with {event.finish_reason.value}")
                run.prefill_computed += event.usage.prompt_tokens - event.usage.cached_prompt_tokens
                event.request.close()
                del by_request[id(event.request)]
                if workload.keep_history:
                    client.history += run.outputs[slot]
                client.next_turn += 1
                if client.next_turn < len(client.turns):
                    submit(client)
    run.wall_s = time.perf_counter() - start
    order = [slot for client in clients for slot in client.slots]  # submission order -> client, turn
    run.outputs = [run.outputs[slot] for slot in order]
    run.ttft_s = [run.ttft_s[slot] for slot in order]
    return run


@dataclass(slots=True)
class PrefixComparison:
    """Caching off and on for one workload, and whether they generated the same tokens."""

    workload: PrefixWorkload
    off: PrefixRun
    on: PrefixRun

    @property
    def identical(self) -> bool:
        return self.off.outputs == self.on.outputs

    def to_dict(self) -> JsonObject:
        return {
            "workload": self.workload.name,
            "description": self.workload.describe(),
            "off": self.off.to_dict(),
            "on": self.on.to_dict(),
            "ttft_p50_speedup": self.off.ttft_p50 / self.on.ttft_p50,
            "prefill_tokens_ratio": self.off.prefill_computed / max(1, self.on.prefill_computed),
            "wall_speedup": self.off.wall_s / self.on.wall_s,
            "identical_tokens": self.identical,
        }


def compare_caching(
    model: BenchModel, workload: PrefixWorkload, config: EngineConfig, log: Callable[[str], None] = print
) -> PrefixComparison:
    """Run ``workload`` with prefix caching off, then on (``config`` otherwise unchanged)."""
    import dataclasses

    runs = {}
    for caching in (False, True):
        runs[caching] = run_prefix_workload(
            model, workload, dataclasses.replace(config, prefix_caching=caching)
        )
        log(f"  caching {'on ' if caching else 'off'}: {_summary(runs[caching])}")
    return PrefixComparison(workload, runs[False], runs[True])


def _summary(run: PrefixRun) -> str:
    return (
        f"TTFT p50 {1e3 * run.ttft_p50:8.1f} ms, p90 {1e3 * run.ttft_quantile(0.9):8.1f} ms, prefill "
        f"computed {run.prefill_computed:6d} of {run.prompt_tokens:6d} tokens, wall {run.wall_s:6.2f} s"
    )


def markdown_table(comparisons: Sequence[PrefixComparison]) -> str:
    """One row per workload and setting, then the ratios (off / on)."""
    lines = [
        "| workload | prefix caching | TTFT p50 (ms) | TTFT p90 (ms) | prefill tokens computed | wall (s) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for c in comparisons:
        for run in (c.off, c.on):
            lines.append(
                f"| {c.workload.name} | {'on' if run.caching else 'off'} | {1e3 * run.ttft_p50:.1f} | "
                f"{1e3 * run.ttft_quantile(0.9):.1f} | {run.prefill_computed} of {run.prompt_tokens} | "
                f"{run.wall_s:.2f} |"
            )
    lines += ["", "| workload | TTFT p50 off/on | prefill computed off/on | wall off/on | identical tokens |"]
    lines.append("|---|---:|---:|---:|---|")
    for c in comparisons:
        d = c.to_dict()
        lines.append(
            f"| {c.workload.name} | {d['ttft_p50_speedup']:.2f}x | {d['prefill_tokens_ratio']:.2f}x | "
            f"{d['wall_speedup']:.2f}x | {'yes' if c.identical else 'NO'} |"
        )
    return "\n".join(lines)
