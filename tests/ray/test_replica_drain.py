"""The replicated application's graceful shutdown is the single server's: once the ingress drains, a new
request and ``/health`` get 503 ``shutting_down``, and a request still running when the drain's wait ends
is ended with the ``shutting_down`` error (an error event then ``[DONE]`` in a stream, a 503 otherwise).

Its own cluster (``tests/ray/cluster.py``): a drained ingress refuses everything until it is deleted. The
drain is called with a wait of 0 s, so both requests in flight are past it: the outcome does not depend
on how fast the machine is.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from pagedgen.server.replicas.launch import drain_ingress
from tests.ray.cluster import SHUTDOWN_ERROR, Cluster, per_replica, wait_for_metrics

TIMEOUT = httpx.Timeout(600.0)
LONG = 2000  # tokens: each request runs far longer than the drain takes to begin (both fit one replica)


@pytest.fixture(scope="module")
def cluster():
    running = Cluster()
    yield running
    running.close()


def _body(prompt: str, **extra) -> dict:
    return {"model": "synthetic", "prompt": prompt, "max_tokens": LONG, "ignore_eos": True, **extra}


class Stream(threading.Thread):
    """A streamed completion read to its end; ``first`` is set once its first event has arrived."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.first = threading.Event()
        self.status: int | None = None
        self.events: list[str] = []

    def run(self) -> None:
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=TIMEOUT) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.first.set()
        self.first.set()


class Plain(threading.Thread):
    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.response: httpx.Response | None = None

    def run(self) -> None:
        self.response = httpx.post(self.url + "/v1/completions", json=self.body, timeout=TIMEOUT)


def _running(text: str) -> float:
    return sum(per_replica(text, "pagedgen:num_requests_running").values())


def test_a_drained_application_answers_as_the_single_server(cluster):
    stream = Stream(cluster.url, _body("a stream cut by the drain", stream=True))
    plain = Plain(cluster.url, _body("a plain request cut by the drain"))
    stream.start()
    plain.start()
    assert stream.first.wait(600) and stream.events and stream.status == 200
    assert _running(wait_for_metrics(cluster.url, lambda text: _running(text) == 2)) == 2  # both in flight

    drain_ingress(0.0)  # no wait: both are ended at once with the single server's error

    stream.join(600)
    plain.join(600)
    assert not stream.is_alive() and not plain.is_alive()
    assert stream.events[-1] == "[DONE]"
    events = [json.loads(data) for data in stream.events[:-1]]
    assert events[-1]["error"] == SHUTDOWN_ERROR
    assert all("error" not in event and event["choices"] for event in events[:-1])
    assert len("".join(event["choices"][0]["text"] for event in events[:-1])) < LONG  # cut, not finished
    assert plain.response.status_code == 503
    assert plain.response.json() == {"error": SHUTDOWN_ERROR}

    # new requests and the health check: the single server's draining answers, not Serve's proxy's
    refused = httpx.post(cluster.url + "/v1/completions", json=_body("too late"), timeout=TIMEOUT)
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1" and refused.headers["content-type"] == "application/json"
    assert refused.json() == {"error": SHUTDOWN_ERROR}
    health = httpx.get(cluster.url + "/health", timeout=TIMEOUT)
    assert health.status_code == 503 and health.json() == {"error": SHUTDOWN_ERROR}
