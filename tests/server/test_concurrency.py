"""32 concurrent streaming clients against the live server; 8 of them hang up mid-stream.

Every client that stays must get exactly its own greedy text; every client that leaves must have its turn
cancelled and its request closed, so that afterwards the pool has every KV block free again.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

import pagedgen as pg
from tests.server.doubles import settled_metrics, wait_until
from tests.server.live import API_KEY, MODEL_NAME, metric

pytestmark = pytest.mark.model

NUM_COMPLETE = 24
NUM_DISCONNECT = 8
MAX_TOKENS = 8
# Disconnect detection is asynchronous (the server notices a closed socket on its own schedule); the test
# re-reads /metrics until the cancellations have been applied, and fails if that never happens.

PROMPTS = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(NUM_COMPLETE)]
LEAVING = [f"Write a very long story about the number {i}." for i in range(NUM_DISCONNECT)]


async def _complete(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    parts, finish = [], None
    async for chunk in stream:
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


async def _leave_early(client: openai.AsyncOpenAI, prompt: str) -> int:
    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=1024,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    async for _chunk in stream:
        received += 1
        if received == 2:
            break
    await stream.close()  # closes the connection mid-stream
    return received


async def _run_clients(url: str) -> tuple[list, list]:
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=900
    ) as client:
        staying = [_complete(client, p) for p in PROMPTS]
        leaving = [_leave_early(client, p) for p in LEAVING]
        results = await asyncio.gather(*staying, *leaving)
    return list(results[:NUM_COMPLETE]), list(results[NUM_COMPLETE:])


def _settled_metrics(server, cancelled_before: float) -> str:
    def cancelled() -> float:
        text = httpx.get(server.url + "/metrics").text
        return metric(text, "pagedgen:request_cancelled_total", model_name=MODEL_NAME) - cancelled_before

    wait_until(lambda: cancelled() >= NUM_DISCONNECT, "every leaving client's turn was cancelled")
    return settled_metrics(server)


def test_32_concurrent_streams_with_8_disconnects(live_server, reference_llm):
    before = httpx.get(live_server.url + "/metrics").text
    cancelled_before = metric(before, "pagedgen:request_cancelled_total", model_name=MODEL_NAME)

    completed, left = asyncio.run(_run_clients(live_server.url))

    expected = reference_llm.generate(
        PROMPTS, pg.SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False
    )
    assert [text for text, _ in completed] == [e.text for e in expected]
    assert [finish for _, finish in completed] == [e.finish_reason for e in expected]
    assert left == [2] * NUM_DISCONNECT

    text = _settled_metrics(live_server, cancelled_before)
    assert (
        metric(text, "pagedgen:request_cancelled_total", model_name=MODEL_NAME) - cancelled_before
        == NUM_DISCONNECT
    )
    total = metric(text, "pagedgen:kv_cache_blocks_total", model_name=MODEL_NAME)
    assert metric(text, "pagedgen:kv_cache_blocks_free", model_name=MODEL_NAME) == total
    assert metric(text, "pagedgen:kv_cache_blocks_used", model_name=MODEL_NAME) == 0
    assert metric(text, "pagedgen:num_requests_running", model_name=MODEL_NAME) == 0
    assert metric(text, "pagedgen:num_requests_waiting", model_name=MODEL_NAME) == 0

    # The server keeps serving after the disconnects.
    again = httpx.post(
        live_server.url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=900,
    )
    assert again.json()["choices"][0]["text"] == expected[0].text
