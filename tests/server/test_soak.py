"""A soak of the live server on the synthetic model: three hundred concurrent clients, good and bad.

Valid completions (streaming and not), invalid ones (a logit bias outside the vocabulary, a mistyped and an
out-of-range parameter, a body over the size limit, a wrong API key), streams that disconnect after their
first token and streams cancelled as soon as their response starts, all at once. Afterwards every valid
request got exactly the text it gets alone (the synthetic model's closed formula), every invalid one its
4xx, the engine is healthy with every block free, and the metrics count exactly what the clients saw.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest

from pagedgen.models.synthetic import SyntheticModel
from tests.server.doubles import VOCAB, expected_text, serve, settled_metrics, wait_until
from tests.server.live import metric

KEY = "soak-key"
LIMIT = 8192
PER_KIND = 20
VALID, VALID_STREAM = 6 * PER_KIND, 3 * PER_KIND
# kind -> (status the client must see, the server's rejected-counter reason)
INVALID = {
    "bad_logit_bias": (400, "invalid"),
    "bad_type": (400, "invalid"),
    "bad_range": (400, "invalid"),
    "too_large": (413, "too_large"),
    "wrong_key": (401, "unauthorized"),
}
LEAVING = ("disconnect_after_first_token", "cancel_at_start")


@dataclass(frozen=True, slots=True)
class Job:
    kind: str
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(slots=True)
class Seen:
    job: Job
    status: int
    text: str = ""
    param: str | None = None


@pytest.fixture
def soak_server():
    server = serve(
        SyntheticModel(vocab_size=VOCAB),
        max_batch_size=16,
        api_key=KEY,
        max_body_bytes=LIMIT,
        max_queued_requests=1000,  # above the soak's size: admission control has its own test
    )
    yield server
    server.stop()


def make_jobs() -> list[Job]:
    rng = random.Random(7)
    kinds = ["valid"] * VALID + ["valid_stream"] * VALID_STREAM
    kinds += [kind for kind in [*INVALID, *LEAVING] for _ in range(PER_KIND)]
    rng.shuffle(kinds)
    jobs = []
    for kind in kinds:
        prompt = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 12)))
        max_tokens = 1000 if kind in LEAVING else rng.randint(1, 16)  # leaving ones can't finish in time
        jobs.append(Job(kind, prompt, max_tokens))
    return jobs


def body_of(job: Job) -> dict:
    body = {"model": "synthetic", "prompt": list(job.prompt), "max_tokens": job.max_tokens, "temperature": 0}
    if job.kind in ("valid_stream", *LEAVING):
        body["stream"] = True
    if job.kind == "bad_logit_bias":
        body["logit_bias"] = {str(VOCAB + 1000): 5.0}
    elif job.kind == "bad_type":
        body["temperature"] = "hot"
    elif job.kind == "bad_range":
        body["top_p"] = 0.0
    elif job.kind == "too_large":
        body["prompt"] = "x" * (2 * LIMIT)
    return body


async def send(client: httpx.AsyncClient, url: str, job: Job) -> Seen:
    key = "not-the-key" if job.kind == "wrong_key" else KEY
    headers = {"Authorization": f"Bearer {key}"}
    body = body_of(job)
    if not body.get("stream"):
        response = await client.post(url, json=body, headers=headers)
        return seen_of(job, response.status_code, response.json())
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if job.kind == "cancel_at_start" or response.status_code != 200:
            return Seen(job, response.status_code)  # leaving the block closes the connection
        text = []
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = "".join(choice["text"] for choice in json.loads(line[6:])["choices"])
            text.append(delta)
            if delta and job.kind == "disconnect_after_first_token":
                break
        return Seen(job, response.status_code, "".join(text))


def seen_of(job: Job, status: int, payload: dict) -> Seen:
    if status == 200:
        return Seen(job, status, payload["choices"][0]["text"])
    return Seen(job, status, param=payload["error"].get("param"))


async def soak(url: str, jobs: list[Job]) -> list[Seen]:
    limits = httpx.Limits(max_connections=len(jobs))
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return list(await asyncio.gather(*(send(client, url, job) for job in jobs)))


def test_soak_of_mixed_clients_leaves_exact_outputs_counted_metrics_and_no_leak(soak_server):
    jobs = make_jobs()
    seen = asyncio.run(soak(soak_server.url + "/v1/completions", jobs))

    for s in seen:
        if s.job.kind in ("valid", "valid_stream"):
            assert (s.status, s.text) == (200, expected_text(list(s.job.prompt), s.job.max_tokens)), s.job
        elif s.job.kind in INVALID:
            assert s.status == INVALID[s.job.kind][0], s.job
        else:
            assert s.status == 200 and s.job.max_tokens > len(s.text)
    params = {s.param for s in seen if s.job.kind == "bad_logit_bias"}
    assert params == {"logit_bias"}
    assert {s.param for s in seen if s.job.kind == "bad_range"} == {"top_p"}

    def sample(name: str, **labels: str) -> float:
        return metric(httpx.get(soak_server.url + "/metrics").text, name, model_name="synthetic", **labels)

    leaving = len(LEAVING) * PER_KIND
    wait_until(lambda: sample("pagedgen:request_cancelled_total") == leaving, "every leaving turn cancelled")
    text = settled_metrics(soak_server)

    def count(name: str, **labels: str) -> float:
        try:
            return metric(text, name, model_name="synthetic", **labels)
        except KeyError:  # a labelled counter that was never incremented has no sample
            return 0.0

    assert count("pagedgen:request_success_total", finished_reason="length") == VALID + VALID_STREAM
    assert count("pagedgen:request_success_total", finished_reason="stop") == 0
    rejected = Counter(
        reason for status, reason in (INVALID[s.job.kind] for s in seen if s.job.kind in INVALID)
    )
    for reason in ("invalid", "too_large", "unauthorized", "queue_full", "unhealthy"):
        assert count("pagedgen:request_rejected_total", reason=reason) == rejected.get(reason, 0), reason
    for reason in ("internal", "unhealthy"):
        assert count("pagedgen:request_failure_total", reason=reason) == 0, reason
    assert count("pagedgen:request_cancelled_total") == leaving
    assert count("pagedgen:client_disconnects_total") == leaving
    assert count("pagedgen:healthy") == 1 and count("pagedgen:num_requests_admitted") == 0
    total = count("pagedgen:kv_cache_blocks_total")
    assert total > 0 and count("pagedgen:kv_cache_blocks_free") == total
    assert httpx.get(soak_server.url + "/health").status_code == 200
