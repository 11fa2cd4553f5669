"""``n > 1`` through the HTTP server with the ``openai`` client, on the synthetic model.

The synthetic model's greedy continuation is a closed formula, so greedy choices are known exactly; a
sampled choice ``i`` of a request seeded ``s`` must be the one-choice answer seeded ``s + i``. The prompt is
computed once: the prefix-cache counters show every sibling choice starting from choice 0's full blocks.
"""

from __future__ import annotations

import json
import re
import socket

import httpx
import openai
import pytest

from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer
from tests.server.doubles import (
    NUM_BLOCKS,
    POISON,
    VOCAB,
    FailingModel,
    GatedModel,
    app_state,
    client_of,
    expected_text,
    serve,
    settled_metrics,
    wait_until,
)
from tests.server.live import metric

BLOCK = 16  # EngineConfig's default block_size
PROMPT = [(7 * j + 3) % VOCAB for j in range(40)]  # two full blocks and an 8-token tail
CHAT = [{"role": "user", "content": "Hi"}]


class ChatTokenizer(SyntheticTokenizer):
    """The synthetic codec with a trivial chat template (``role: content`` lines)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, **_variables) -> str:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines) + ("\nassistant: " if add_generation_prompt else "")


@pytest.fixture
def server():
    live = serve(SyntheticModel(vocab_size=VOCAB), max_batch_size=4, tokenizer=ChatTokenizer(VOCAB))
    yield live
    live.stop()


@pytest.fixture
def gated():
    model = GatedModel(vocab_size=VOCAB)
    live = serve(model, max_batch_size=3, max_queued_requests=0)
    yield live, model
    model.gate.set()
    live.stop()


def _metric(server, name: str, **labels: str) -> float:
    return metric(settled_metrics(server), f"pagedgen:{name}", model_name="synthetic", **labels)


def test_greedy_choices_are_identical_ordered_and_the_prompt_is_computed_once(server):
    client = client_of(server)
    response = client.completions.create(model="synthetic", prompt=PROMPT, max_tokens=6, temperature=0, n=3)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert [choice.text for choice in response.choices] == [expected_text(PROMPT, 6)] * 3
    assert [choice.finish_reason for choice in response.choices] == ["length"] * 3
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (40, 18, 58)
    assert usage.prompt_tokens_details.cached_tokens == 0  # as choice 0 found the cache: empty
    # Choice 0 computed all 40 prompt tokens; choices 1 and 2 started from its two full blocks and
    # computed only the 8-token tail (the block of the last token is never taken from the cache).
    assert _metric(server, "prefix_cache_queries_total") == 3 * 40
    assert _metric(server, "prefix_cache_hits_total") == 2 * 2 * BLOCK
    assert _metric(server, "prompt_tokens_total") == 3 * 40
    assert _metric(server, "request_success_total", finished_reason="length") == 3
    assert _metric(server, "kv_cache_blocks_free") == NUM_BLOCKS


def test_chat_choices_have_indices_and_one_usage(server):
    client = client_of(server)
    response = client.chat.completions.create(
        model="synthetic", messages=CHAT, max_tokens=5, temperature=0, n=2
    )
    assert [choice.index for choice in response.choices] == [0, 1]
    assert response.choices[0].message.content == response.choices[1].message.content
    assert len(response.choices[0].message.content) == 5  # the synthetic codec: one character a token
    assert response.usage.completion_tokens == 10


def _texts(response) -> list[str]:
    return [choice.text for choice in response.choices]


def test_seeded_choices_are_reproducible_and_each_has_its_own_stream(server):
    client = client_of(server)
    kwargs = {"model": "synthetic", "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 41}
    first = client.completions.create(n=3, **kwargs)
    again = client.completions.create(n=3, **kwargs)
    assert _texts(first) == _texts(again)
    assert len(set(_texts(first))) == 3  # three seeds, three different completions
    for index, text in enumerate(_texts(first)):  # choice i is the one-choice answer seeded 41 + i
        alone = client.completions.create(n=1, **{**kwargs, "seed": 41 + index})
        assert alone.choices[0].text == text


def test_the_largest_seed_wraps_into_the_engines_range(server):
    """Choice 1 of seed 2**64 - 1 is seed 0 (the sampler reduces seeds mod 2**64 anyway)."""
    client = client_of(server)
    kwargs = {"model": "synthetic", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 1.0}
    pair = client.completions.create(n=2, seed=(1 << 64) - 1, **kwargs)
    last = client.completions.create(n=1, seed=(1 << 64) - 1, **kwargs)
    zero = client.completions.create(n=1, seed=0, **kwargs)
    assert _texts(pair) == [last.choices[0].text, zero.choices[0].text]


def test_streamed_choices_carry_their_index_finish_and_summed_usage(server):
    client = client_of(server)
    stream = client.completions.create(
        model="synthetic",
        prompt=PROMPT,
        max_tokens=7,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1 and chunk.usage is None
        choice = chunk.choices[0]
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == {0: expected_text(PROMPT, 7), 1: expected_text(PROMPT, 7)}
    assert finishes == {0: ["length"], 1: ["length"]}
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (40, 14, 54)


def test_streamed_chat_choices_open_with_a_role_each(server):
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={
            "model": "synthetic",
            "messages": CHAT,
            "max_tokens": 4,
            "temperature": 0,
            "n": 2,
            "stream": True,
        },
        timeout=120,
    ) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    assert len({event["id"] for event in events}) == 1
    roles = [e["choices"][0]["index"] for e in events if "role" in e["choices"][0]["delta"]]
    assert roles == [0, 1]
    content = {0: "", 1: ""}
    for event in events:
        choice = event["choices"][0]
        content[choice["index"]] += choice["delta"].get("content") or ""
    assert content[0] == content[1] and len(content[0]) == 4


def test_choices_honour_stop_strings_logprobs_and_constraints(server):
    client = client_of(server)
    full = expected_text(PROMPT, 10)
    stop = full[4:6]
    stopped = client.completions.create(
        model="synthetic", prompt=PROMPT, max_tokens=10, temperature=0, n=2, stop=[stop]
    )
    assert _texts(stopped) == [full[: full.index(stop)]] * 2
    assert [choice.finish_reason for choice in stopped.choices] == ["stop"] * 2
    scored = client.completions.create(
        model="synthetic", prompt=PROMPT, max_tokens=5, temperature=0, n=2, logprobs=2
    )
    for choice in scored.choices:
        assert len(choice.logprobs.tokens) == 5 and all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    regex = r"[0-9]{3}-[a-z]{2,4}"
    constrained = client.completions.create(
        model="synthetic",
        prompt=PROMPT,
        max_tokens=20,
        temperature=1.0,
        seed=5,
        n=3,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert all(re.fullmatch(regex, text) for text in _texts(constrained)), _texts(constrained)
    assert _metric(server, "kv_cache_blocks_free") == NUM_BLOCKS


@pytest.mark.parametrize(("n", "bound"), [(17, "at most 16"), (5, "--max-batch-size 4")])
def test_n_beyond_the_limits_is_400_naming_n(server, n, bound):
    with pytest.raises(openai.BadRequestError) as info:
        client_of(server).completions.create(model="synthetic", prompt=[1, 2], max_tokens=2, n=n)
    assert info.value.body["param"] == "n"
    assert bound in info.value.message
    assert _metric(server, "prompt_tokens_total") == 0  # nothing reached the engine


def test_n_choices_take_n_admission_places(gated):
    server, model = gated
    body = {"model": "synthetic", "prompt": [1, 2, 3], "max_tokens": 50, "n": 2, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as held:
        assert held.status_code == 200
        assert model.entered.wait(timeout=120)
        refused = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=120)
        assert refused.status_code == 429  # one place of three left, two needed
        assert app_state(server).admission.in_flight == 2
        model.gate.set()
        alone = httpx.post(
            server.url + "/v1/completions",
            json={"model": "synthetic", "prompt": [4, 5], "max_tokens": 2, "temperature": 0},
            timeout=120,
        )
        assert alone.status_code == 200
        assert [line for line in held.iter_lines() if line][-1] == "data: [DONE]"
    wait_until(lambda: app_state(server).admission.in_flight == 0, "the stream's ticket released")


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_a_client_that_leaves_cancels_every_choice_and_frees_every_block(gated, stream):
    server, model = gated
    body = json.dumps(
        {"model": "synthetic", "prompt": PROMPT, "max_tokens": 50, "n": 3, "stream": stream}
    ).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall((head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        assert model.entered.wait(timeout=120)
    disconnects = app_state(server).metrics.disconnects
    wait_until(lambda: disconnects._value.get() >= 1, "the server noticed the disconnect")
    model.gate.set()
    metrics = settled_metrics(server)
    assert metric(metrics, "pagedgen:request_cancelled_total", model_name="synthetic") == 3
    assert metric(metrics, "pagedgen:client_disconnects_total", model_name="synthetic") == 1
    assert metric(metrics, "pagedgen:kv_cache_blocks_free", model_name="synthetic") == NUM_BLOCKS
    assert metric(metrics, "pagedgen:num_requests_running", model_name="synthetic") == 0
    assert app_state(server).admission.in_flight == 0


def test_a_failing_choice_fails_the_whole_request():
    live = serve(FailingModel(vocab_size=VOCAB))
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client_of(live).completions.create(model="synthetic", prompt=[1, POISON], max_tokens=3, n=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "unhealthy"
        with httpx.stream(
            "POST",
            live.url + "/v1/completions",
            json={"model": "synthetic", "prompt": [1, 2], "max_tokens": 3, "n": 2, "stream": True},
            timeout=120,
        ) as response:
            assert response.status_code == 503  # refused before the stream began
        assert app_state(live).admission.in_flight == 0
    finally:
        live.stop()


def test_a_stream_whose_choices_fail_ends_with_one_error_event():
    """The engine fails in the step after both turns were accepted: one error event, then [DONE]."""
    live = serve(FailingModel(vocab_size=VOCAB))
    try:
        body = {"model": "synthetic", "prompt": [1, POISON], "max_tokens": 3, "n": 2, "stream": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        assert lines[-1] == "[DONE]"
        assert [json.loads(line)["error"]["code"] for line in lines[:-1]] == ["unhealthy"]
        metrics = settled_metrics(live)
        assert metric(metrics, "pagedgen:client_disconnects_total", model_name="synthetic") == 0
        assert app_state(live).admission.in_flight == 0
    finally:
        live.stop()


def test_a_batch_of_prompts_gets_n_choices_each_in_order_and_echo_reaches_every_choice(server):
    client = client_of(server)
    prompts = [[5, 6, 7], [40, 2, 9, 11]]
    response = client.completions.create(model="synthetic", prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    expected = [expected_text(prompts[0], 4)] * 2 + [expected_text(prompts[1], 4)] * 2
    assert _texts(response) == expected
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (7, 16)
    echoed = client.completions.create(
        model="synthetic", prompt="ab", max_tokens=3, temperature=0, n=2, echo=True
    )
    assert [text[:2] for text in _texts(echoed)] == ["ab", "ab"]
    assert echoed.choices[0].text == echoed.choices[1].text and len(echoed.choices[0].text) == 5
    with pytest.raises(openai.BadRequestError) as info:  # 70 prompts of 4 choices: 280 > 4 + 256 places
        client.completions.create(model="synthetic", prompt=[[1]] * 70, max_tokens=2, n=4)
    assert info.value.body["param"] == "prompt"
    assert (
        info.value.body["message"]
        == "prompt holds 70 prompts of n=4 choices (280 requests); this server admits at most 260"
    )
