"""Two replicas behind Ray Serve on the synthetic model: the single server's answers, cache affinity,
blocks freed after a mixed load, and a killed replica replaced while service continues.

One local cluster for the module (``tests/ray/cluster.py``); the kill test runs last (it replaces a replica).
"""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray

from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer
from pagedgen.server.app import ServerOptions, build_app
from pagedgen.server.replicas.client import REPLICA_LOST_MESSAGE
from tests.ray.cluster import (
    VOCAB,
    Cluster,
    engine_config,
    metrics,
    per_replica,
    routed,
    settled_metrics,
    wait_for_metrics,
)
from tests.server.serving import ServedApp

TIMEOUT = httpx.Timeout(600.0)


@pytest.fixture(scope="module")
def cluster():
    running = Cluster()
    yield running
    running.close()


@pytest.fixture(scope="module")
def single():
    """The single server on the same model, engine configuration and options: the oracle."""
    options = ServerOptions(model_name="synthetic", shutdown_timeout=5)
    app = build_app(
        SyntheticModel(vocab_size=VOCAB), engine_config(), options, tokenizer=SyntheticTokenizer(VOCAB)
    )
    served = ServedApp(app).start()
    yield served
    served.stop()


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=TIMEOUT)


def _comparable(response: httpx.Response) -> tuple[int, object]:
    """Status and body without what differs between any two answers (ids, times, cached tokens)."""
    body = response.json()
    if response.status_code == 200:
        for key in ("id", "created"):
            body.pop(key)
        body["usage"].pop("prompt_tokens_details")
    return response.status_code, body


def _stream_text(url: str, body: dict) -> tuple[list[str], list[dict]]:
    """A stream's text deltas and its non-text events (finish, usage, error) in order."""
    deltas, others = [], []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if choices and choices[0]["text"]:
                deltas.append(choices[0]["text"])
            if not choices or choices[0].get("finish_reason"):
                others.append({k: v for k, v in event.items() if k not in ("id", "created")})
    return deltas, others


