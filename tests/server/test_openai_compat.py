"""What clients coming from vLLM send: lenient unknown fields, vLLM's extras, the probed small routes, CORS.

The protocol layer is tested on its own first (unknown top-level fields ignored and logged once per name,
nested constraint objects strict, the template options' rules). Then a live server on the synthetic model,
driven by the real ``openai`` client: the synthetic greedy continuation is a closed formula, so every text
is checked exactly, and the test tokenizer's template (``role: content|`` lines) makes the prompt of each
template option visible in ``usage.prompt_tokens`` (one token per character). ``/tokenize``,
``/detokenize``, ``/version`` and CORS preflights are plain HTTP (httpx). The default model checks what
only a real tokenizer has: chat template variables that would smuggle a special token.
"""

from __future__ import annotations

import logging
import uuid

import httpx
import openai
import pytest
from pydantic import ValidationError

import pagedgen
from pagedgen import cli
from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer, synthetic_greedy
from pagedgen.server.app import ServerOptions
from pagedgen.server.cors import parse_allowed_origins
from pagedgen.server.protocol import IGNORED_FIELDS, ChatCompletionRequest, CompletionRequest, IgnoredFields
from tests.server.doubles import VOCAB, app_state, client_of, serve
from tests.server.live import API_KEY

CHAT = [{"role": "user", "content": "Hi"}]
ORIGIN = "http://app.example:3000"


