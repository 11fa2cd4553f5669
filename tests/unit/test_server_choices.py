"""The n > 1 fan-out's pieces: derived seeds and the job group's ordering, refusal and cancel rules."""

from __future__ import annotations

import asyncio

import pytest

import pagedgen as pg
from pagedgen.sampling.options import SEED_MAX, SEED_MIN
from pagedgen.server.choices import JobGroup, choice_params, choice_seed
from pagedgen.server.worker import JobError, JobUpdate


def test_choice_seeds_are_consecutive_and_wrap_into_the_engines_range():
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(SEED_MAX, 1) == 0 and choice_seed(SEED_MAX - 1, 3) == 1
    assert choice_seed(SEED_MIN, 2) == SEED_MIN + 2
    assert choice_seed(None, 4) is None
    params = choice_params(pg.SamplingParams(seed=SEED_MAX, temperature=0.5, max_tokens=3), 2)
    assert [p.seed for p in params] == [SEED_MAX, 0]
    assert {(p.temperature, p.max_tokens) for p in params} == {(0.5, 3)}


class _Worker:
    """Records submissions and cancels; the test plays the owner thread through the sinks."""

    def __init__(self):
        self.sinks = []
        self.cancelled = []

    def submit(self, prompt_ids, params, sink, arrived_at, tag=""):
        self.sinks.append(sink)
        return 100 + len(self.sinks)

    def cancel(self, job_id):
        self.cancelled.append(job_id)


def _group(worker, n):
    return JobGroup.submit(worker, [1, 2], [pg.SamplingParams()] * n, 0.0, "t")


def test_updates_that_arrive_before_every_job_started_are_kept_in_order():
    async def scenario():
        worker = _Worker()
        group = _group(worker, 2)
        worker.sinks[0](JobUpdate(started=True))
        worker.sinks[0](JobUpdate(tokens=[5]))
        worker.sinks[0](JobUpdate(tokens=[6]))
        worker.sinks[1](JobUpdate(started=True))
        await asyncio.sleep(0)
        assert await group.started() is None
        worker.sinks[1](JobUpdate(tokens=[7]))
        got = [await group.next() for _ in range(3)]
        return [(index, update.tokens) for index, update in got], group.done

    order, done = asyncio.run(scenario())
    assert order == [(0, [5]), (0, [6]), (1, [7])]
    assert not done


def test_a_refused_choice_is_reported_and_cancel_reaches_only_the_unfinished_jobs():
    async def scenario():
        worker = _Worker()
        group = _group(worker, 3)
        worker.sinks[0](JobUpdate(started=True))
        worker.sinks[1](JobUpdate(error=JobError.INVALID, message="no"))
        await asyncio.sleep(0)
        refusal = await group.started()
        group.cancel()
        group.cancel()
        return refusal, worker.cancelled, group.done

    refusal, cancelled, done = asyncio.run(scenario())
    assert refusal is not None and refusal.error is JobError.INVALID
    assert cancelled == [101, 103] and done


@pytest.mark.parametrize("n", [1, 4])
def test_a_group_is_done_once_every_job_sent_its_last_update(n):
    async def scenario():
        worker = _Worker()
        group = _group(worker, n)
        for sink in worker.sinks:
            sink(JobUpdate(started=True))
        assert await group.started() is None
        for sink in reversed(worker.sinks):
            sink(JobUpdate(error=JobError.SHUTDOWN))
        seen = []
        while not group.done:
            seen.append((await group.next())[0])
        group.cancel()
        return seen, worker.cancelled

    seen, cancelled = asyncio.run(scenario())
    assert seen == list(reversed(range(n))) and cancelled == []
