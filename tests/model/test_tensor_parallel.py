"""Tensor parallelism on the default model: two ranks over gloo (rank 1 a real worker process) against one.

The split is the default model's uneven one (3 KV groups: 2 on rank 0, 1 on rank 1), its weights in their
stored Q4_1/Q8_0 blocks. Logits agree to 1e-4 (only the all-reduce's summation order differs), greedy
tokens agree through ``pg.Engine``, every recoverable fault rolls back to exactly the one-rank state and
output, fail-stop faults fail the same turns as with one rank, and a rank that is killed or hangs makes the
engine unhealthy with an error naming the rank instead of hanging it.

Each fixture or test that builds a two-rank runner starts one worker process (a few seconds: it imports
torch and loads the model), so they are shared where the tests allow.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

import pagedgen as pg
from pagedgen.engine.faults import FaultInjector
from pagedgen.engine.parts import build_engine_parts
from pagedgen.errors import ExecutionCapacityError, InjectedFault, RetryableExecutionError
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.executor.runner import ModelRunner
from pagedgen.parallel.runner import RankFailedError, TensorParallelRunner
from pagedgen.parallel.shard import weight_bytes
from tests.helpers import drain, engine_snapshot, event_key, submit

pytestmark = [pytest.mark.model, pytest.mark.cpu]  # gloo ranks on the CPU

F = pg.EngineEventFlags
E = pg.EngineErrorCode
BLOCK = 16
NUM_BLOCKS = 64
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")


@pytest.fixture(scope="module")
def tp_runner(default_model):
    runner = TensorParallelRunner(default_model, 2, NUM_BLOCKS, BLOCK)
    yield runner
    runner.release()


def engine_config(world: int) -> pg.EngineConfig:
    return pg.EngineConfig(
        max_batch_size=4,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        max_scheduled_tokens=64,
        tensor_parallel_size=world,
        debug_invariants=True,
        prefix_caching=False,  # every scenario schedules alike, whatever ran on the engine before
    )


@pytest.fixture(scope="module")
def tp_engine(default_model):
    engine = pg.Engine(default_model, engine_config(2))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def one_engine(default_model):
    engine = pg.Engine(default_model, engine_config(1))
    yield engine
    engine.close()


def prompt_ids(model) -> list[list[int]]:
    return [model.tokenizer.encode(p) for p in PROMPTS]


def step_logits(runners, chunks) -> list[torch.Tensor]:
    inputs = pack_step(chunks, BLOCK)
    return [runner.execute(inputs) for runner in runners]


def test_teacher_forced_logits_match_one_rank(default_model, tp_runner):
    one = ModelRunner(default_model, NUM_BLOCKS, BLOCK, cuda_graphs=False)
    runners = (one, tp_runner)
    prompts = prompt_ids(default_model)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]  # 128 tokens each
    # A prefill of every prompt with a logits row per token (teacher-forced over the prompt) ...
    chunks = [SequenceChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)]
    pairs = [step_logits(runners, chunks)]
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1  # each prompt's last row
    picks = pairs[0][0][ends].argmax(-1).tolist()
    seqs = [list(p) for p in prompts]
    # ... then decode steps fed one rank's greedy token: the two-rank logits at the same history.
    for _ in range(24):
        chunks = [
            SequenceChunk([t], len(s), table, False) for t, s, table in zip(picks, seqs, tables, strict=True)
        ]
        for seq, token in zip(seqs, picks, strict=True):
            seq.append(token)
        pairs.append(step_logits(runners, chunks))
        picks = pairs[-1][0].argmax(-1).tolist()
    one_logits = torch.cat([a for a, _ in pairs])
    two_logits = torch.cat([b for _, b in pairs])
    assert one_logits.shape == two_logits.shape and one_logits.shape[0] > 60
    assert (one_logits - two_logits).abs().max().item() <= 1e-4
    agree = (one_logits.argmax(-1) == two_logits.argmax(-1)).float().mean().item()
    assert agree >= 0.99
    one.release()


def test_each_rank_holds_only_its_shard(default_model, tp_runner):
    full = weight_bytes(default_model.runtime)
    rank0, rank1 = tp_runner.rank_weight_bytes
    trunk = default_model.runtime.model
    # Replicated on both: the embedding (also the tied head) and every RMSNorm weight.
    norms = [trunk.norm] + [
        n for layer in trunk.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    replicated = trunk.embed_tokens.weight.nbytes + sum(n.weight.nbytes for n in norms)
    assert replicated < rank1 < rank0 < full  # rank 0 has two of the three KV groups
    assert rank0 + rank1 == full + replicated  # everything else is held exactly once
    assert tp_runner.dequantized_slices == (0, 0)  # every cut fell on a Q4_1 / Q8_0 block edge
    # Rank 0's KV cache holds its 2 of the 3 KV heads.
    assert tuple(tp_runner.kv_cache.keys[0].shape) == (NUM_BLOCKS, BLOCK, 2, 64)


def greedy(engine: pg.Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    requests = [submit(engine, p, n, max_length=512, do_sample=False) for p in prompts]
    events = drain(engine)
    out = [[e.token for e in events if e.request is r and e.flags & F.TOKEN] for r in requests]
    for request in requests:
        request.close()
    return out


def test_greedy_tokens_through_the_engine_equal_one_rank(default_model, tp_engine, one_engine):
    prompts = [default_model.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    prompts = [default_model.tokenizer.encode(p) for p in prompts]
    expected = greedy(one_engine, prompts, 24)
    assert all(len(t) == 24 for t in expected)
    assert greedy(tp_engine, prompts, 24) == expected
    assert tp_engine.stats().healthy and tp_engine.check_invariants() == []


def scenario(engine: pg.Engine, model) -> list[pg.Request]:
    """Two decoding requests (one sampled with a seed) and a chunked prefill in flight."""
    a, b, c = prompt_ids(model)
    requests = [
        submit(engine, a, 6, max_length=512),
        submit(engine, b, 6, max_length=512, do_sample=True, temperature=0.9, seed=7),
    ]
    engine.run(max_events=64)
    requests.append(submit(engine, c * 8, 3, max_length=512))  # longer than one step's 64 tokens
    engine.run(max_events=64)
    return requests


def finish(engine: pg.Engine, requests: list[pg.Request]) -> list[tuple]:
    events = [event_key(e) for e in drain(engine)]
    for request in requests:
        request.close()
    return events


@pytest.fixture(scope="module")
def reference_events(default_model, one_engine):
    """The scenario's remaining events on one rank without a fault (request ids are the engine's own)."""
    return finish(one_engine, scenario(one_engine, default_model)), one_engine


RECOVERABLE = [
    ("checkpoint", InjectedFault("x"), F.RETRYABLE, E.RETRYABLE_EXECUTION),
    ("pack", InjectedFault("x"), F.RETRYABLE, E.RETRYABLE_EXECUTION),
    ("execute", RetryableExecutionError("transient"), F.RETRYABLE, E.RETRYABLE_EXECUTION),
    ("execute", ExecutionCapacityError("oom"), F.CAPACITY_BLOCKED, E.EXECUTION_CAPACITY_EXCEEDED),
    ("sample", InjectedFault("x"), F.RETRYABLE, E.RETRYABLE_EXECUTION),
    ("stage", InjectedFault("x"), F.RETRYABLE, E.RETRYABLE_EXECUTION),
    ("validate", InjectedFault("x"), F.RETRYABLE, E.RETRYABLE_EXECUTION),
]


def relative(events: list[tuple], first_id: int) -> list[tuple]:
    """Event keys with request ids counted from the scenario's first request (engines number on)."""
    return [(None if k[0] is None else k[0] - first_id, *k[1:]) for k in events]