class TemplateTokenizer(SyntheticTokenizer):
    """The synthetic codec with a chat template: a ``role: content|`` line per message, ``assistant: ``
    as the generation prompt, and ``/no_think`` first when ``enable_thinking`` is false."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        super().__init__(vocab_size, eos_token_id)
        self.seen_variables: list[dict] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **variables) -> str:
        self.seen_variables.append(variables)
        head = "/no_think\n" if variables.get("enable_thinking") is False else ""
        lines = "".join(f"{m['role']}: {m['content']}|\n" for m in messages)
        return head + lines + ("assistant: " if add_generation_prompt else "")


def greedy_text(prompt_text: str, max_tokens: int) -> str:
    codec = SyntheticTokenizer(VOCAB)
    return codec.decode(synthetic_greedy(codec.encode(prompt_text), max_tokens, VOCAB))


@pytest.fixture(scope="module")
def server():
    tokenizer = TemplateTokenizer(VOCAB)
    live = serve(SyntheticModel(vocab_size=VOCAB), tokenizer=tokenizer)
    live.tokenizer = tokenizer
    yield live
    live.stop()


@pytest.fixture(scope="module")
def api(server):
    """The openai client of the synthetic server."""
    return client_of(server)


def refused(response: httpx.Response, param: str, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert isinstance(error["code"], str)
    return error


# ---------------------------------------------------------------- the protocol layer


def test_unknown_top_level_fields_are_ignored_and_logged_once_per_name(caplog):
    name, other = (f"x_unheard_of_{uuid.uuid4().hex[:8]}_{i}" for i in (1, 2))
    body = {"model": "m", "messages": CHAT, other: True, name: {"any": "thing"}}
    with caplog.at_level(logging.WARNING, logger="pagedgen.server"):
        first = ChatCompletionRequest.model_validate(body)
        ChatCompletionRequest.model_validate(body)
        CompletionRequest.model_validate({"model": "m", "prompt": "p", name: 1})
    assert first.model_extra == {}  # dropped once logged
    warnings = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    listed = ", ".join(repr(n) for n in sorted((name, other)))
    assert warnings == [f"The following fields were present in the request but ignored: {{{listed}}}"]
    assert IGNORED_FIELDS.seen(name)


def test_the_logged_names_are_bounded_and_cut(caplog):
    ignored = IgnoredFields()
    with caplog.at_level(logging.WARNING, logger="pagedgen.server"):
        ignored.note(["a" * 100])
        ignored.note([f"f{i}" for i in range(IgnoredFields.MAX_NAMES + 5)])
        ignored.note(["late"])
    assert ignored.seen("a" * IgnoredFields.MAX_NAME_CHARS)
    assert ignored.seen(f"f{IgnoredFields.MAX_NAMES - 2}") and not ignored.seen(
        f"f{IgnoredFields.MAX_NAMES - 1}"
    )
    assert not ignored.seen("late")  # past the bound: ignored, not remembered, not logged
    assert len(caplog.records) == 2


def test_a_message_and_stream_options_ignore_unknown_keys():
    message = {"role": "assistant", "content": "ok", "refusal": None, "annotations": [], "audio": None}
    body = {"model": "m", "messages": [*CHAT, message], "stream": True}
    body["stream_options"] = {"include_usage": True, "include_obfuscation": False}
    request = ChatCompletionRequest.model_validate(body)
    assert request.messages[1].as_template_message() == {"role": "assistant", "content": "ok"}
    assert request.include_usage
    assert IGNORED_FIELDS.seen("messages[].refusal") and IGNORED_FIELDS.seen(
        "stream_options.include_obfuscation"
    )


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
        ({"structured_outputs": {"regexp": "a+"}}, "structured_outputs"),
        ({"tools": [{"type": "function", "function": {"name": "f", "paramters": {}}}]}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f", "args": 1}}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]}, "messages"),
    ],
)
def test_nested_objects_that_change_the_output_stay_strict(fields, where):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, **fields})
    assert {error["type"] for error in info.value.errors()} >= {"extra_forbidden"}
    assert all(error["loc"][0] == where for error in info.value.errors())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"continue_final_message": True}, "add_generation_prompt must be false"),
        ({"continue_final_message": True, "add_generation_prompt": False}, "must be an assistant's"),
    ],
)
def test_continue_final_message_rules(fields, message):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, **fields})
    (error,) = info.value.errors()
    assert error["ctx"]["param"] == "continue_final_message"
    assert message in error["msg"]


def test_prompt_shapes_are_a_batch():
    def prompts(prompt):
        return CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompts

    assert prompts("a") == ["a"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ([], [[]], [1, "a"], [[1], "a"], [-1]):
        with pytest.raises(ValidationError):
            prompts(bad)


def test_allowed_origins_parse_or_name_the_bad_one():
    assert parse_allowed_origins("http://a.example, https://b.example:8443") == (
        "http://a.example",
        "https://b.example:8443",
    )
    assert parse_allowed_origins("*") == ("*",)
    for bad in ("a.example", "http://a.example/", "ftp://a.example", ""):
        with pytest.raises(ValueError, match="is not '\\*' or scheme://host"):
            parse_allowed_origins(bad)
    with pytest.raises(ValueError, match="allowed origin 'null'"):
        ServerOptions(allowed_origins=("null",))


# ---------------------------------------------------------------- the chat route, with the openai client


def test_fields_clients_send_by_default_are_accepted_and_change_nothing(server, api):
    plain = api.chat.completions.create(model="synthetic", messages=CHAT, max_tokens=5, temperature=0)
    extra = api.chat.completions.create(
        model="synthetic",
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        store=False,
        metadata={"session": "s1"},
        service_tier="auto",
        reasoning_effort="low",
        modalities=["text"],
        parallel_tool_calls=True,
        user="someone",
        extra_body={"x_vendor_knob": 3, "top_a": 0.2},
    )
    expected = greedy_text("user: Hi|\nassistant: ", 5)
    assert plain.choices[0].message.content == extra.choices[0].message.content == expected
    assert extra.usage.prompt_tokens == len("user: Hi|\nassistant: ")


def test_bad_values_of_known_fields_stay_400s_naming_them(server):
    url = server.url + "/v1/chat/completions"
    cases = [
        ({"temperature": "hot"}, "temperature"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"add_generation_prompt": 1}, "add_generation_prompt"),
        (
            {"chat_template_kwargs": {"enable_thinking": {"deep": True}}},
            "chat_template_kwargs.enable_thinking",
        ),
        ({"chat_template_kwargs": {"messages": "x"}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"n": 17}, "n"),  # above MAX_CHOICES
        ({"continue_final_message": True}, "continue_final_message"),
    ]
    for fields, param in cases:
        error = refused(httpx.post(url, json={"model": "synthetic", "messages": CHAT, **fields}), param)
        assert error["code"] == "invalid_request"


def test_chat_template_kwargs_reach_the_template(server, api):
    response = api.chat.completions.create(
        model="synthetic",
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False, "depth": 2}},
    )
    prompt = "/no_think\nuser: Hi|\nassistant: "
    assert server.tokenizer.seen_variables[-1] == {"enable_thinking": False, "depth": 2}
    assert response.usage.prompt_tokens == len(prompt)
    assert response.choices[0].message.content == greedy_text(prompt, 4)


def test_add_generation_prompt_false_leaves_the_turn_unopened(api):
    response = api.chat.completions.create(
        model="synthetic",
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        extra_body={"add_generation_prompt": False},
    )
    assert response.usage.prompt_tokens == len("user: Hi|\n")
    assert response.choices[0].message.content == greedy_text("user: Hi|\n", 4)


def test_continue_final_message_continues_the_assistant_text(api):
    messages = [*CHAT, {"role": "assistant", "content": "Once upon"}]
    body = {"continue_final_message": True, "add_generation_prompt": False}
    response = api.chat.completions.create(
        model="synthetic", messages=messages, max_tokens=6, temperature=0, extra_body=body
    )
    prompt = "user: Hi|\nassistant: Once upon"  # the template's "|\n" after it is cut
    assert response.usage.prompt_tokens == len(prompt)
    assert response.choices[0].message.content == greedy_text(prompt, 6)
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model="synthetic", messages=messages, max_tokens=6, extra_body={"continue_final_message": True}
        )
    assert info.value.body["param"] == "continue_final_message"


def test_max_completion_tokens_is_max_tokens(api):
    response = api.chat.completions.create(
        model="synthetic", messages=CHAT, max_completion_tokens=3, temperature=0
    )
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"


def test_skip_special_tokens_false_keeps_the_eos_in_the_text():
    eos = 7
    codec = SyntheticTokenizer(VOCAB, eos_token_id=eos)
    prompt = next(
        [a, b, c]
        for a in range(1, VOCAB)
        for b, c in ((3, 5), (11, 2))
        if eos in synthetic_greedy([a, b, c], 8, VOCAB)[1:]
    )
    ids = synthetic_greedy(prompt, 8, VOCAB)
    live = serve(SyntheticModel(vocab_size=VOCAB, eos_token_id=eos), tokenizer=codec)
    try:
        client = client_of(live)
        texts = {}
        for skip in (True, False):
            texts[skip] = (
                client.completions.create(
                    model="synthetic",
                    prompt=prompt,
                    max_tokens=8,
                    temperature=0,
                    extra_body={"ignore_eos": True, "skip_special_tokens": skip},
                )
                .choices[0]
                .text
            )
    finally:
        live.stop()
    assert texts[False] == codec.decode(ids, skip_special_tokens=False)
    assert texts[True] == codec.decode(ids)
    assert len(texts[False]) > len(texts[True])


# ---------------------------------------------------------------- the completions route


def test_a_batch_of_prompts_answers_one_choice_per_prompt_in_order(api):
    prompts = ["ab", "cde", "f"]
    response = api.completions.create(model="synthetic", prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [greedy_text(p, 4) for p in prompts]
    assert response.usage.prompt_tokens == 6
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == 18


def test_a_batch_of_token_id_prompts(api):
    prompts = [[5, 6, 7], [40, 2]]
    response = api.completions.create(model="synthetic", prompt=prompts, max_tokens=3, temperature=0)
    codec = SyntheticTokenizer(VOCAB)
    assert [c.text for c in response.choices] == [
        codec.decode(synthetic_greedy(p, 3, VOCAB)) for p in prompts
    ]
    assert response.usage.prompt_tokens == 5


def test_a_batch_refusal_names_the_prompt_and_streaming_a_batch_is_refused(server):
    url = server.url + "/v1/completions"
    body = {"model": "synthetic", "prompt": [[1, 2], [3, VOCAB]], "max_tokens": 2}
    error = refused(httpx.post(url, json=body), "prompt[1]")
    assert error["message"] == f"prompt token id {VOCAB} is outside the vocabulary (size {VOCAB})"
    refused(httpx.post(url, json={**body, "prompt": ["a", "b"], "stream": True}), "stream")
    too_many = app_state(server).admission.capacity + 1
    error = refused(httpx.post(url, json={**body, "prompt": ["a"] * too_many}), "prompt")
    assert error["message"] == f"prompt holds {too_many} prompts; this server admits at most {too_many - 1}"


def test_echo_puts_the_prompt_before_the_text(api):
    response = api.completions.create(model="synthetic", prompt="abc", max_tokens=4, temperature=0, echo=True)
    assert response.choices[0].text == "abc" + greedy_text("abc", 4)
    ids = [40, 41, 42]
    response = api.completions.create(model="synthetic", prompt=ids, max_tokens=2, temperature=0, echo=True)
    codec = SyntheticTokenizer(VOCAB)
    assert response.choices[0].text == codec.decode(ids) + codec.decode(synthetic_greedy(ids, 2, VOCAB))
    stream = api.completions.create(
        model="synthetic", prompt="abc", max_tokens=4, temperature=0, echo=True, stream=True
    )
    texts = [chunk.choices[0].text for chunk in stream]
    assert texts[0] == "abc"
    assert "".join(texts) == "abc" + greedy_text("abc", 4)
    batch = api.completions.create(
        model="synthetic", prompt=["x", "yz"], max_tokens=2, temperature=0, echo=True
    )
    assert [c.text for c in batch.choices] == ["x" + greedy_text("x", 2), "yz" + greedy_text("yz", 2)]


def test_echo_with_logprobs_is_a_clear_400(api):
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="synthetic", prompt="abc", max_tokens=2, echo=True, logprobs=1)
    assert info.value.body["param"] == "echo"
    assert "prompt's logprobs" in info.value.body["message"]


# ---------------------------------------------------------------- the small routes


def test_models_retrieve(api):
    card = api.models.retrieve("synthetic")
    assert (card.id, card.object, card.owned_by) == ("synthetic", "model", "pagedgen")
    assert card.model_extra["max_model_len"] == api.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.NotFoundError) as info:
        api.models.retrieve("gpt-4o")
    assert info.value.body == {
        "message": "The model `gpt-4o` does not exist.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_version(server):
    assert httpx.get(server.url + "/version").json() == {"version": pagedgen.__version__}


def test_tokenize_counts_what_the_routes_prefill(server, api):
    answer = httpx.post(server.url + "/tokenize", json={"model": "synthetic", "messages": CHAT}).json()
    chat = api.chat.completions.create(model="synthetic", messages=CHAT, max_tokens=1)
    assert answer == {
        "count": chat.usage.prompt_tokens,
        "max_model_len": api.models.retrieve("synthetic").model_extra["max_model_len"],
        "tokens": SyntheticTokenizer(VOCAB).encode("user: Hi|\nassistant: "),
    }
    body = {"messages": [*CHAT, {"role": "assistant", "content": "Yo"}], "continue_final_message": True}
    body["add_generation_prompt"] = False
    answer = httpx.post(server.url + "/tokenize", json=body).json()
    assert answer["count"] == len("user: Hi|\nassistant: Yo")
    answer = httpx.post(server.url + "/tokenize", json={"prompt": "hello", "return_token_strs": True}).json()
    assert answer["tokens"] == SyntheticTokenizer(VOCAB).encode("hello")
    assert answer["token_strs"] == list("hello")


def test_tokenize_and_detokenize_refusals(server):
    url = server.url
    refused(httpx.post(url + "/tokenize", json={"prompt": "a", "messages": CHAT}), "prompt")
    refused(httpx.post(url + "/tokenize", json={}), "prompt")
    refused(
        httpx.post(url + "/tokenize", json={"messages": CHAT, "add_special_tokens": True}),
        "add_special_tokens",
    )
    refused(httpx.post(url + "/tokenize", json={"prompt": "a", "model": "other"}), "model", 404)
    assert httpx.post(url + "/detokenize", json={"tokens": [40, 41]}).json() == {"prompt": "HI"}
    assert httpx.post(url + "/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    error = refused(httpx.post(url + "/detokenize", json={"tokens": [1, VOCAB]}), "tokens")
    assert error["message"] == f"token id {VOCAB} is outside the vocabulary (size {VOCAB})"
    refused(httpx.post(url + "/detokenize", json={"tokens": [-1]}), "tokens[0]")
    refused(httpx.post(url + "/detokenize", json={"tokens": "40"}), "tokens")


def test_the_small_routes_are_behind_the_api_key():
    live = serve(SyntheticModel(vocab_size=VOCAB), tokenizer=TemplateTokenizer(VOCAB), api_key=API_KEY)
    try:
        for method, path, body in [
            ("GET", "/version", None),
            ("GET", "/v1/models/synthetic", None),
            ("POST", "/tokenize", {"prompt": "a"}),
            ("POST", "/detokenize", {"tokens": [1]}),
        ]:
            bare = httpx.request(method, live.url + path, json=body)
            assert bare.status_code == 401, path
            keyed = httpx.request(
                method, live.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}
            )
            assert keyed.status_code == 200, (path, keyed.text)
    finally:
        live.stop()


# ---------------------------------------------------------------- CORS


def preflight(server, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    return httpx.options(server.url + "/v1/chat/completions", headers=headers)


def test_without_allowed_origins_there_is_no_cors(server):
    answer = preflight(server, ORIGIN)
    assert answer.status_code == 405
    assert "access-control-allow-origin" not in answer.headers
    plain = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_a_listed_origin_is_answered_before_the_key_check_and_others_are_not():
    options = {"api_key": API_KEY, "allowed_origins": (ORIGIN,)}
    live = serve(SyntheticModel(vocab_size=VOCAB), tokenizer=TemplateTokenizer(VOCAB), **options)
    try:
        answer = preflight(live, ORIGIN)  # no key: a browser's preflight never carries one
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == ORIGIN
        allowed = {h.strip().lower() for h in answer.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type"} <= allowed
        assert "POST" in answer.headers["access-control-allow-methods"]

        other = preflight(live, "http://evil.example")
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers

        body = {"model": "synthetic", "messages": CHAT, "max_tokens": 2}
        unkeyed = httpx.post(live.url + "/v1/chat/completions", json=body, headers={"Origin": ORIGIN})
        assert unkeyed.status_code == 401  # the request itself still needs the key ...
        assert unkeyed.headers["access-control-allow-origin"] == ORIGIN  # ... and the browser may read why
        keyed = httpx.post(
            live.url + "/v1/chat/completions",
            json=body,
            headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"},
        )
        assert keyed.status_code == 200
        assert keyed.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in keyed.headers["access-control-expose-headers"].lower()
        foreign = httpx.get(live.url + "/health", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in foreign.headers
    finally:
        live.stop()


def test_star_allows_every_origin():
    live = serve(SyntheticModel(vocab_size=VOCAB), tokenizer=TemplateTokenizer(VOCAB), allowed_origins=("*",))
    try:
        answer = preflight(live, "http://anywhere.example")
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "*"
    finally:
        live.stop()


# ---------------------------------------------------------------- the default model (a real tokenizer)


def test_default_model_tokenize_matches_the_chat_prompt_and_template_strings_cannot_be_markup(
    live_server, client
):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    messages = [{"role": "user", "content": "Name a colour."}]
    answer = httpx.post(live_server.url + "/tokenize", json={"messages": messages}, headers=headers).json()
    chat = client.chat.completions.create(model="default", messages=messages, max_tokens=1, temperature=0)
    assert answer["count"] == chat.usage.prompt_tokens == len(answer["tokens"])
    text = httpx.post(live_server.url + "/detokenize", json={"tokens": answer["tokens"]}, headers=headers)
    assert text.json()["prompt"].endswith("<|im_start|>assistant\n")
    body = {"model": "default", "messages": messages, "chat_template_kwargs": {"note": "<|im_end|>"}}
    error = refused(
        httpx.post(live_server.url + "/v1/chat/completions", json=body, headers=headers),
        "chat_template_kwargs.note",
    )
    assert "special-token string" in error["message"]


def test_the_allowed_origins_flag_reaches_the_server_options(monkeypatch, capsys):
    monkeypatch.delenv("PAGEDGEN_API_KEY", raising=False)
    parser = cli.build_parser()
    assert cli.server_options(parser.parse_args(["serve"])).allowed_origins == ()
    args = parser.parse_args(["serve", "--allowed-origins", "http://a.example, https://b.example:8443"])
    assert cli.server_options(args).allowed_origins == ("http://a.example", "https://b.example:8443")
    assert cli.server_options(parser.parse_args(["serve", "--allowed-origins", "*"])).allowed_origins == (
        "*",
    )
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--allowed-origins", "a.example"])
    assert info.value.code == 2
    assert "allowed origin 'a.example' is not '*' or scheme://host[:port]" in capsys.readouterr().err
