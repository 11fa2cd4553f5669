"""``pagedgen bench guidance``: what constrained decoding costs a decode step, guided and unguided in one run.

A batch of ``batch`` chat requests (the same prompts in both modes) is prefilled untimed; then every engine
step while all of them are still decoding is timed, for ``output_len`` tokens. Guided runs constrain every
request with one JSON schema whose shortest valid output is longer than ``output_len`` tokens, so no guided
request finishes early and both modes time full batches; unguided runs ignore EOS for the same reason. Modes
alternate (unguided, guided, unguided, ...) so slow drift of a shared machine hits both. docs/performance.md,
"Module notes: ops and bench", has the rest.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedgen.core.json_value import JsonObject
from pagedgen.errors import EngineError

if TYPE_CHECKING:
    from pagedgen.bench.loaded import BenchModel, BenchTokenizer
    from pagedgen.engine.config import EngineConfig
    from pagedgen.engine.engine import Engine

# Six to eight small records: at least ~90 tokens, so a 64-token run never completes the grammar.
DEFAULT_SCHEMA: JsonObject = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 6,
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 3, "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string", "maxLength": 20},
                    "role": {"enum": ["engineer", "teacher", "doctor", "artist", "farmer"]},
                },
                "required": ["name", "age", "city", "role"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}
_TOPICS = ("a small village", "a hospital", "a school", "a software company", "an orchestra", "a farm")


@dataclass(slots=True)
class GuidanceRun:
    """One run of the batch: the timed decode steps and, for guided runs, the mask counters over them."""

    guided: bool
    step_s: list[float] = field(default_factory=list)
    mask_s: float = 0.0
    wait_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class GuidanceComparison:
    batch: int
    output_len: int
    runs: list[GuidanceRun]

    def median_step_ms(self, guided: bool) -> float:
        steps = [s for run in self.runs if run.guided is guided for s in run.step_s]
        return 1e3 * statistics.median(steps) if steps else float("nan")

    def per_step_ms(self, attribute: str) -> float:
        guided = [run for run in self.runs if run.guided]
        steps = sum(len(run.step_s) for run in guided)
        return 1e3 * sum(getattr(run, attribute) for run in guided) / steps if steps else float("nan")

    @property
    def overhead(self) -> float:
        return self.median_step_ms(True) / self.median_step_ms(False) - 1.0

    def to_dict(self) -> JsonObject:
        return {
            "batch": self.batch,
            "output_len": self.output_len,
            "repeats": sum(run.guided for run in self.runs),
            "unguided_step_ms_p50": self.median_step_ms(False),
            "guided_step_ms_p50": self.median_step_ms(True),
            "overhead": self.overhead,
            "mask_ms_per_step": self.per_step_ms("mask_s"),
            "mask_wait_ms_per_step": self.per_step_ms("wait_s"),
        }


def guidance_prompts(tokenizer: BenchTokenizer, batch: int) -> list[list[int]]:
    """``batch`` chat prompts asking for the schema's JSON (different topics, so outputs differ); plain
    text for a tokenizer without a chat template (the synthetic model's)."""
    prompts = []
    for i in range(batch):
        topic = _TOPICS[i % len(_TOPICS)]
        text = f"List the people of {topic} (#{i}) as JSON with name, age, city and role."
        if hasattr(tokenizer, "apply_chat_template"):
            prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True))
        else:
            prompts.append(tokenizer.encode(text))
    return prompts


