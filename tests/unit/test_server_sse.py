"""EventStreamResponse runs its cleanup however the stream ends, even when its generator never started."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from pagedgen.server.sse import EventStreamResponse


class Stream:
    def __init__(self) -> None:
        self.started = False
        self.closed: list[str] = []

    async def body(self):
        self.started = True
        yield b"data: 1\n\n"

    def response(self) -> EventStreamResponse:
        return EventStreamResponse(self.body(), on_close=lambda: self.closed.append("closed"))


def _scope(spec: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "headers": []}


async def _disconnected() -> dict:
    return {"type": "http.disconnect"}


async def _send_to_a_gone_client(_message: dict) -> None:
    await asyncio.sleep(0)  # a real send yields to the loop: the stream task is cancelled right there


def test_client_gone_before_the_stream_starts_still_runs_on_close():
    """ASGI 2.3: the disconnect listener wins while the stream task sends the response start."""
    stream = Stream()
    asyncio.run(stream.response()(_scope("2.3"), _disconnected, _send_to_a_gone_client))
    assert stream.started is False
    assert stream.closed == ["closed"]


def test_failed_first_send_still_runs_on_close():
    """ASGI 2.4: the first send raises OSError; the generator never ran."""

    async def broken(_message: dict) -> None:
        raise OSError("connection reset")

    stream = Stream()
    with pytest.raises(ClientDisconnect):
        asyncio.run(stream.response()(_scope("2.4"), _disconnected, broken))
    assert stream.started is False
    assert stream.closed == ["closed"]


def test_a_complete_stream_runs_on_close_once():
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def never() -> dict:
        await asyncio.Event().wait()
        return {}

    stream = Stream()
    asyncio.run(stream.response()(_scope("2.4"), never, send))
    assert stream.started is True and stream.closed == ["closed"]
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b""]
