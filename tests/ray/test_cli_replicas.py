"""``pagedgen serve --replicas 2`` as a subprocess (its own local Ray cluster), answering the ``openai``
client streaming and not, with the affinity visible in usage and metrics, then ending on SIGTERM after the
stream in flight has finished, refusing new requests meanwhile with the single server's 503
``shutting_down`` (the application's graceful shutdown)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagedgen.models.synthetic import SyntheticTokenizer, synthetic_greedy
from tests.ray.cluster import SHUTDOWN_ERROR, free_port, per_replica, routed, wait_healthy

ROOT = Path(__file__).resolve().parents[2]  # this checkout: the subprocess serves its code
WAIT_S = 600  # the bound of every wait: a Ray cluster and three replicas starting on a loaded 2-core machine
VOCAB = 257  # ModelSource("synthetic")'s default
DRAIN_S = (
    300  # --shutdown-timeout: the stream in flight at SIGTERM must be able to finish on a loaded machine
)
DRAINED_TOKENS = 3500  # that stream's length: long enough to be in flight while the drain is checked


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    stderr_path = tmp_path_factory.mktemp("serve") / "serve.stderr"
    command = [sys.executable, "-m", "pagedgen.cli", "serve", "--model", "synthetic", "--port", str(port)]
    command += ["--replicas", "2", "--max-batch-size", "8", "--num-blocks", "256"]
    command += ["--shutdown-timeout", str(DRAIN_S)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("PAGEDGEN_API_KEY", None)
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, stderr_path, WAIT_S, "the replicated server")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)


def _assert_draining(url: str) -> None:
    """Once the ingress drains, ``/health`` and a new request get the single server's 503 (not an answer
    of Serve's proxy)."""
    health = httpx.get(url + "/health", timeout=WAIT_S)
    for _ in range(WAIT_S * 2):  # the signal reaches the ingress through the launcher's drain call
        if health.status_code == 503:
            break
        time.sleep(0.5)
        health = httpx.get(url + "/health", timeout=WAIT_S)
    assert health.status_code == 503 and health.json() == {"error": SHUTDOWN_ERROR}
    body = {"model": "synthetic", "prompt": "too late", "max_tokens": 4}
    refused = httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json() == {"error": SHUTDOWN_ERROR}


def _expected(prompt: str, n: int) -> str:
    codec = SyntheticTokenizer(VOCAB)
    return codec.decode(synthetic_greedy(codec.encode(prompt), n, VOCAB))


def test_the_openai_client_through_two_replicas(served):
    proc, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)
    prompt = "a shared system prompt for every turn of this chat, long enough for blocks. "
    first = client.completions.create(model="synthetic", prompt=prompt, max_tokens=12, temperature=0)
    assert first.choices[0].text == _expected(prompt, 12)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(
        model="synthetic", prompt=prompt + "turn two", max_tokens=12, temperature=0
    )
    assert second.choices[0].text == _expected(prompt + "turn two", 12)
    assert second.usage.prompt_tokens_details.cached_tokens == len(prompt) // 16 * 16  # found on its replica
    chunks = list(
        client.completions.create(
            model="synthetic",
            prompt=prompt + "streamed",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == _expected(prompt + "streamed", 20)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= len(prompt) // 16 * 16
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="synthetic", prompt="x", temperature=9)
    text = ""
    for _ in range(240):  # the ingress refreshes the replicas' counters about every second
        text = httpx.get(url + "/metrics", timeout=60).text
        hits = per_replica(text, "pagedgen:prefix_cache_hits_total")
        if len(hits) == 2 and sum(hits.values()) >= 2 * (len(prompt) // 16 * 16):
            break
        time.sleep(0.5)
    hits = per_replica(text, "pagedgen:prefix_cache_hits_total")
    assert sorted(hits.values())[0] == 0 and len(hits) == 2, hits  # every turn's cache hits on one replica
    # and the router says why: the first prompt was new, the two after it went to its prefix's holder
    assert routed(text) == {"prefix": 2, "balanced": 0, "new": 1, "random": 0}

    # graceful shutdown of the whole application: a stream in flight at SIGTERM runs to its end
    body = {"model": "synthetic", "prompt": prompt + "drained", "max_tokens": DRAINED_TOKENS}
    body.update(temperature=0, ignore_eos=True, stream=True)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT_S) as r:
        lines = r.iter_lines()
        events = []
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                break
        proc.send_signal(signal.SIGTERM)
        _assert_draining(url)  # while the stream is held open (unread), so still in flight
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]", rest[-3:]
    events += [json.loads(data) for data in rest[:-1]]
    assert not [event for event in events if "error" in event], events[-2:]
    text = "".join(event["choices"][0]["text"] for event in events if event.get("choices"))
    assert text == _expected(prompt + "drained", DRAINED_TOKENS)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(WAIT_S) == 0
