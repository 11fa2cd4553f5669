"""The OpenAI-compatible server on the default model, driven by the real ``openai`` client.

Oracle: the engine run directly through ``pg.LLM`` on the same loaded model, greedy. The server must return
the same text, usage and finish reason, streaming or not.
"""

from __future__ import annotations

import json

import httpx
import pytest

import pagedgen as pg
from tests.server.live import API_KEY, MODEL_NAME, metric

pytestmark = pytest.mark.model

CHAT = [{"role": "user", "content": "Hi"}]
PROMPT = "The three primary colors are"


def greedy(max_tokens: int, **kwargs) -> pg.SamplingParams:
    return pg.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


@pytest.fixture(scope="module")
def chat_reference(reference_llm):
    return reference_llm.chat(CHAT, greedy(24), use_tqdm=False)[0]


@pytest.fixture(scope="module")
def completion_reference(reference_llm):
    return reference_llm.generate(PROMPT, greedy(10), use_tqdm=False)[0]


def test_models_lists_the_served_model(client, default_model):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["max_model_len"] == default_model.max_context


def test_chat_non_streaming_equals_engine(client, chat_reference):
    assert chat_reference.finish_reason == "stop"  # the reply ends with EOS well before 24 tokens
    response = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=24, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == chat_reference.text
    assert choice.finish_reason == "stop"
    assert response.usage.prompt_tokens == len(chat_reference.prompt_token_ids)
    assert response.usage.completion_tokens == len(chat_reference.token_ids)
    assert response.usage.total_tokens == len(chat_reference.prompt_token_ids) + len(chat_reference.token_ids)
    assert response.object == "chat.completion"


def test_chat_streaming_equals_engine(client, chat_reference):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_completion_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_reference.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(chat_reference.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == len(chat_reference.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_non_streaming_equals_engine(client, completion_reference):
    assert completion_reference.finish_reason == "length"
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    assert response.choices[0].text == completion_reference.text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(completion_reference.prompt_token_ids)
    assert response.usage.completion_tokens == 10


def test_completion_streaming_wire_format(live_server, completion_reference):
    """The raw SSE bytes: ``data: {json}`` events, finish_reason on the last choice chunk, then [DONE]."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", live_server.url + "/v1/completions", json=body, headers=headers, timeout=900
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == completion_reference.text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert all("usage" not in c for c in chunks)  # no stream_options.include_usage: no usage field


def test_stop_string_ends_the_turn_and_is_not_returned(client, reference_llm, completion_reference):
    tokenizer = reference_llm.tokenizer
    stop = tokenizer.decode(completion_reference.token_ids[5:7])
    assert stop.strip() and stop not in tokenizer.decode(completion_reference.token_ids[:5])
    expected = reference_llm.generate(PROMPT, greedy(10, stop=(stop,)), use_tqdm=False)[0]
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop]
    )
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == expected.text
    assert stop not in response.choices[0].text
    assert completion_reference.text.startswith(response.choices[0].text)
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0, stop=stop, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(client, chat_reference):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 4 == response.usage.completion_tokens
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[1].logprob <= entry.logprob
    assert chat_reference.text.startswith(response.choices[0].message.content)


def test_completion_logprobs_without_alternatives(client):
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 3
    assert logprobs.top_logprobs == [{}, {}, {}]
    assert logprobs.text_offset[0] == 0


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, seed=1234)
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    assert first == second


def test_vllm_extensions_are_accepted(client, reference_llm):
    """top_k / min_p / repetition_penalty / ignore_eos / penalties reach the engine like LLM.generate's."""
    extra = {"top_k": 1, "min_p": 0.05, "repetition_penalty": 1.3, "ignore_eos": True}
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body=extra,
    )
    params = greedy(
        6,
        top_k=1,
        min_p=0.05,
        repetition_penalty=1.3,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=0.5,
    )
    expected = reference_llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert response.choices[0].text == expected.text


def test_health_and_metrics_are_open_without_a_key(live_server):
    assert httpx.get(live_server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(live_server.url + "/metrics").text
    assert metric(text, "pagedgen:kv_cache_blocks_total", model_name=MODEL_NAME) == 384
    assert metric(text, "pagedgen:prompt_tokens_total", model_name=MODEL_NAME) > 0


def test_a_chat_re_sent_with_its_history_hits_the_prefix_cache(client, reference_llm):
    """A client re-sends the conversation each turn: the second request finds the first one's blocks."""
    messages = [{"role": "user", "content": "Name three colours."}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And three animals?"},
    ]
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens
    expected = reference_llm.chat(messages, greedy(12), use_tqdm=False)[0]
    assert second.choices[0].message.content == expected.text
