"""The server under overload and attack, on the synthetic model (exact tokens) held at a gate where needed.

Admission is bounded (429 + Retry-After, then recovery), the API key and the declared body size are checked
before the body is read, one request's bad command fails only that request, a client that leaves while its
turn is queued has its turn cancelled and its blocks freed, and ``/health`` / ``/metrics`` answer while a
step is running.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket

import httpx
import openai
import pytest

from pagedgen.engine.engine import Engine
from pagedgen.errors import InvalidArgumentError
from pagedgen.models.synthetic import SyntheticModel
from tests.server.doubles import (
    NUM_BLOCKS,
    VOCAB,
    GatedModel,
    app_state,
    client_of,
    expected_text,
    serve,
    settled_metrics,
    wait_until,
)
from tests.server.live import metric

KEY = "overload-key"
LIMIT = 4096
REFUSED = 77  # a prompt holding this token: the engine refuses the turn as invalid input
EXPLODES = 78  # a prompt holding this token: starting the turn raises an unexpected error


@pytest.fixture
def gated_one():
    """One request runs at a time (max_batch_size 1), one more may wait; every forward waits at the gate."""
    model = GatedModel(vocab_size=VOCAB)
    server = serve(model, max_batch_size=1, max_queued_requests=1, api_key=KEY, max_body_bytes=LIMIT)
    yield server, model
    model.gate.set()
    server.stop()


def _sample(server, name: str, **labels: str) -> float:
    return metric(httpx.get(server.url + "/metrics").text, name, model_name="synthetic", **labels)


def _complete(server, prompt: list[int], max_tokens: int = 3) -> str:
    client = client_of(server, KEY)
    response = client.completions.create(
        model="synthetic", prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return response.choices[0].text


def _raw_request(port: int, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send a request head (and maybe part of a body) and read the whole answer, the socket still open."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        header, _, rest = data.partition(b"\r\n\r\n")
        lines = header.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        while len(rest) < int(headers.get("content-length", 0)):
            rest += sock.recv(65536)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, rest


def test_a_full_queue_is_429_with_retry_after_then_the_server_recovers(gated_one):
    server, model = gated_one
    admission = app_state(server).admission
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(_complete, server, [1, 2, 3])
        assert model.entered.wait(timeout=120)
        waiting = pool.submit(_complete, server, [4, 5])
        wait_until(lambda: admission.in_flight == 2, "the second request was admitted")

        response = httpx.post(
            server.url + "/v1/completions",
            json={"model": "synthetic", "prompt": [6, 7], "max_tokens": 3},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["code"] == "queue_full" and error["type"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            _complete(server, [6, 7])
        assert _sample(server, "pagedgen:num_requests_admitted") == 2

        model.gate.set()
        assert running.result() == expected_text([1, 2, 3], 3)
        assert waiting.result() == expected_text([4, 5], 3)
    assert _complete(server, [6, 7]) == expected_text([6, 7], 3)
    assert admission.in_flight == 0
    text = settled_metrics(server)
    assert metric(text, "pagedgen:request_rejected_total", model_name="synthetic", reason="queue_full") == 2
    assert (
        metric(text, "pagedgen:request_success_total", model_name="synthetic", finished_reason="length") == 3
    )
    assert metric(text, "pagedgen:kv_cache_blocks_free", model_name="synthetic") == NUM_BLOCKS


def test_a_wrong_key_is_401_before_the_body_arrives(gated_one):
    """Only the head and a few body bytes of a 'huge' upload are sent: the answer cannot wait for the rest."""
    server, model = gated_one
    model.gate.set()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        "Authorization: Bearer wrong\r\nContent-Length: 100000000\r\n"
    )
    status, headers, body = _raw_request(server.port, head, b'{"model": ')
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert headers["x-request-id"].startswith("req-")
    assert _sample(server, "pagedgen:request_rejected_total", reason="unauthorized") == 1


def test_a_declared_body_over_the_limit_is_413_before_the_body_arrives(gated_one):
    server, model = gated_one
    model.gate.set()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {LIMIT + 1}\r\n"
    )
    status, _headers, body = _raw_request(server.port, head, b'{"model": ')
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"


def test_a_chunked_body_over_the_limit_is_413(gated_one):
    server, model = gated_one
    model.gate.set()

    def chunks():  # no content-length: the guard counts the bytes as they arrive
        yield b'{"model": "synthetic", "prompt": "'
        for _ in range(3):
            yield b"a" * (LIMIT // 2)
        yield b'"}'

    response = httpx.post(
        server.url + "/v1/completions",
        content=chunks(),
        headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    assert response.status_code == 413
    assert _sample(server, "pagedgen:request_rejected_total", reason="too_large") == 1
    assert _complete(server, [1, 2]) == expected_text([1, 2], 3)


def test_a_client_that_leaves_while_queued_has_its_turn_cancelled_and_blocks_freed(gated_one):
    """The stream's response never starts (its turn never did): the disconnect watch cancels the job."""
    server, model = gated_one
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_complete, server, [1, 2, 3])
        assert model.entered.wait(timeout=120)
        body = json.dumps({"model": "synthetic", "prompt": [9, 8, 7], "max_tokens": 40, "stream": True})
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        admission = app_state(server).admission
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head.encode() + body.encode())
            wait_until(lambda: admission.in_flight == 2, "the streaming request was admitted")
        disconnects = app_state(server).metrics.disconnects
        wait_until(lambda: disconnects._value.get() == 1, "the server noticed the disconnect")
        assert admission.in_flight == 1  # its place is free again
        model.gate.set()
        assert running.result() == expected_text([1, 2, 3], 3)
    text = settled_metrics(server)
    assert metric(text, "pagedgen:request_cancelled_total", model_name="synthetic") == 1
    assert metric(text, "pagedgen:generation_tokens_total", model_name="synthetic") == 3
    assert metric(text, "pagedgen:kv_cache_blocks_free", model_name="synthetic") == NUM_BLOCKS
    assert metric(text, "pagedgen:num_requests_running", model_name="synthetic") == 0