@pytest.mark.parametrize(
    "phase, error, flag, code", RECOVERABLE, ids=[f"{p}-{type(e).__name__}" for p, e, *_ in RECOVERABLE]
)
def test_a_recoverable_fault_rolls_back_exactly_under_two_ranks(
    default_model, tp_engine, reference_events, phase, error, flag, code
):
    expected, one_engine = reference_events
    requests = scenario(tp_engine, default_model)
    before = engine_snapshot(tp_engine)
    rollbacks = tp_engine.stats().rollbacks
    tp_engine.parts.faults.arm(phase, error)
    events = list(tp_engine.run(max_events=64))
    assert [(e.request, e.flags, e.error_code) for e in events] == [(None, flag, code)]
    assert engine_snapshot(tp_engine) == before
    assert tp_engine.stats().rollbacks == rollbacks + 1 and tp_engine.check_invariants() == []
    # The retried steps produce exactly what one rank produced without the fault.
    got = finish(tp_engine, requests)
    first_one = min(k[0] for k in expected if k[0] is not None)
    assert relative(got, requests[0].id) == relative(expected, first_one)
    assert tp_engine.stats().healthy


@pytest.mark.parametrize("phase", ["execute", "commit_cache"])
def test_a_fail_stop_fault_fails_the_same_turns_as_one_rank(default_model, phase):
    outcomes = []
    for world in (1, 2):
        faults, config = FaultInjector(), engine_config(world)
        engine = pg.Engine(
            default_model, config, parts=build_engine_parts(default_model, config, faults=faults)
        )
        requests = scenario(engine, default_model)
        faults.arm(phase)
        events = [
            (e.request.id if e.request else None, e.flags, e.error_code) for e in engine.run(max_events=64)
        ]
        assert not engine.stats().healthy
        with pytest.raises(pg.EngineError, match="unhealthy"):
            engine.run(max_events=8)
        outcomes.append(events)
        for request in requests:
            request.close()
        engine.close()
    assert outcomes[0] == outcomes[1] and outcomes[0]
    assert all(flags & F.FAILED for _, flags, _ in outcomes[1])


def test_a_killed_rank_makes_the_engine_unhealthy_not_hung(default_model):
    engine = pg.Engine(default_model, engine_config(2))
    (pid,) = engine.parts.runner.worker_pids
    request = submit(engine, prompt_ids(default_model)[0], 8, max_length=512)
    engine.run(max_events=64)  # a step on both ranks
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    events = list(engine.run(max_events=64))
    assert [(e.request, e.flags, e.error_code) for e in events] == [
        (request, F.TURN_FINISHED | F.FAILED, E.ENGINE_EXECUTION_FAILURE)
    ]
    assert not engine.stats().healthy
    with pytest.raises(pg.EngineError, match="tensor-parallel rank 1"):
        request.begin_turn([1, 2, 3])
    request.close()
    engine.close()


def test_a_hung_rank_fails_the_step_after_the_timeout(default_model):
    runner = TensorParallelRunner(default_model, 2, NUM_BLOCKS, BLOCK, timeout_s=3.0)
    (pid,) = runner.worker_pids
    chunk = [SequenceChunk(prompt_ids(default_model)[0], 0, [0], False)]
    runner.execute(pack_step(chunk, BLOCK))
    os.kill(pid, signal.SIGSTOP)  # alive but not answering: only the collective's timeout can tell
    try:
        with pytest.raises(RankFailedError):
            runner.execute(pack_step([SequenceChunk([5], 6, [0], False)], BLOCK))
        with pytest.raises(RankFailedError):  # broken for good: the ranks are out of step
            runner.execute(pack_step([SequenceChunk([5], 6, [0], False)], BLOCK))
    finally:
        os.kill(pid, signal.SIGKILL)
        runner.release()
