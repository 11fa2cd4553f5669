"""FailureIsolator: retries, halving, the culprit, and moving on (pure bookkeeping over request ids)."""

from __future__ import annotations

from pagedgen.engine.isolation import FailureIsolator


def test_retries_the_same_batch_before_narrowing():
    iso = FailureIsolator(max_retries=3)
    assert iso.on_rollback([1, 2, 3, 4]) is None and iso.allowed() is None
    assert iso.on_rollback([1, 2, 3, 4]) is None and iso.allowed() is None
    assert iso.on_rollback([1, 2, 3, 4]) is None
    assert iso.allowed() == {1, 2} and iso.untested == [(3, 4)]


def test_a_commit_clears_the_count_and_moves_to_the_other_half():
    iso = FailureIsolator(max_retries=1)
    iso.on_rollback([1, 2, 3])
    assert iso.allowed() == {1, 2}
    iso.on_progress()
    assert iso.allowed() == {3} and iso.failures == 0
    iso.on_progress()
    assert iso.allowed() is None and not iso.active


def test_halving_ends_at_the_culprit_then_goes_on_with_what_is_left():
    iso = FailureIsolator(max_retries=2)
    batch = [1, 2, 3, 4]
    scopes = []
    culprit = None
    for _ in range(20):  # request 3 fails every step it is in; every other step commits
        scheduled = [r for r in batch if iso.allowed() is None or r in iso.allowed()]
        if 3 in scheduled:
            culprit = iso.on_rollback(scheduled)
            if culprit is not None:
                break
        else:
            iso.on_progress()
        scopes.append(tuple(scheduled))
    assert culprit == 3
    assert scopes == [(1, 2, 3, 4), (1, 2, 3, 4), (1, 2), (3, 4), (3, 4), (3,)]
    assert iso.allowed() == {4} and iso.failures == 0


def test_forgotten_requests_leave_every_scope():
    iso = FailureIsolator(max_retries=1)
    iso.on_rollback([1, 2, 3, 4])
    iso.forget(1)
    iso.forget(3)
    iso.forget(4)
    assert iso.allowed() == {2} and iso.untested == []
