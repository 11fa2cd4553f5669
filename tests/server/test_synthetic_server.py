"""Server behaviour that needs no real model: exact tokens and engine failure, on the synthetic model.

The synthetic model's greedy continuation is a closed formula (``synthetic_greedy``), so the text of every
completion is known exactly. A model whose forward raises an unknown error makes the engine unhealthy: from
then on every route answers 503, ``/health`` with its own body, while ``/metrics`` keeps answering.
"""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest

from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer, synthetic_greedy
from tests.server.doubles import (
    NUM_BLOCKS,
    POISON,
    VOCAB,
    FailingModel,
    GatedModel,
    app_state,
    client_of,
    serve,
    settled_metrics,
    wait_until,
)
from tests.server.live import metric


@pytest.fixture
def synthetic_server():
    server = serve(SyntheticModel(vocab_size=VOCAB))
    yield server
    server.stop()


@pytest.fixture
def failing_server():
    server = serve(FailingModel(vocab_size=VOCAB))
    yield server
    server.stop()


@pytest.fixture
def gated():
    model = GatedModel(vocab_size=VOCAB)
    server = serve(model)
    yield server, model
    model.gate.set()
    server.stop()


_client = client_of


def test_completions_return_the_exact_synthetic_tokens(synthetic_server):
    client = _client(synthetic_server)
    tokenizer = SyntheticTokenizer(VOCAB)
    for prompt in ([5, 6, 7], [40, 2, 9, 11, 3]):
        expected = tokenizer.decode(synthetic_greedy(prompt, 6, VOCAB))
        response = client.completions.create(model="synthetic", prompt=prompt, max_tokens=6, temperature=0)
        assert response.choices[0].text == expected
        assert response.usage.prompt_tokens == len(prompt)
        stream = client.completions.create(
            model="synthetic", prompt=prompt, max_tokens=6, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream) == expected


