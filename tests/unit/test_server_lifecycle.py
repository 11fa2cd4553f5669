"""The shutdown drain (``pagedgen.server.lifecycle.drain``) over a real Admission and a recording abort."""

from __future__ import annotations

import asyncio

from pagedgen.server.admission import Admission
from pagedgen.server.lifecycle import drain


def _run(admission: Admission, timeout: float, hurry=lambda: False, on_abort=lambda: None) -> list[str]:
    calls: list[str] = []

    def abort() -> None:
        calls.append("abort")
        on_abort()

    asyncio.run(drain(admission, abort, timeout, hurry))
    return calls


def test_an_idle_server_closes_admission_and_aborts_nothing():
    admission = Admission(max_running=2, max_queued=2)
    assert _run(admission, timeout=0) == []
    assert admission.closed and admission.admit() is None


def test_requests_that_end_within_the_timeout_are_not_aborted():
    admission = Admission(max_running=2, max_queued=0)
    ticket = admission.admit()

    async def main() -> list[str]:
        calls: list[str] = []
        asyncio.get_running_loop().call_later(0.05, ticket.release)
        await drain(admission, lambda: calls.append("abort"), 600, lambda: False)
        return calls

    assert asyncio.run(main()) == []
    assert admission.in_flight == 0


def test_the_timeout_aborts_what_is_left_and_waits_for_it_to_end():
    admission = Admission(max_running=2, max_queued=0)
    tickets = [admission.admit(), admission.admit()]
    calls = _run(admission, timeout=0, on_abort=lambda: [t.release() for t in tickets])
    assert calls == ["abort"] and admission.in_flight == 0


def test_a_second_signal_ends_the_wait_at_once():
    admission = Admission(max_running=1, max_queued=0)
    ticket = admission.admit()
    calls = _run(admission, timeout=600, hurry=lambda: True, on_abort=ticket.release)
    assert calls == ["abort"] and admission.in_flight == 0
