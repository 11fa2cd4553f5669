"""How ``pagedgen serve`` runs an app under uvicorn: connection timeouts and the graceful shutdown.

uvicorn alone bounds neither a client that trickles its request head (its keep-alive timer runs only
between requests) nor its shutdown (it cancels running handlers: cut streams, text/plain 500s, tracebacks,
exit 143); :class:`HeadTimeoutProtocol` adds the head deadline and :class:`PagedgenServer` drains before
uvicorn shuts down. docs/server.md, "Shutdown and connection limits", has the steps and the bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from types import FrameType
from typing import TYPE_CHECKING, Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedgen.server.admission import Admission
from pagedgen.server.guard import error_body

if TYPE_CHECKING:
    import socket

    from fastapi import FastAPI

log = logging.getLogger("pagedgen.server")

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DELIVERY_GRACE_S = 5.0  # after the abort: how long the ended responses may take to reach their clients
UVICORN_GRACE_S = 5  # uvicorn's own graceful timeout, which now only meets clients that stopped reading
_POLL_S = 0.05

Drain = Callable[[float, Callable[[], bool]], Awaitable[None]]


def _timeout_response() -> bytes:
    body = json.dumps(error_body(408, "the request head did not arrive in time", code="request_timeout"))
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return (head + body).encode("ascii")


_TIMEOUT_RESPONSE = _timeout_response()


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head (``header_timeout`` seconds).

    The deadline is armed when the connection opens and when the first byte of a later request arrives, and
    disarmed once h11 has parsed the head (the client then sends a body, or waits for the answer). A request
    line and headers larger than uvicorn's ``h11_max_incomplete_event_size`` (16 KiB) are a 400 already.
    """

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False  # a byte of the pending head has arrived

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._head_started = True
            if self._head_timer is None:
                self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self._header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._head_started = False

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._head_started:  # h11 cannot answer a request it has not parsed: the bytes are written raw
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


async def drain(admission: Admission, abort: Callable[[], None], timeout: float, hurry: Callable[[], bool]):
    """Stop admitting, wait up to ``timeout`` s for the admitted requests, then ``abort()`` the rest.

    After the abort, the ended responses get ``DELIVERY_GRACE_S`` to reach their clients. ``hurry()``
    true (a second signal) ends the first wait early."""
    admission.close()
    if admission.in_flight:
        log.info("shutting down: %d requests in flight, waiting up to %g s", admission.in_flight, timeout)
    if await _until_idle(admission, timeout, hurry):
        return
    why = "a second signal" if hurry() else f"the shutdown timeout ({timeout:g} s)"
    log.info("%s: ending the %d requests still in flight", why, admission.in_flight)
    abort()
    await _until_idle(admission, DELIVERY_GRACE_S, lambda: False)


async def _until_idle(admission: Admission, timeout: float, hurry: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + timeout
    while admission.in_flight and not hurry():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_POLL_S)
    return admission.in_flight == 0


class PagedgenServer(uvicorn.Server):
    """uvicorn's server with a drain before its shutdown, and signals that end the process cleanly.

    uvicorn raises a captured signal again once it has shut down (so SIGTERM ends the process with 143); here
    the signal has been handled by the drain and is not raised again.
    """

    def __init__(self, config: uvicorn.Config, *, drain: Drain, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._shutdown_timeout = shutdown_timeout
        self._hurry = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self._hurry = True  # a second signal: end the requests in flight now
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._drain(self._shutdown_timeout, lambda: self._hurry)
        await super().shutdown(sockets=sockets)


def build_server(app: FastAPI, *, host: str, port: int, log_level: str = "info") -> PagedgenServer:
    """The server of an app made by :func:`pagedgen.server.app.create_app`, configured by its options."""
    options = app.state.options
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        http=functools.partial(HeadTimeoutProtocol, header_timeout=options.header_timeout),
        timeout_keep_alive=options.keep_alive_timeout,
        timeout_graceful_shutdown=UVICORN_GRACE_S,
    )
    state = app.state
    drain_app = functools.partial(drain, state.admission, state.worker.abort)
    return PagedgenServer(config, drain=drain_app, shutdown_timeout=options.shutdown_timeout)
