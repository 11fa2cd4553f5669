"""SamplingOptions: validation names the field and the value; greedy detection."""

from __future__ import annotations

import dataclasses

import pytest

from pagedgen.errors import PagedGenError, SamplingOptionsError
from pagedgen.sampling import SamplingOptions
from pagedgen.sampling.options import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, SAMPLING_EPS


def test_defaults_are_greedy_and_valid() -> None:
    options = SamplingOptions()
    assert options.is_greedy
    assert not options.uses_history and not options.uses_generated


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"do_sample": True}, False),
        ({"do_sample": True, "temperature": 0.0}, True),
        ({"do_sample": True, "top_k": 1}, True),
        ({"do_sample": True, "top_k": 2, "temperature": 0.5}, False),
        ({"do_sample": False, "temperature": 0.5, "top_p": 0.5}, True),
        # Below SAMPLING_EPS a temperature is greedy (vLLM's rule): dividing by it overflows float32.
        ({"do_sample": True, "temperature": 1e-300}, True),
        ({"do_sample": True, "temperature": 5e-324}, True),
        ({"do_sample": True, "temperature": SAMPLING_EPS / 2}, True),
        ({"do_sample": True, "temperature": SAMPLING_EPS}, False),
    ],
)
def test_is_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingOptions(**kwargs).is_greedy is greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("do_sample", 1),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_k", -1),
        ("top_k", 2.0),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("seed", 1.0),
        ("seed", 1 << 64),
        ("seed", -(1 << 63) - 1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e-308),
        ("repetition_penalty", MIN_REPETITION_PENALTY / 2),
        ("repetition_penalty", MAX_REPETITION_PENALTY * 1.01),
        ("no_repeat_ngram_size", -1),
        ("min_length", -1),
        ("min_new_tokens", 0.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("logit_bias", [(1, 2.0)]),
        ("logit_bias", ((1, 2.0, 3.0),)),
        ("logit_bias", ((-1, 2.0),)),
        ("logit_bias", ((1, 101.0),)),
        ("logit_bias", ((1, 1.0), (1, 2.0))),
        ("ignore_eos", "yes"),
    ],
)
def test_bad_field_names_field_and_value(field: str, value: object) -> None:
    with pytest.raises(SamplingOptionsError) as info:
        SamplingOptions(**{field: value})
    assert f"SamplingOptions.{field}" in str(info.value)
    assert repr(value) in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, PagedGenError)


def test_accepts_boundaries_and_is_frozen() -> None:
    options = SamplingOptions(
        do_sample=True,
        temperature=0,
        top_k=0,
        top_p=1.0,
        min_p=1.0,
        seed=(1 << 64) - 1,
        repetition_penalty=0.5,
        presence_penalty=-2,
        frequency_penalty=2.0,
        logit_bias=((0, -100.0), (7, 100)),
    )
    assert options.uses_history and options.uses_generated
    assert SamplingOptions(seed=-(1 << 63)).seed == -(1 << 63)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.top_k = 3  # type: ignore[misc]


def test_repetition_penalty_bounds_are_inclusive() -> None:
    assert SamplingOptions(repetition_penalty=MIN_REPETITION_PENALTY).uses_history
    assert SamplingOptions(repetition_penalty=MAX_REPETITION_PENALTY).uses_history