REQUESTS = [
    (
        "/v1/completions",
        {"model": "synthetic", "prompt": "the quick brown fox " * 3, "max_tokens": 12, "temperature": 0},
    ),
    ("/v1/completions", {"model": "synthetic", "prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0}),
    (
        "/v1/completions",
        {"model": "synthetic", "prompt": "abc", "max_tokens": 9, "stop": ["Q"], "temperature": 0},
    ),
    (
        "/v1/completions",
        {"model": "synthetic", "prompt": "seeded", "temperature": 0.9, "seed": 3, "max_tokens": 8},
    ),
    ("/v1/completions", {"model": "synthetic", "prompt": ["one", "two"], "max_tokens": 4, "n": 2, "seed": 1}),
    (
        "/v1/completions",
        {"model": "synthetic", "prompt": "lp", "max_tokens": 3, "logprobs": 2, "temperature": 0},
    ),
    ("/v1/completions", {"model": "synthetic", "prompt": "hi", "temperature": 5}),  # 400 naming temperature
    ("/v1/completions", {"model": "gpt-4o", "prompt": "hi"}),  # 404 model_not_found
    ("/v1/completions", {"model": "synthetic", "prompt": [999], "max_tokens": 2}),  # outside the vocabulary
    ("/v1/completions", {"model": "synthetic", "prompt": "x" * 5000}),  # longer than the context
    ("/v1/chat/completions", {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "synthetic", "input": "hi"}),  # the same route, the same 400 (no template)
    ("/v1/responses", {"model": "synthetic", "input": "hi", "previous_response_id": "resp_none"}),  # 404
]


def test_two_replicas_answer_as_the_single_server(cluster, single):
    for path, body in REQUESTS:
        assert _comparable(_post(cluster.url, path, body)) == _comparable(_post(single.url, path, body)), body
    for path in ("/v1/models", "/version", "/health"):
        assert httpx.get(cluster.url + path).json() == httpx.get(single.url + path).json()
    stream = {
        "model": "synthetic",
        "prompt": "streamed prompt",
        "max_tokens": 20,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    replicated, single_stream = _stream_text(cluster.url, stream), _stream_text(single.url, stream)
    assert "".join(replicated[0]) == "".join(single_stream[0]) and len("".join(replicated[0])) == 20
    for event in replicated[1] + single_stream[1]:
        if event.get("usage"):
            event["usage"].pop("prompt_tokens_details")
    assert replicated[1] == single_stream[1]


def test_a_conversation_stays_on_one_replica_and_reports_cached_tokens(cluster):
    settled = settled_metrics(cluster.url)
    before, routes_before = per_replica(settled, "pagedgen:prompt_tokens_total"), routed(settled)
    prompt, cached, sizes = "system: you answer in one line. " * 4, [], []
    for turn in range(4):
        prompt += f"user: question number {turn}? assistant:"
        body = {"model": "synthetic", "prompt": prompt, "max_tokens": 16, "temperature": 0}
        answer = _post(cluster.url, "/v1/completions", body).json()
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        sizes.append(answer["usage"]["prompt_tokens"])
        prompt += answer["choices"][0]["text"] + " "
    sent = sum(sizes)
    # each later turn finds at least the full blocks of the turn before it (block size 16)
    assert cached[0] == 0 and all(cached[k] >= sizes[k - 1] // 16 * 16 > 0 for k in (1, 2, 3)), cached

    def counted(text: str) -> bool:
        after = per_replica(text, "pagedgen:prompt_tokens_total")
        return sum(after.values()) - sum(before.values()) == sent

    after = per_replica(wait_for_metrics(cluster.url, counted), "pagedgen:prompt_tokens_total")
    grown = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
    assert list(grown.values()) == [sent], grown  # every turn's prompt went to one replica
    text = metrics(cluster.url)
    hits = per_replica(text, "pagedgen:prefix_cache_hits_total")
    assert hits[next(iter(grown))] >= sum(cached)
    # the router's own account: the first turn had no routed prefix, the three after went to its holder
    assert {route: routed(text)[route] - routes_before[route] for route in routes_before} == {
        "prefix": 3,
        "balanced": 0,
        "new": 1,
        "random": 0,
    }


async def _mixed_request(client: httpx.AsyncClient, index: int, rng: random.Random) -> int:
    prompt = ("shared prefix of the mixed load " if index % 2 else "") + f"request {index} " * rng.randint(
        1, 6
    )
    body = {
        "model": "synthetic",
        "prompt": prompt,
        "max_tokens": rng.randint(1, 40),
        "temperature": rng.choice([0, 1]),
    }
    kind = index % 5
    if kind == 3:  # a stream the client leaves after its first chunk
        async with client.stream(
            "POST", "/v1/completions", json={**body, "stream": True, "max_tokens": 400}
        ) as r:
            async for _line in r.aiter_lines():
                break
        return 499
    if kind == 4:  # refused before generating
        body["top_p"] = 7
    if kind == 2:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = [line async for line in r.aiter_lines()]
            assert lines[-2] == "data: [DONE]", lines[-3:]
            return r.status_code
    response = await client.post("/v1/completions", json=body)
    return response.status_code


def test_a_hundred_mixed_requests_leave_every_replica_s_blocks_free(cluster):
    rng = random.Random(0)

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=TIMEOUT) as client:
            gate = asyncio.Semaphore(16)

            async def one(index: int) -> int:
                async with gate:
                    return await _mixed_request(client, index, rng)

            return await asyncio.gather(*(one(index) for index in range(100)))

    statuses = asyncio.run(run())
    assert sorted(set(statuses)) == [200, 400, 499] and statuses.count(400) == 20

    def settled(text: str) -> bool:
        free = per_replica(text, "pagedgen:kv_cache_blocks_free")
        total = per_replica(text, "pagedgen:kv_cache_blocks_total")
        running = per_replica(text, "pagedgen:num_requests_running")
        return len(free) == 2 and free == total and not any(running.values())

    text = wait_for_metrics(cluster.url, settled)
    assert settled(text), text
    served = per_replica(text, "pagedgen:prompt_tokens_total")
    assert all(value > 0 for value in served.values()) and len(served) == 2  # both replicas took work


def _replica_actor(replica: str):
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith("SERVE_REPLICA::") and entry["name"].endswith("#" + replica):
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    raise AssertionError(f"no actor of replica {replica}")


def _jobs_on(text: str, replica: str) -> float:
    """Jobs a replica holds (running and queued), from its last published counters."""
    running = per_replica(text, "pagedgen:num_requests_running").get(replica, 0)
    return running + per_replica(text, "pagedgen:num_requests_waiting").get(replica, 0)


def test_a_killed_replica_ends_its_requests_cleanly_and_is_replaced(cluster):
    """Kill the replica serving a stream and a 4-choice non-streaming request (the same prompt, so the same
    replica): the stream gets one error event and [DONE], the other request a 503, neither hangs; later
    requests are answered; a replacement appears and /health stays ok."""
    prompt = "a prompt whose blocks pin it to one replica " * 2
    before = per_replica(settled_metrics(cluster.url), "pagedgen:prompt_tokens_total")
    first = _post(
        cluster.url, "/v1/completions", {"model": "synthetic", "prompt": prompt, "max_tokens": 1}
    ).json()

    def counted(text: str) -> bool:
        after = per_replica(text, "pagedgen:prompt_tokens_total")
        return sum(after.values()) - sum(before.values()) == first["usage"]["prompt_tokens"]

    after = per_replica(wait_for_metrics(cluster.url, counted), "pagedgen:prompt_tokens_total")
    (holder,) = [name for name in after if after[name] != before.get(name, 0)]
    long = {"model": "synthetic", "prompt": prompt, "ignore_eos": True}
    body = {**long, "max_tokens": 3500, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        # four choices of 3,000 tokens need three times the replica's 256 blocks: they queue behind each other
        batch = pool.submit(_post, cluster.url, "/v1/completions", {**long, "max_tokens": 3000, "n": 4})
        with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    break
            held = wait_for_metrics(cluster.url, lambda text: _jobs_on(text, holder) == 5)
            assert _jobs_on(held, holder) == 5, held  # the stream and the four choices, all on the holder
            ray.kill(_replica_actor(holder), no_restart=True)
            rest = [line for line in lines if line.startswith("data: ")]
        refused = batch.result()
    events = [json.loads(line[6:]) for line in rest[:-1]]
    errors = [event["error"] for event in events if "error" in event]
    assert len(errors) == 1 and errors[0]["code"] == "unhealthy", events[-2:]
    assert errors[0]["message"] == REPLICA_LOST_MESSAGE
    assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events)
    assert rest[-1] == "data: [DONE]"
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "unhealthy"
    for index in range(6):  # new requests go to the live replica (then to the replacement)
        answer = _post(
            cluster.url,
            "/v1/completions",
            {"model": "synthetic", "prompt": f"after {index}", "max_tokens": 4},
        )
        assert answer.status_code == 200 and len(answer.json()["choices"][0]["text"]) == 4

    def replaced(text: str) -> bool:
        healthy = per_replica(text, "pagedgen:healthy")
        return len(healthy) == 2 and holder not in healthy and all(healthy.values())

    assert replaced(wait_for_metrics(cluster.url, replaced))
    assert httpx.get(cluster.url + "/health").json() == {"status": "ok"}
