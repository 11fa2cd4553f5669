"""The counted thread guard of tensor-parallel runners: overlapping holders, released in any order, leave the
process's thread count as the first found it; while any holds, the smallest request runs."""

from __future__ import annotations

import pytest
import torch

from pagedgen.ops.matmul.gemm_threads import ThreadSettings, current_thread_settings, torch_pool
from pagedgen.parallel.threads import ThreadGuard


class Pools:
    """A recorder standing for the process's pools: the count in effect and every change."""

    def __init__(self, threads: int):
        self.threads = threads
        self.calls: list[int] = []

    def read(self) -> ThreadSettings:
        return ThreadSettings(8, self.threads, self.threads, None, None)

    def apply(self, threads: int) -> None:
        self.threads = threads
        self.calls.append(threads)

    def restore(self, settings: ThreadSettings) -> None:
        self.apply(settings.torch_threads)


def guard_over(pools: Pools) -> ThreadGuard:
    return ThreadGuard(pools.read, pools.apply, pools.restore)


def test_overlapping_holders_released_first_in_first_out_restore_the_original():
    pools = Pools(8)
    guard = guard_over(pools)
    a = guard.acquire(4)
    b = guard.acquire(4)
    guard.release(a)  # the LIFO restore put 8 back here, under b
    assert pools.threads == 4 and guard.holders == 1
    guard.release(b)  # ... and 4 (a's "before") here
    assert pools.threads == 8 and guard.holders == 0
    assert pools.calls == [4, 4, 4, 8]


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 0, 2), (0, 2, 1)])
def test_the_smallest_live_request_runs_whatever_the_release_order(order):
    pools = Pools(8)
    guard = guard_over(pools)
    holds = [guard.acquire(n) for n in (4, 2, 3)]
    assert pools.threads == 2
    live = {0: 4, 1: 2, 2: 3}
    for index in order:
        guard.release(holds[index])
        del live[index]
        assert pools.threads == (min(live.values()) if live else 8)


def test_a_second_release_and_a_later_round_start_from_the_current_count():
    pools = Pools(8)
    guard = guard_over(pools)
    hold = guard.acquire(2)
    guard.release(hold)
    guard.release(hold)  # nothing more
    assert pools.calls == [2, 8]
    pools.threads = 6  # the process changed its count between rounds: the next round saves that
    guard.release(guard.acquire(1))
    assert pools.threads == 6


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bad_count_is_refused_and_changes_nothing(bad):
    pools = Pools(8)
    guard = guard_over(pools)
    with pytest.raises(ValueError, match="threads must be a positive int"):
        guard.acquire(bad)
    assert pools.calls == [] and guard.holders == 0


def test_the_default_guard_acts_on_torch_s_pool():
    before = current_thread_settings()
    guard = ThreadGuard()
    a = guard.acquire(1)
    b = guard.acquire(1)
    assert torch.get_num_threads() == 1 and torch_pool.full_threads == 1
    guard.release(a)
    assert torch_pool.full_threads == 1
    guard.release(b)
    assert current_thread_settings() == before
