"""The wire layer's own rules: lone surrogates are found with their path; logit_bias keys are token ids."""

from __future__ import annotations

import pytest

from pagedgen.errors import SamplingOptionsError
from pagedgen.server.guard import error_body
from pagedgen.server.protocol import CompletionRequest, surrogate_path

LONE = "\ud800"


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"messages": [{"role": "user", "content": f"a{LONE}"}]}, "messages[0].content"),
        ({"messages": [{"content": [{"text": "ok"}, {"text": LONE}]}]}, "messages[0].content[1].text"),
        ({"stop": ["a", "b", LONE]}, "stop[2]"),
        ({"logit_bias": {LONE: 1}}, "logit_bias"),
        ({"structured_outputs": {"json": {"properties": {"x": {"enum": [LONE]}}}}},
         "structured_outputs.json.properties.x.enum[0]"),
        ({"prompt": "Grüße 😀", "model": "m"}, None),
        (LONE, "body"),
    ],
)  # fmt: skip
def test_surrogate_path_names_the_first_bad_string(value, path):
    assert surrogate_path(value) == path


def _request(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


@pytest.mark.parametrize(
    ("bias", "match"),
    [
        ({"1" * 5000: 1.0}, "at most 9 digits"),
        ({"1": 1.0, "01": 2.0}, "'1' and '01' name the same token id 1"),
        ({"-1": 1.0}, "token ids"),
    ],
)
def test_logit_bias_keys_must_be_distinct_short_token_ids(bias, match):
    with pytest.raises(SamplingOptionsError, match=match) as info:
        _request(logit_bias=bias).to_sampling_params(4)
    assert info.value.field == "logit_bias"


def test_logit_bias_keys_become_ints():
    assert _request(logit_bias={"7": 1.5, "123456789": -2.0}).to_sampling_params(4).logit_bias == {
        7: 1.5,
        123456789: -2.0,
    }


@pytest.mark.parametrize(
    ("status", "code"), [(400, "invalid_request"), (404, "not_found"), (500, "internal_error")]
)
def test_the_error_envelope_code_is_always_a_string(status, code):
    assert error_body(status, "m")["error"]["code"] == code
    assert error_body(status, "m", code="queue_full")["error"]["code"] == "queue_full"
