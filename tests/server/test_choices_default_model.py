"""``n > 1`` on the default model with the ``openai`` client: greedy chat choices equal the engine's own
greedy answer, seeded choices are the one-choice answers seeded ``s + i``, and the siblings find the
prompt's full blocks in the prefix cache."""

from __future__ import annotations

import pytest

import pagedgen as pg
from tests.server.doubles import settled_metrics
from tests.server.live import MODEL_NAME, metric

pytestmark = pytest.mark.model

CHAT = [
    {"role": "system", "content": "You are a terse assistant. " * 6},
    {"role": "user", "content": "Name one primary color."},
]


def test_greedy_chat_choices_are_the_engines_answer(client, live_server, reference_llm):
    [expected] = reference_llm.chat(CHAT, pg.SamplingParams(max_tokens=8, temperature=0.0))
    before = metric(settled_metrics(live_server), "pagedgen:prefix_cache_hits_total", model_name=MODEL_NAME)
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0, n=3
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.message.content for c in response.choices] == [expected.text] * 3
    prompt = response.usage.prompt_tokens
    assert response.usage.completion_tokens == 3 * len(expected.token_ids)
    after = metric(settled_metrics(live_server), "pagedgen:prefix_cache_hits_total", model_name=MODEL_NAME)
    cached = response.usage.prompt_tokens_details.cached_tokens
    assert after - before == cached + 2 * ((prompt - 1) // 16 * 16)  # the siblings: every full block


def test_seeded_choices_are_the_one_choice_answers_of_consecutive_seeds(client):
    kwargs = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 10, "temperature": 1.0}
    stream = client.chat.completions.create(
        n=2, seed=123, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    texts = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for index in (0, 1):
        alone = client.chat.completions.create(n=1, seed=123 + index, **kwargs)
        assert alone.choices[0].message.content == texts[index]
    assert usage is not None and usage.completion_tokens > 0