def test_health_and_metrics_answer_while_a_step_is_running(gated_one):
    server, model = gated_one
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_complete, server, [1, 2, 3])
        assert model.entered.wait(timeout=120)  # the engine thread is inside a forward now
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        scrape = httpx.get(server.url + "/metrics")
        assert scrape.status_code == 200
        assert metric(scrape.text, "pagedgen:healthy", model_name="synthetic") == 1
        assert metric(scrape.text, "pagedgen:kv_cache_blocks_total", model_name="synthetic") == NUM_BLOCKS
        assert "pagedgen:engine_steps_total" in scrape.text
        model.gate.set()
        assert running.result() == expected_text([1, 2, 3], 3)


@pytest.fixture
def picky_engine(monkeypatch):
    """A turn holding REFUSED is refused as bad input, one holding EXPLODES fails unexpectedly (unmutated)."""
    begin_turn = Engine._begin_turn

    def picky(self, request, token_ids, turn_options):
        if REFUSED in token_ids:
            raise InvalidArgumentError(f"token {REFUSED} is not allowed here")
        if EXPLODES in token_ids:
            raise RuntimeError("secret internal detail at /srv/model")
        return begin_turn(self, request, token_ids, turn_options)

    monkeypatch.setattr(Engine, "_begin_turn", picky)


def test_one_requests_command_error_fails_only_that_request(picky_engine):
    server = serve(SyntheticModel(vocab_size=VOCAB))
    try:
        client = client_of(server)
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="synthetic", prompt=[1, REFUSED], max_tokens=3)
        assert f"token {REFUSED} is not allowed" in refused.value.message

        response = httpx.post(
            server.url + "/v1/completions",
            json={"model": "synthetic", "prompt": [1, EXPLODES], "max_tokens": 3},
        )
        assert response.status_code == 500
        error = response.json()["error"]
        assert "secret" not in json.dumps(error) and "RuntimeError" not in json.dumps(error)
        assert response.headers["x-request-id"] in error["message"]

        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        assert _complete(server, [4, 5]) == expected_text([4, 5], 3)
        text = settled_metrics(server)
        assert metric(text, "pagedgen:healthy", model_name="synthetic") == 1
        assert metric(text, "pagedgen:request_rejected_total", model_name="synthetic", reason="invalid") == 1
        assert metric(text, "pagedgen:request_failure_total", model_name="synthetic", reason="internal") == 1
        assert (
            metric(text, "pagedgen:request_success_total", model_name="synthetic", finished_reason="length")
            == 1
        )
        assert metric(text, "pagedgen:kv_cache_blocks_free", model_name="synthetic") == NUM_BLOCKS
    finally:
        server.stop()


def test_a_failing_cancel_leaves_the_engine_healthy_and_frees_the_blocks(gated_one, monkeypatch):
    def broken_cancel(self, request, turn_id):
        raise RuntimeError("cancel_turn broke")

    monkeypatch.setattr(Engine, "_cancel_turn", broken_cancel)
    server, model = gated_one
    body = json.dumps({"model": "synthetic", "prompt": [1, 2, 3], "max_tokens": 40})
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head.encode() + body.encode())
        assert model.entered.wait(timeout=120)
    disconnects = app_state(server).metrics.disconnects
    wait_until(lambda: disconnects._value.get() == 1, "the server noticed the disconnect")
    model.gate.set()
    text = settled_metrics(server)
    assert metric(text, "pagedgen:healthy", model_name="synthetic") == 1
    assert metric(text, "pagedgen:kv_cache_blocks_free", model_name="synthetic") == NUM_BLOCKS
    assert _complete(server, [4, 5]) == expected_text([4, 5], 3)
