"""Hostile connections: slow heads, idle sockets, slow bodies, the API docs, and DNS rebinding.

The server is built as ``pagedgen serve`` builds it (``tests/server/serving.py``) on the synthetic model, with
short timeouts so that every probe ends in a few seconds: a client that trickles its request head gets 408 and
is closed, so is one that trickles its body, an idle or kept-alive connection is closed; a neighbour stream
meanwhile returns its exact text and every KV block is free afterwards. Every wait is bounded (a socket
timeout, a round count): a server that never cuts a connection fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pytest

from pagedgen.models.synthetic import SyntheticModel
from tests.server.doubles import NUM_BLOCKS, VOCAB, expected_text
from tests.server.live import metric
from tests.server.serving import serve_synthetic

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0
KEEP_ALIVE_TIMEOUT = 0.5
SOCKET_BOUND_S = 60  # a recv that waits longer means the server never cut the connection
SLOW_CONNECTIONS = 50
LINE_EVERY_S = 0.2
MAX_LINES = 150  # 30 s of header lines: far past the head deadline
KEY = "k-123"


@pytest.fixture
def server():
    served = serve_synthetic(
        SyntheticModel(vocab_size=VOCAB),
        header_timeout=HEADER_TIMEOUT,
        body_timeout=BODY_TIMEOUT,
        keep_alive_timeout=KEEP_ALIVE_TIMEOUT,
        allowed_hosts=frozenset(),  # what a keyless loopback `pagedgen serve` gets
    )
    yield served
    served.stop()


def _connect(served) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=SOCKET_BOUND_S)
    return sock


def _read_to_eof(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _error_of(response: bytes) -> tuple[str, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return head.decode("ascii").split("\r\n")[0], json.loads(body)["error"]


def test_a_trickled_request_head_gets_408_and_is_closed(server):
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
    status, error = _error_of(_read_to_eof(sock))
    sock.close()
    assert status == "HTTP/1.1 408 Request Timeout"
    assert (
        error["code"] == "request_timeout" and error["message"] == "the request head did not arrive in time"
    )


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(server):
    sock = _connect(server)
    assert _read_to_eof(sock) == b""
    sock.close()


def test_a_kept_alive_connection_is_closed_once_idle(server):
    sock = _connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    answer = _read_to_eof(sock)  # the answer, then the close once the connection idled past the keep-alive
    sock.close()
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b'{"status":"ok"}')


def test_a_trickled_body_gets_408_and_is_closed(server):
    sock = _connect(server)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    sock.sendall(head + b"Content-Length: 100\r\n\r\n" + b'{"model": ')
    answer = _read_to_eof(sock)
    sock.close()
    status, error = _error_of(answer)
    assert status == "HTTP/1.1 408 Request Timeout" and b"connection: close" in answer.lower()
    assert error["code"] == "request_timeout"
    assert error["message"] == f"the request body did not arrive within {BODY_TIMEOUT:g} s"


def _slowloris(served, outcome: dict[str, int]) -> None:
    """50 connections, each sending one header line per round until the server cuts it (or lines run out)."""
    socks = [_connect(served) for _ in range(SLOW_CONNECTIONS)]
    for sock in socks:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
    alive = set(range(SLOW_CONNECTIONS))
    for line in range(MAX_LINES):
        if not alive:
            break
        readable, _, _ = select.select([socks[i] for i in alive], [], [], 0)
        for sock in readable:
            data = _read_to_eof(sock)
            outcome["answered_408"] += data.startswith(b"HTTP/1.1 408")
            alive.discard(socks.index(sock))
        for i in list(alive):
            try:
                socks[i].sendall(f"X-Line-{line}: {'a' * 20}\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                alive.discard(i)  # cut between the select and the send
        time.sleep(LINE_EVERY_S)
    outcome["still_open"] = len(alive)
    for sock in socks:
        sock.close()


def test_fifty_slowloris_connections_are_cut_while_a_neighbour_streams(server):
    outcome = {"answered_408": 0, "still_open": -1}
    attacker = threading.Thread(target=_slowloris, args=(server, outcome), daemon=True)
    attacker.start()
    prompt = [(3 * j + 1) % VOCAB for j in range(12)]
    body = {"model": "synthetic", "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=SOCKET_BOUND_S) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    attacker.join(MAX_LINES * LINE_EVERY_S + SOCKET_BOUND_S)
    assert not attacker.is_alive()
    assert outcome["still_open"] == 0  # every connection was cut long before its client ran out of lines
    assert outcome["answered_408"] > 0  # those cut between a select and a send may see a reset instead
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected_text(prompt, 24)
    metrics = httpx.get(server.url + "/metrics").text
    assert metric(metrics, "pagedgen:kv_cache_blocks_free", model_name="synthetic") == NUM_BLOCKS


# ---------------------------------------------------------------- the API docs


DOCS = ("/docs", "/redoc", "/openapi.json")


def test_the_api_docs_need_the_key_when_one_is_set():
    served = serve_synthetic(SyntheticModel(vocab_size=VOCAB), api_key=KEY)
    try:
        for path in DOCS:
            refused = httpx.get(served.url + path)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            allowed = httpx.get(served.url + path, headers={"Authorization": f"Bearer {KEY}"})
            assert allowed.status_code == 200
        assert httpx.get(served.url + "/health").status_code == 200  # the probes still need no key
    finally:
        served.stop()


def test_no_docs_removes_them():
    served = serve_synthetic(SyntheticModel(vocab_size=VOCAB), docs=False)
    try:
        for path in DOCS:
            assert httpx.get(served.url + path).status_code == 404
        assert httpx.get(served.url + "/v1/models").status_code == 200
    finally:
        served.stop()


# ---------------------------------------------------------------- DNS rebinding


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil"]
)
def test_a_keyless_loopback_server_refuses_a_foreign_host(server, host):
    for path in ("/v1/models", "/health", "/metrics", "/docs"):
        response = httpx.get(server.url + path, headers={"Host": host})
        assert response.status_code == 421
        assert response.json()["error"]["code"] == "misdirected_request"
    body = {"model": "synthetic", "prompt": [1, 2], "max_tokens": 2}
    assert httpx.post(server.url + "/v1/completions", json=body, headers={"Host": host}).status_code == 421


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:8000", "127.0.0.1", "127.0.0.1:1", "[::1]", "[::1]:80"]
)
def test_loopback_names_are_accepted_with_any_port(server, host):
    assert httpx.get(server.url + "/v1/models", headers={"Host": host}).status_code == 200


def test_an_added_name_is_accepted_and_a_keyed_server_checks_no_host():
    named = serve_synthetic(SyntheticModel(vocab_size=VOCAB), allowed_hosts=frozenset({"box.lan"}))
    keyed = serve_synthetic(SyntheticModel(vocab_size=VOCAB), api_key=KEY)
    try:
        assert httpx.get(named.url + "/health", headers={"Host": "box.lan:8000"}).status_code == 200
        assert httpx.get(named.url + "/health", headers={"Host": "evil.example"}).status_code == 421
        auth = {"Host": "evil.example", "Authorization": f"Bearer {KEY}"}
        assert httpx.get(keyed.url + "/v1/models", headers=auth).status_code == 200
    finally:
        named.stop()
        keyed.stop()


def test_the_head_deadline_also_bounds_the_next_request_on_a_kept_alive_connection():
    served = serve_synthetic(
        SyntheticModel(vocab_size=VOCAB), header_timeout=HEADER_TIMEOUT, keep_alive_timeout=60
    )
    try:
        sock = _connect(served)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection before answering"
            first += chunk
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next request's head, never finished
        status, error = _error_of(_read_to_eof(sock))
        sock.close()
    finally:
        served.stop()
    assert status == "HTTP/1.1 408 Request Timeout" and error["code"] == "request_timeout"
