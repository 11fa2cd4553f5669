"""Bounded admission: exactly max_running + max_queued tickets, each released once."""

from __future__ import annotations

import pytest

from pagedgen.server.admission import Admission


def test_admits_up_to_running_plus_queued_then_refuses():
    admission = Admission(max_running=2, max_queued=1)
    tickets = [admission.admit() for _ in range(3)]
    assert all(t is not None for t in tickets)
    assert admission.in_flight == 3 and admission.waiting == 1
    assert admission.admit() is None
    assert admission.in_flight == 3


def test_release_is_idempotent_and_frees_a_place():
    admission = Admission(max_running=1, max_queued=0)
    ticket = admission.admit()
    assert admission.admit() is None
    ticket.release()
    ticket.release()
    assert admission.in_flight == 0
    assert admission.admit() is not None
    assert admission.in_flight == 1


@pytest.mark.parametrize(("running", "queued"), [(0, 1), (1, -1)])
def test_bad_bounds_are_refused(running, queued):
    with pytest.raises(ValueError, match="max_"):
        Admission(max_running=running, max_queued=queued)
