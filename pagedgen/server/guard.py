"""OpenAI-style error bodies, and the ASGI middleware that refuses a request before any route runs.

The guard answers, in this order: 413 when the body exceeds the size limit, 503 on every route once the
engine is unhealthy, 401 on ``/v1/*`` when an API key is configured and the request does not carry it. It
reads the whole body first (it has to, to enforce the limit on chunked uploads) and replays it to the app; a
refused body is drained so the client can read the answer instead of seeing a reset connection.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY_BYTES = 4 << 20
_DRAIN_FACTOR = 16  # bodies larger than this many limits are not drained: the connection is dropped instead

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error a route reports to the client with ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": code if code is not None else status,
        }
    }


async def send_error(send: Send, status: int, message: str, code: str | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class GuardMiddleware:
    """Body-size limit, engine health and API key, checked before routing (see the module docstring)."""

    def __init__(
        self, app: ASGIApp, *, healthy: Callable[[], bool], api_key: str | None, max_body_bytes: int
    ) -> None:
        self.app = app
        self._healthy = healthy
        self._api_key = api_key.encode("utf-8") if api_key else None
        self._limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await self._read_body(scope, receive)
        if body is None:
            await send_error(
                send, 413, f"request body exceeds the limit of {self._limit} bytes", "body_too_large"
            )
            return
        if not self._healthy():
            await send_error(
                send, 503, "the engine is unhealthy; the server cannot serve requests", "unhealthy"
            )
            return
        if self._api_key is not None and scope["path"].startswith("/v1") and not self._authorized(scope):
            await send_error(send, 401, "Incorrect or missing API key", "invalid_api_key")
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    token.strip(), self._api_key or b""
                )
        return False

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None when it exceeds the limit (then drained, up to a bound)."""
        declared = _content_length(scope)
        if declared is not None and declared > self._limit * _DRAIN_FACTOR:
            return None
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


def error_json(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)
