"""Every bad input gets its OpenAI-style error status and changes nothing; the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.doubles import settled_metrics
from tests.server.live import API_KEY, MAX_BODY_BYTES, MODEL_NAME, metric

pytestmark = pytest.mark.model

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "Hi"}]


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert body["error"]["message"]
    assert body["error"]["type"]
    return body["error"]


def _post(server, path: str, **kwargs) -> httpx.Response:
    headers = {**AUTH, **kwargs.pop("headers", {})}
    return httpx.post(server.url + path, headers=headers, timeout=900, **kwargs)


@pytest.mark.parametrize(
    "content",
    [b'{"model": "default", "prompt": "x"', b"not json at all", b"[1, 2]", b""],
    ids=["truncated", "garbage", "array", "empty"],
)
def test_malformed_json_is_400(live_server, content):
    response = _post(
        live_server, "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    _error(response, 400)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": "8"}, "max_tokens"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": 5}, "prompt"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": []}, "prompt"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": [-1]}, "prompt"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": ["a", 1]}, "prompt"),  # a batch is one kind
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "echo": "yes"}, "echo"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": "hi"}, "messages"),
        (
            "/v1/chat/completions",
            {"model": MODEL_NAME, "messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
        ),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT}, "model"),
    ],
)
def test_wrong_types_are_400(live_server, path, body, param):
    assert _error(_post(live_server, path, json=body), 400)["param"] == param


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 17},  # above MAX_CHOICES
        {"chat_template_kwargs": {"enable_thinking": [True]}},
        {"continue_final_message": True},  # with the default add_generation_prompt=true
        {"temperature": 5.0},
        {"top_p": 0.0},
        {"top_logprobs": 3},  # without logprobs=true
        {"stream_options": {"include_usage": True}},  # without stream=true
        {"logit_bias": {"not-a-token": 1.0}},
    ],
    ids=lambda e: next(iter(e)),
)
def test_invalid_parameters_are_400_with_the_openai_client(client, extra):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, extra_body=extra)
    assert info.value.status_code == 400


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    assert "gpt-4" in info.value.message


def test_prompt_longer_than_the_context_is_400_with_the_numbers(live_server, client, default_model):
    context = default_model.max_context
    ids = [42] * (context - 4)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=16)
    message = info.value.message
    assert str(context) in message and str(context - 4 + 16) in message and str(context - 4) in message
    long_text = "hello " * (context + 10)
    response = _post(
        live_server,
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": long_text}]},
    )
    assert _error(response, 400)["code"] == "context_length_exceeded"


def test_empty_prompt_is_400(client):
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.completions.create(model=MODEL_NAME, prompt="", max_tokens=4)


def test_out_of_vocabulary_token_id_is_400(client, default_model):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=[1, default_model.vocab_size], max_tokens=4)


def test_wrong_or_missing_api_key_is_401(live_server):
    wrong = openai.OpenAI(base_url=live_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4)
    response = httpx.post(live_server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
    assert _error(response, 401)["code"] == "invalid_api_key"


def test_body_over_the_limit_is_413(live_server):
    body = b'{"model": "default", "prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    response = _post(
        live_server, "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    _error(response, 413)

    def chunks():  # no content-length: the limit holds for chunked uploads too
        yield b'{"model": "default", "prompt": "'
        for _ in range(8):
            yield b"a" * (MAX_BODY_BYTES // 4)
        yield b'"}'

    response = _post(
        live_server, "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    _error(response, 413)


def test_unknown_route_is_404_json(live_server):
    _error(httpx.get(live_server.url + "/v1/nothing", headers=AUTH), 404)


def test_server_keeps_serving_and_nothing_leaked(live_server, client):
    """Run after the refusals above (file order): a normal request works and no block is held."""
    response = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert response.usage.completion_tokens == 2
    text = settled_metrics(live_server)
    total = metric(text, "pagedgen:kv_cache_blocks_total", model_name=MODEL_NAME)
    assert metric(text, "pagedgen:kv_cache_blocks_free", model_name=MODEL_NAME) == total
