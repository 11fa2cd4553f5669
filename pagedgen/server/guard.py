"""OpenAI-style error bodies, and the ASGI middleware that refuses a request before any route runs.

The cheapest checks run first and before any body byte is read (``Host``, API key, declared size, drain,
engine health), then the body is counted and timed as it arrives, so an unauthenticated or slow client
cannot make the server buffer or wait; a route's exception is a generic 500 naming the request id (its text
is for the operator's log only). docs/server.md, "Errors", lists the statuses in order.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import uuid
from collections.abc import Callable, Iterable, Sequence

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedgen.server.admission import RETRY_AFTER_S
from pagedgen.server.worker import SHUTDOWN_MESSAGE, UNAVAILABLE_MESSAGE

log = logging.getLogger("pagedgen.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20
REQUEST_ID_KEY = "pagedgen.request_id"  # where the guard puts the id in the ASGI scope
UNGUARDED_PATHS = ("/health", "/metrics")  # answer even when the engine is unhealthy
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")  # FastAPI's, behind the key
KEYED_PATHS = (*DOCS_PATHS, "/tokenize", "/detokenize", "/version")  # behind the key, besides /v1/*
DEFAULT_BODY_TIMEOUT_S = 30.0
LOOPBACK_NAME = "localhost"
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


async def send_error(
    send: Send,
    status: int,
    message: str,
    code: str | None = None,
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# Headers of a refusal, by reason: a drained or timed-out client should not reuse this connection.
_CLOSE = (b"connection", b"close")
_REFUSAL_HEADERS: dict[str, tuple[tuple[bytes, bytes], ...]] = {
    "shutting_down": ((b"retry-after", str(RETRY_AFTER_S).encode()), _CLOSE),
    "timeout": (_CLOSE,),
}


class GuardMiddleware:
    """Request id, Host allow-list, API key, body-size limit and deadline, drain and engine health.

    Every request gets an id (``X-Request-Id`` on every response, and in the log line of a 500). The answers
    before the body: 421 for a ``Host`` off the allow-list (DNS rebinding of a keyless loopback server), 401
    without the key on ``/v1/*``, ``/tokenize``, ``/detokenize``, ``/version`` and the API docs, 413 for a
    declared ``Content-Length`` over the limit, 503 while draining (``Retry-After``, ``Connection: close``)
    and once the engine is unhealthy (every route but ``/health`` and ``/metrics``). Then the body is read,
    a chunked upload counted as it arrives (413) within the body deadline (408), and replayed to the app; a
    refused chunked body is drained, up to a bound, so the client can read the answer instead of a reset.

    ``allowed_hosts``: None for no ``Host`` check, else the names accepted beyond ``localhost`` and loopback
    addresses (:func:`host_allowed`). ``draining()`` is true while the server shuts down. ``body_timeout``:
    seconds the whole body may take to arrive (None: no bound). ``on_rejected(reason)`` (optional) counts each
    refusal: ``misdirected``, ``unauthorized``, ``too_large``, ``timeout``, ``shutting_down``, ``unhealthy``;
    ``on_failed("internal")`` each generic 500.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        healthy: Callable[[], bool],
        api_key: str | None,
        max_body_bytes: int,
        allowed_hosts: frozenset[str] | None = None,
        draining: Callable[[], bool] = lambda: False,
        body_timeout: float | None = DEFAULT_BODY_TIMEOUT_S,
        on_rejected: Callable[[str], None] = lambda _reason: None,
        on_failed: Callable[[str], None] = lambda _reason: None,
    ) -> None:
        self.app = app
        self._healthy = healthy
        self._allowed_hosts = allowed_hosts
        self._draining = draining
        self._body_timeout = body_timeout
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
        body = None
        if refusal is None:
            body, refusal = await self._read_body(receive)
        if refusal is not None:  # refused up front, or the body outgrew its limit or deadline as it arrived
            reason, status, message, code = refusal
            self._on_rejected(reason)
            await send_error(send, status, message, code, _REFUSAL_HEADERS.get(reason, ()))
            return
        await self._run(scope, _replay(body or b"", receive), send, request_id)

    def _refusal(self, scope: Scope) -> tuple[str, int, str, str] | None:
        """The checks that need no body byte, in order; None when the request may proceed."""
        path = scope["path"]
        if self._allowed_hosts is not None and not host_allowed(_header(scope, b"host"), self._allowed_hosts):
            message = "the Host header names no host this server answers for (see --allowed-host)"
            return ("misdirected", 421, message, "misdirected_request")
        keyed = path.startswith("/v1") or path in KEYED_PATHS
        if self._api_key is not None and keyed and not self._authorized(scope):
            return ("unauthorized", 401, "Incorrect or missing API key", "invalid_api_key")
        declared = _content_length(scope)
        if declared is not None and declared > self._limit:
            return self._too_large()
        if path not in UNGUARDED_PATHS and self._draining():
            return ("shutting_down", 503, SHUTDOWN_MESSAGE, "shutting_down")
        if path not in UNGUARDED_PATHS and not self._healthy():
            return ("unhealthy", 503, UNAVAILABLE_MESSAGE, "unhealthy")
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

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, tuple[str, int, str, str] | None]:
        """The whole body, counted as it arrives, or the refusal: past the limit (the rest drained, up to a
        bound) or past the deadline."""
        try:
            async with asyncio.timeout(self._body_timeout):
                body = await self._receive_body(receive)
        except TimeoutError:
            message = f"the request body did not arrive within {self._body_timeout:g} s"
            return None, ("timeout", 408, message, "request_timeout")
        return (body, None) if body is not None else (None, self._too_large())

    async def _receive_body(self, receive: Receive) -> bytes | None:
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
    value = _header(scope, b"content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def host_allowed(host: bytes | None, allowed: Iterable[str]) -> bool:
    """Whether a ``Host`` header (any port) names ``localhost``, a loopback address, or one of ``allowed``.

    Accepted: ``localhost:8000``, ``127.0.0.1``, ``[::1]:8000``, ``LocalHost.`` (case and one trailing dot
    are ignored). Refused: any other name, a missing header, a port that is not a number, an IPv6 address
    without brackets.
    """
    if host is None:
        return False
    try:
        text = host.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return False
    if text.startswith("["):
        name, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    elif text.count(":") > 1:
        return False  # an IPv6 address in Host needs its brackets
    else:
        name, _, port = text.partition(":")
    if port and not port.isdigit():
        return False
    name = name.removesuffix(".")
    return name == LOOPBACK_NAME or _is_loopback_address(name) or name in allowed


def _is_loopback_address(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allow_list(bind_host: str, api_key: str | None, extra: Sequence[str] = ()) -> frozenset[str] | None:
    """The ``allowed_hosts`` of a server bound to ``bind_host``: checked when it binds loopback without an
    API key (its callers are then this machine's programs, and its browser pages), or whenever ``extra``
    names are given; None (no check) otherwise."""
    names = frozenset(name.strip().lower().removesuffix(".") for name in extra)
    loopback = bind_host.lower() == LOOPBACK_NAME or _is_loopback_address(bind_host.strip("[]"))
    if names or (loopback and not api_key):
        return names
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


def request_id_of(scope: Scope) -> str | None:
    return scope.get(REQUEST_ID_KEY)
