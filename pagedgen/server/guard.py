"""OpenAI-style error bodies, and the ASGI middleware that refuses a request before any route runs.

The guard gives every request an id (``X-Request-Id`` on every response, and in the log line of a 500), then
answers, cheapest check first and before it reads any body byte: 401 on ``/v1/*`` when an API key is
configured and the request does not carry it (an unauthenticated client cannot make the server buffer
megabytes), 413 when the declared ``Content-Length`` exceeds the limit, 503 once the engine is unhealthy
(every route but ``/health`` and ``/metrics``, which must stay available exactly then). Only then does it
read the body, counting the bytes of a chunked upload as they arrive (413 past the limit), and replays it to
the app.
A refused chunked body is drained, up to a bound, so the client can read the answer instead of a reset.

An exception escaping a route is logged with the request id and answered with a generic 500 that names the id:
the exception text may hold internals (paths, prompts of other requests) and is for the operator only.
"""

from __future__ import annotations

import hmac
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("pagedgen.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20
REQUEST_ID_KEY = "pagedgen.request_id"  # where the guard puts the id in the ASGI scope
UNGUARDED_PATHS = ("/health", "/metrics")  # answer even when the engine is unhealthy
UNHEALTHY_MESSAGE = "the engine is unhealthy; the server cannot serve requests"
_DRAIN_FACTOR = 16  # chunked bodies larger than this many limits are not drained: the connection is dropped

# The ``code`` of an error that names none: always a string (OpenAI clients read it as one).
DEFAULT_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "unavailable",
}

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error a route reports to the client with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error envelope: ``code`` is always a string, ``param`` the body path of the bad field."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    if code is None:
        code = DEFAULT_CODES.get(status, "invalid_request" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_json(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def internal_error_message(request_id: str | None) -> str:
    return f"internal server error (request id {request_id or 'unknown'})"


async def send_error(send: Send, status: int, message: str, code: str | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class GuardMiddleware:
    """Request id, API key, body-size limit, engine health (see the module docstring).

    ``on_rejected(reason)`` (optional) counts each refusal: ``unauthorized``, ``too_large``, ``unhealthy``;
    ``on_failed("internal")`` each generic 500.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        healthy: Callable[[], bool],
        api_key: str | None,
        max_body_bytes: int,
        on_rejected: Callable[[str], None] = lambda _reason: None,
        on_failed: Callable[[str], None] = lambda _reason: None,
    ) -> None:
        self.app = app
        self._healthy = healthy
        self._api_key = api_key.encode("utf-8") if api_key else None
        self._limit = max_body_bytes
        self._on_rejected = on_rejected
        self._on_failed = on_failed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = f"req-{uuid.uuid4().hex}"
        scope[REQUEST_ID_KEY] = request_id
        send = _with_request_id(send, request_id)
        refusal = self._refusal(scope)
        body = await self._read_body(receive) if refusal is None else None
        if body is None:  # refused up front, or the body outgrew the limit while it arrived
            reason, status, message, code = refusal or self._too_large()
            self._on_rejected(reason)
            await send_error(send, status, message, code)
            return
        await self._run(scope, _replay(body, receive), send, request_id)

    def _refusal(self, scope: Scope) -> tuple[str, int, str, str] | None:
        """The checks that need no body byte, in order; None when the request may proceed."""
        if self._api_key is not None and scope["path"].startswith("/v1") and not self._authorized(scope):
            return ("unauthorized", 401, "Incorrect or missing API key", "invalid_api_key")
        declared = _content_length(scope)
        if declared is not None and declared > self._limit:
            return self._too_large()
        if scope["path"] not in UNGUARDED_PATHS and not self._healthy():
            return ("unhealthy", 503, UNHEALTHY_MESSAGE, "unhealthy")
        return None

    def _too_large(self) -> tuple[str, int, str, str]:
        return ("too_large", 413, f"request body exceeds the limit of {self._limit} bytes", "body_too_large")

    async def _run(self, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
        """Run the app; an exception before the response started becomes the generic 500."""
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            log.error("request %s failed", request_id, exc_info=exc)
            self._on_failed("internal")
            if started:
                raise
            await send_error(send, 500, internal_error_message(request_id), "internal_error")

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    token.strip(), self._api_key or b""
                )
        return False

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, counted as it arrives; None past the limit (then drained, up to a bound)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # disconnected
            size += len(message.get("body", b""))
            if size <= self._limit:
                chunks.append(message.get("body", b""))
            elif size > self._limit * _DRAIN_FACTOR:
                return None
            if not message.get("more_body", False):
                break
        return b"".join(chunks) if size <= self._limit else None


def _with_request_id(send: Send, request_id: str) -> Send:
    header = (b"x-request-id", request_id.encode("ascii"))

    async def tagged(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), header]}
        await send(message)

    return tagged


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the buffered body once, then defers to the real one (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def request_id_of(scope: Any) -> str | None:
    return scope.get(REQUEST_ID_KEY)