def test_a_conversation_re_sent_with_its_history_hits_the_prefix_cache(synthetic_server):
    """Each request is a new engine Request; the second re-sends the first prompt and its completion."""
    client = _client(synthetic_server)
    tokenizer = SyntheticTokenizer(VOCAB)
    prompt = [(7 * j + 3) % VOCAB for j in range(40)]
    first = client.completions.create(model="synthetic", prompt=prompt, max_tokens=6, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    history = prompt + synthetic_greedy(prompt, 6, VOCAB) + [9, 9, 9]
    second = client.completions.create(model="synthetic", prompt=history, max_tokens=6, temperature=0)
    assert second.choices[0].text == tokenizer.decode(synthetic_greedy(history, 6, VOCAB))
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 32 <= cached < second.usage.prompt_tokens == len(history)  # whole 16-token blocks of the history
    metrics = settled_metrics(synthetic_server)
    assert metric(metrics, "pagedgen:prefix_cache_hits_total", model_name="synthetic") == cached
    queried = metric(metrics, "pagedgen:prefix_cache_queries_total", model_name="synthetic")
    assert queried >= len(prompt) + len(history)


def test_model_without_chat_template_refuses_chat(synthetic_server):
    with pytest.raises(openai.BadRequestError) as info:
        _client(synthetic_server).chat.completions.create(
            model="synthetic", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert "chat template" in info.value.message


def test_engine_failure_makes_every_route_503(failing_server):
    client = _client(failing_server)
    ok = client.completions.create(model="synthetic", prompt=[1, 2, 3], max_tokens=3, temperature=0)
    assert ok.choices[0].text == SyntheticTokenizer(VOCAB).decode(synthetic_greedy([1, 2, 3], 3, VOCAB))

    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="synthetic", prompt=[1, POISON, 3], max_tokens=3)
    assert info.value.status_code == 503

    health = httpx.get(failing_server.url + "/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "unhealthy"
    assert httpx.get(failing_server.url + "/v1/models").status_code == 503
    scrape = httpx.get(failing_server.url + "/metrics")
    assert scrape.status_code == 200  # operators need it exactly now
    assert metric(scrape.text, "pagedgen:healthy", model_name="synthetic") == 0
    assert (
        metric(scrape.text, "pagedgen:request_failure_total", model_name="synthetic", reason="unhealthy") == 1
    )
    assert (
        metric(
            scrape.text, "pagedgen:request_success_total", model_name="synthetic", finished_reason="length"
        )
        == 1
    )
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="synthetic", prompt=[1, 2, 3], max_tokens=3)
    assert info.value.status_code == 503
    assert info.value.body["code"] == "unhealthy"
    assert info.value.body["type"] == "service_unavailable"
    assert "fire" not in info.value.body["message"]  # the cause is for the log, not the client


def test_engine_failure_mid_stream_ends_the_stream_with_an_error_event(failing_server):
    """A stream already under way when the engine fails gets an error event, then [DONE]."""
    with httpx.stream(
        "POST",
        failing_server.url + "/v1/completions",
        json={"model": "synthetic", "prompt": [1, POISON], "max_tokens": 3, "stream": True},
        timeout=120,
    ) as response:
        assert response.status_code == 200  # the turn was accepted before the step that failed
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and '"unhealthy"' in lines[-2]
    assert httpx.get(failing_server.url + "/health").status_code == 503


def _wait_for_disconnect(server, count: int = 1) -> None:
    """The event loop notices a closed socket on its own schedule; read the counter until it has."""
    counter = app_state(server).metrics.disconnects
    wait_until(lambda: counter._value.get() >= count, "the server noticed the disconnect")


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_client_that_leaves_has_its_turn_cancelled_and_blocks_freed(gated, stream):
    """The model is held inside the first forward while the client hangs up; the cancel must win."""
    server, model = gated
    body = json.dumps(
        {"model": "synthetic", "prompt": [1, 2, 3], "max_tokens": 50, "stream": stream}
    ).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    request = (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request)
        assert model.entered.wait(timeout=120)
    _wait_for_disconnect(server)  # the cancel command is queued before the counter moves
    model.gate.set()
    metrics = settled_metrics(server)  # the cancel (queued before the counter moved) is applied
    assert metric(metrics, "pagedgen:request_cancelled_total", model_name="synthetic") == 1
    assert metric(metrics, "pagedgen:generation_tokens_total", model_name="synthetic") <= 1
    assert metric(metrics, "pagedgen:kv_cache_blocks_free", model_name="synthetic") == NUM_BLOCKS
    assert metric(metrics, "pagedgen:num_requests_running", model_name="synthetic") == 0
    ok = _client(server).completions.create(model="synthetic", prompt=[4, 5], max_tokens=3, temperature=0)
    assert ok.choices[0].text == SyntheticTokenizer(VOCAB).decode(synthetic_greedy([4, 5], 3, VOCAB))


def test_metrics_report_the_window_ring_pool_and_the_fixed_state_slots():
    """A windowed hybrid model's two extra pools are scraped: full while idle, returned after a request."""
    server = serve(SyntheticModel(vocab_size=VOCAB, window=4, hybrid=True), max_batch_size=8)
    try:
        before = settled_metrics(server)
        window_total = metric(before, "pagedgen:window_cache_blocks_total", model_name="synthetic")
        assert window_total > 0
        assert metric(before, "pagedgen:window_cache_blocks_free", model_name="synthetic") == window_total
        assert metric(before, "pagedgen:fixed_state_slots_total", model_name="synthetic") == 8
        assert metric(before, "pagedgen:fixed_state_slots_free", model_name="synthetic") == 8
        prompt = [5, 6, 7, 8, 9, 10, 11]
        out = _client(server).completions.create(model="synthetic", prompt=prompt, max_tokens=12)
        assert out.usage.completion_tokens == 12
        after = settled_metrics(server)
        assert metric(after, "pagedgen:window_cache_blocks_free", model_name="synthetic") == window_total
        assert metric(after, "pagedgen:fixed_state_slots_free", model_name="synthetic") == 8
    finally:
        server.stop()


def test_metrics_report_empty_extra_pools_for_a_full_attention_model(synthetic_server):
    text = settled_metrics(synthetic_server)
    for name in ("window_cache_blocks_total", "window_cache_blocks_free", "fixed_state_slots_total"):
        assert metric(text, f"pagedgen:{name}", model_name="synthetic") == 0


def test_ngram_speculation_keeps_the_exact_tokens_and_reports_its_drafts():
    """``--speculative ngram``: the worker proposes prompt-lookup drafts; output is unchanged, /metrics counts
    the drafts. The prompt repeats the bigram (9, first generated token) so that a proposal exists."""
    prompt = next(p for q in range(VOCAB) if synthetic_greedy(p := [3, 9, 4, 8, q, 9], 1, VOCAB) == [4])
    server = serve(SyntheticModel(vocab_size=VOCAB), speculative="ngram", num_speculative_tokens=3)
    try:
        out = _client(server).completions.create(
            model="synthetic", prompt=prompt, max_tokens=12, temperature=0
        )
        assert out.choices[0].text == SyntheticTokenizer(VOCAB).decode(synthetic_greedy(prompt, 12, VOCAB))
        text = settled_metrics(server)
        proposed = metric(text, "pagedgen:spec_decode_num_draft_tokens_total", model_name="synthetic")
        accepted = metric(text, "pagedgen:spec_decode_num_accepted_tokens_total", model_name="synthetic")
        rate = metric(text, "pagedgen:spec_decode_draft_acceptance_rate", model_name="synthetic")
        assert proposed > 0 and 0 <= accepted <= proposed and rate == pytest.approx(accepted / proposed)
    finally:
        server.stop()


def test_bad_speculative_settings_are_refused():
    with pytest.raises(ValueError, match="speculative"):
        serve(SyntheticModel(vocab_size=VOCAB), speculative="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        serve(SyntheticModel(vocab_size=VOCAB), speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(RuntimeError, match="did not start"):  # above max_draft_tokens: the engine refuses
        serve(SyntheticModel(vocab_size=VOCAB), speculative="ngram", num_speculative_tokens=99)
