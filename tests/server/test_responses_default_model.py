"""The Responses API on the default model with the ``openai`` client: a two-turn conversation through
``previous_response_id`` answers what ``pg.LLM``'s own multi-turn ``ChatSession`` answers, and the follow-up
continues in the first turn's still-open Request (the real chat template's markup and end-of-turn token
included), computing only its new tokens."""

from __future__ import annotations

import pytest

import pagedgen as pg
from tests.server.doubles import settled_metrics
from tests.server.live import MODEL_NAME, metric

pytestmark = pytest.mark.model


def test_a_follow_up_answers_as_the_engines_chat_session_and_computes_only_its_new_tokens(
    client, live_server, reference_llm
):
    session = reference_llm.start_chat(pg.SamplingParams(max_tokens=12, temperature=0.0))
    expected = ["".join(session.send(text)) for text in ("Hi", "What is 2+2?")]
    session_cached = session.last.cached_tokens
    session.close()
    resumed = metric(settled_metrics(live_server), "pagedgen:num_turns_resumed_total", model_name=MODEL_NAME)

    first = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=12, temperature=0)
    assert first.output_text == expected[0]
    # the server is the session's: earlier tests' chats may have left the system prompt's block cached
    assert first.usage.input_tokens_details.cached_tokens < first.usage.input_tokens
    second = client.responses.create(
        model=MODEL_NAME,
        input="What is 2+2?",
        previous_response_id=first.id,
        max_output_tokens=12,
        temperature=0,
    )
    assert second.output_text == expected[1]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is 2+2?"},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    held = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens == session_cached == held
    after = metric(settled_metrics(live_server), "pagedgen:num_turns_resumed_total", model_name=MODEL_NAME)
    assert after == resumed + 1
