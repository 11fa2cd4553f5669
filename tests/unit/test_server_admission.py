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


def test_a_request_of_n_choices_takes_n_places_or_none():
    admission = Admission(max_running=2, max_queued=1)
    first = admission.admit(2)
    assert first is not None and admission.in_flight == 2
    assert admission.admit(2) is None and admission.in_flight == 2  # only one place left: all or none
    single = admission.admit()
    assert single is not None and admission.in_flight == 3
    first.release()
    first.release()
    assert admission.in_flight == 1
    assert admission.admit(2) is not None and admission.in_flight == 3


def test_a_ticket_for_no_places_is_refused():
    with pytest.raises(ValueError, match="count must be >= 1"):
        Admission(max_running=1, max_queued=0).admit(0)
