"""The synthetic model driven step by step through pack_step reproduces its closed-form greedy output.

A tiny driver plays the engine's part without the engine: it admits requests at different steps, splits
prompts into random prefill chunks, hands out physical blocks in shuffled order (and reuses freed, stale
blocks), packs every step with ``pack_step`` and samples greedily from the returned logits rows. Because the
synthetic model reads its inputs back through the block table, a wrong table or slot mapping changes tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from pagedgen.core.kv import PagedKVCache
from pagedgen.core.step_inputs import StepInputs
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.models.synthetic import SyntheticModel, synthetic_greedy

Tamper = Callable[[int, StepInputs], StepInputs]


@dataclass(slots=True)
class DriverSeq:
    """One request's host-side state in the test driver."""

    prompt: list[int]
    max_new: int
    arrival_step: int
    tokens: list[int] = field(default_factory=list)  # prompt + generated so far
    processed: int = 0  # tokens whose K/V are in the cache
    table: list[int] = field(default_factory=list)  # physical blocks in logical order

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def done(self) -> bool:
        return len(self.generated) == self.max_new


@dataclass(slots=True)
class DriverRun:
    generated: list[list[int]]
    mixed_steps: int  # steps that held a multi-token chunk and a single-token decode together
    max_batch: int


def drive(
    model: SyntheticModel,
    seqs: list[DriverSeq],
    block_size: int,
    seed: int,
    max_chunk: int = 5,
    tamper: Tamper | None = None,
) -> DriverRun:
    """Run every request to completion, one packed model call per step; ``tamper`` may corrupt a step."""
    rng = random.Random(seed)
    need = sum(-(-(len(s.prompt) + s.max_new) // block_size) for s in seqs)
    num_blocks = need + 4
    free = list(range(num_blocks - 1))  # the last block is a guard, so a shifted slot stays in range
    rng.shuffle(free)
    cache = PagedKVCache(model.kv_spec, num_blocks, block_size)
    for s in seqs:
        s.tokens = list(s.prompt)
    mixed_steps, max_batch, step = 0, 0, 0
    while not all(s.done for s in seqs):
        active = [s for s in seqs if s.arrival_step <= step and not s.done]
        step += 1
        if not active:
            continue
        sizes = [min(len(s.tokens) - s.processed, rng.randint(1, max_chunk)) for s in active]
        chunks = []
        for s, n in zip(active, sizes, strict=True):
            while len(s.table) * block_size < s.processed + n:
                s.table.append(free.pop())
            chunks.append(
                SequenceChunk(
                    tokens=s.tokens[s.processed : s.processed + n],
                    past_len=s.processed,
                    block_table=list(s.table),
                )
            )
        inputs = pack_step(chunks, block_size)
        if tamper is not None:
            inputs = tamper(step, inputs)
        sampled = torch.argmax(model.forward(inputs, cache), dim=-1).tolist()  # one row per request
        mixed_steps += int(max(sizes) > 1 and min(sizes) == 1 and len(active) > 1)
        max_batch = max(max_batch, len(active))
        for s, n, token in zip(active, sizes, sampled, strict=True):
            s.processed += n
            if s.processed == len(s.tokens):  # the chunk reached the end: its last row is sampled
                s.tokens.append(token)
                if s.done:  # return the blocks, stale contents and all, to a random place in the pool
                    for block in s.table:
                        free.insert(rng.randint(0, len(free)), block)
                    s.table = []
    return DriverRun([s.generated for s in seqs], mixed_steps, max_batch)


def make_seqs(seed: int, count: int, vocab: int) -> list[DriverSeq]:
    rng = random.Random(seed)
    return [
        DriverSeq(
            prompt=[rng.randrange(vocab) for _ in range(rng.randint(1, 23))],
            max_new=rng.randint(1, 14),
            arrival_step=rng.randint(0, 6),
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_steps_reproduce_synthetic_greedy(block_size, seed):
    model = SyntheticModel(vocab_size=257)
    seqs = make_seqs(seed, count=6, vocab=model.vocab_size)
    run = drive(model, seqs, block_size, seed)
    for s, generated in zip(seqs, run.generated, strict=True):
        assert generated == synthetic_greedy(s.prompt, s.max_new, model.vocab_size)
    assert run.mixed_steps > 0 and run.max_batch >= 3  # the scenario really batched and mixed


def twin_seqs() -> list[DriverSeq]:
    """Two requests with equal lengths (so swapped tables still fit) and different contents."""
    return [
        DriverSeq(prompt=[5, 9, 14, 2, 7], max_new=6, arrival_step=0),
        DriverSeq(prompt=[40, 3, 8, 61, 30], max_new=6, arrival_step=0),
    ]


def expected_twins(vocab: int) -> list[list[int]]:
    return [synthetic_greedy(s.prompt, s.max_new, vocab) for s in twin_seqs()]


def test_untampered_twins_are_correct():
    model = SyntheticModel(vocab_size=101)
    run = drive(model, twin_seqs(), block_size=2, seed=5, max_chunk=8)
    assert run.generated == expected_twins(model.vocab_size)


def test_swapped_block_tables_change_the_tokens():
    """Reading through another request's table must show: the model really reads through block_tables."""
    model = SyntheticModel(vocab_size=101)

    def swap_tables(step: int, inputs: StepInputs) -> StepInputs:
        if step == 4:  # both requests are decoding by now
            assert inputs.query_lens.tolist() == [1, 1]
            inputs.block_tables = inputs.block_tables.flip(0).contiguous()
        return inputs

    run = drive(model, twin_seqs(), block_size=2, seed=5, max_chunk=8, tamper=swap_tables)
    expected = expected_twins(model.vocab_size)
    assert run.generated[0] != expected[0]
    assert run.generated[1] != expected[1]


def test_off_by_one_slot_mapping_changes_the_tokens():
    model = SyntheticModel(vocab_size=101)

    def shift_slots(step: int, inputs: StepInputs) -> StepInputs:
        if step == 4:
            inputs.slot_mapping = inputs.slot_mapping + 1
        return inputs

    run = drive(model, twin_seqs(), block_size=2, seed=5, max_chunk=8, tamper=shift_slots)
    expected = expected_twins(model.vocab_size)
    assert run.generated[0] != expected[0]
    assert run.generated[1] != expected[1]
