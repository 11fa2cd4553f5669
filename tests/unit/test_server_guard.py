"""The guard middleware at the ASGI level: what it answers, and that it reads no body byte before it must."""

from __future__ import annotations

import asyncio
import json
import logging

from pagedgen.server.guard import REQUEST_ID_KEY, GuardMiddleware

LIMIT = 100
KEY = "sekret"


class Recorder:
    """An ASGI ``send`` that keeps the messages, and the app behind the guard (records whether it ran)."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.app_calls: list[bytes] = []
        self.rejected: list[str] = []
        self.failed: list[str] = []

    async def send(self, message: dict) -> None:
        self.messages.append(message)

    async def app(self, scope, receive, send) -> None:
        body = (await receive())["body"]
        self.app_calls.append(body)
        if body == b"boom":
            raise RuntimeError("secret detail /etc/passwd")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    @property
    def status(self) -> int:
        return self.messages[0]["status"]

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.messages[0]["headers"])

    @property
    def body(self) -> dict:
        return json.loads(self.messages[1]["body"])


def _scope(path="/v1/completions", key: str | None = KEY, length: int | None = None) -> dict:
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http", "path": path, "headers": headers, "method": "POST"}


def _receive_of(chunks: list[bytes], calls: list[int] | None = None):
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]

    async def receive() -> dict:
        if calls is not None:
            calls.append(1)
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return receive


def _run(scope: dict, receive, *, healthy: bool = True) -> Recorder:
    recorder = Recorder()
    guard = GuardMiddleware(
        recorder.app,
        healthy=lambda: healthy,
        api_key=KEY,
        max_body_bytes=LIMIT,
        on_rejected=recorder.rejected.append,
        on_failed=recorder.failed.append,
    )
    asyncio.run(guard(scope, receive, recorder.send))
    return recorder


def test_a_wrong_key_is_401_before_any_body_byte_is_read():
    for key in ("wrong", None):
        calls: list[int] = []
        recorder = _run(_scope(key=key, length=10**9), _receive_of([b"x" * 10], calls))
        assert recorder.status == 401
        assert calls == []  # the body was never read
        assert recorder.headers[b"www-authenticate"] == b"Bearer"
        assert recorder.body["error"]["code"] == "invalid_api_key"
        assert recorder.rejected == ["unauthorized"] and recorder.app_calls == []


def test_a_declared_length_over_the_limit_is_413_before_any_body_byte_is_read():
    calls: list[int] = []
    recorder = _run(_scope(length=LIMIT + 1), _receive_of([b"x"], calls))
    assert recorder.status == 413 and calls == [] and recorder.rejected == ["too_large"]
    assert recorder.body["error"]["code"] == "body_too_large"


def test_a_chunked_body_is_counted_as_it_arrives():
    ok = _run(_scope(), _receive_of([b"a" * 60, b"b" * 40]))
    assert ok.status == 200 and ok.app_calls == [b"a" * 60 + b"b" * 40]
    over = _run(_scope(), _receive_of([b"a" * 60, b"b" * 41]))
    assert over.status == 413 and over.app_calls == [] and over.rejected == ["too_large"]


def test_unhealthy_is_503_except_health_and_metrics():
    refused = _run(_scope(), _receive_of([b"{}"]), healthy=False)
    assert refused.status == 503 and refused.rejected == ["unhealthy"]
    for path in ("/health", "/metrics"):
        assert _run(_scope(path=path, key=None), _receive_of([b""]), healthy=False).status == 200


def test_every_response_carries_a_request_id():
    seen: list[str] = []
    recorder = Recorder()

    async def app(scope, receive, send):
        seen.append(scope[REQUEST_ID_KEY])
        await recorder.app(scope, receive, send)

    guard = GuardMiddleware(app, healthy=lambda: True, api_key=None, max_body_bytes=LIMIT)
    asyncio.run(guard(_scope(), _receive_of([b"{}"]), recorder.send))
    assert recorder.headers[b"x-request-id"].decode() == seen[0]
    assert seen[0].startswith("req-")
    refused = _run(_scope(key="wrong"), _receive_of([b"{}"]))
    assert refused.headers[b"x-request-id"].startswith(b"req-")


def test_an_exception_is_a_generic_500_with_the_request_id_and_the_detail_only_in_the_log(caplog):
    with caplog.at_level(logging.ERROR, logger="pagedgen.server"):
        recorder = _run(_scope(), _receive_of([b"boom"]))
    assert recorder.status == 500
    request_id = recorder.headers[b"x-request-id"].decode()
    error = recorder.body["error"]
    assert request_id in error["message"] and "secret" not in json.dumps(error)
    assert error["type"] == "internal_server_error" and error["code"] == "internal_error"
    assert recorder.failed == ["internal"]
    assert request_id in caplog.text and "secret detail" in caplog.text