def run_guidance_batch(
    model: BenchModel,
    prompts: list[list[int]],
    config: EngineConfig,
    schema: JsonObject | None,
    output_len: int,
) -> GuidanceRun:
    """Prefill every prompt (untimed), then time each step while the whole batch decodes; ``schema=None``
    runs unguided. Raises EngineError if a request fails or finishes before ``output_len`` tokens."""
    from pagedgen.engine.engine import Engine
    from pagedgen.engine.request import GeneratorParams, TurnOptions

    engine = Engine(model, config)
    try:
        params = GeneratorParams(model)
        params.set_search_options(do_sample=False, ignore_eos=schema is None)
        if schema is not None:
            params.set_guidance("json_schema", json.dumps(schema))
        run = GuidanceRun(schema is not None, outputs=[[] for _ in prompts])
        requests = [engine.create_request(params) for _ in prompts]  # held: a dropped handle is abandoned
        for request, prompt in zip(requests, prompts, strict=True):
            options = TurnOptions(request)
            options.set_max_generated_tokens(output_len)
            request.begin_turn(prompt, options)
        _drive(engine, run, {id(r): i for i, r in enumerate(requests)}, output_len)
        return run
    finally:
        engine.close()


def _drive(engine: Engine, run: GuidanceRun, index: dict[int, int], output_len: int) -> None:
    """Run the batch to the end, timing the steps that ran while every request was decoding."""
    from pagedgen.engine.events import EngineEventFlags, FinishReason

    buffer = engine.create_event_buffer(4096)
    decoding = False  # every request has its first token and none has finished: the timed phase
    before = after = engine.stats()
    while engine.has_pending_requests():
        steps = engine.stats().steps
        start = time.perf_counter()
        events = list(engine.run(buffer))
        elapsed = time.perf_counter() - start
        finished = False
        for event in events:
            if event.request is None or event.flags & EngineEventFlags.FAILED:
                raise EngineError(f"the guidance bench saw a failure: {event.error_code.value}")
            if event.token is not None:
                run.outputs[index[id(event.request)]].append(event.token)
            if event.flags & EngineEventFlags.TURN_FINISHED:
                finished = True
                if event.finish_reason is not FinishReason.MAX_GENERATED_TOKENS:
                    raise EngineError(f"a turn ended early with {event.finish_reason.value}")
        if decoding and engine.stats().steps == steps + 1:
            run.step_s.append(elapsed)
            after = engine.stats()
        if finished:
            decoding = False
        elif not run.step_s and not decoding and all(run.outputs):
            decoding = True
            before = after = engine.stats()
    run.mask_s = after.mask_seconds - before.mask_seconds
    run.wait_s = after.mask_wait_seconds - before.mask_wait_seconds
    lengths = [len(out) for out in run.outputs]
    if any(n != output_len for n in lengths):
        raise EngineError(f"every request must generate {output_len} tokens, got {lengths}")


def compare_guidance(
    model: BenchModel,
    tokenizer: BenchTokenizer,
    config: EngineConfig,
    *,
    batch: int = 16,
    output_len: int = 64,
    repeats: int = 3,
    schema: JsonObject | None = None,
) -> GuidanceComparison:
    """Alternate unguided and guided runs of the same batch ``repeats`` times each (after one warm pair)."""
    schema = DEFAULT_SCHEMA if schema is None else schema
    prompts = guidance_prompts(tokenizer, batch)
    for guided in (False, True):  # first-call costs (grammar compile, tokenizer view) stay out of the runs
        run_guidance_batch(model, prompts[:2], config, schema if guided else None, 4)
    runs = []
    for _ in range(repeats):
        for guided in (False, True):
            runs.append(run_guidance_batch(model, prompts, config, schema if guided else None, output_len))
    return GuidanceComparison(batch, output_len, runs)


def markdown_table(result: GuidanceComparison) -> str:
    d = result.to_dict()
    return "\n".join(
        [
            "| batch | tokens | unguided step p50 | guided step p50 | overhead | mask / step | wait / step |",
            "|---|---|---|---|---|---|---|",
            f"| {d['batch']} | {d['output_len']} | {d['unguided_step_ms_p50']:.2f} ms "
            f"| {d['guided_step_ms_p50']:.2f} ms | {100 * d['overhead']:+.1f}% "
            f"| {d['mask_ms_per_step']:.2f} ms | {d['mask_wait_ms_per_step']:.3f} ms |",
        ]
    )
