"""The one table of sampling ranges: every problem reported at once, each naming its SamplingParams field."""

from __future__ import annotations

import math

import pytest

from omnivox.engine import InvalidRequest, SamplingParams


def fields(params: SamplingParams, vocab: int = 100) -> list[str]:
    return [v.field for v in params.violations(vocab)]


def test_defaults_are_valid():
    assert SamplingParams().violations(100) == []


def test_every_problem_at_once_in_table_order():
    bad = SamplingParams(
        temperature=-1,
        top_k=-2,
        top_p=0.0,
        min_p=1.5,
        repetition_penalty=0.0,
        presence_penalty=2.5,
        frequency_penalty=math.nan,
        logit_bias={100: 1.0},
        seed=1.5,
        max_tokens=0,
        min_tokens=-1,
        stop=["ok", ""],
        stop_token_ids=[3, 100],
        logprobs=21,
    )
    assert fields(bad) == [
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "seed",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "logprobs",
    ]
    with pytest.raises(InvalidRequest) as err:
        bad.validate(100)
    assert err.value.field == "temperature"


@pytest.mark.parametrize(
    ("field", "value", "ok"),
    [
        ("temperature", 0.0, True),
        ("temperature", math.inf, False),
        ("top_k", True, False),  # a bool is not a count
        ("top_p", 1.0, True),
        ("min_p", 0.0, True),
        ("repetition_penalty", math.inf, False),
        ("presence_penalty", -2.0, True),
        ("logit_bias", {5: -math.inf}, True),  # a ban
        ("logit_bias", {5: math.inf}, False),  # the engine and the services used to disagree here
        ("logit_bias", {5: math.nan}, False),
        ("logit_bias", {-1: 1.0}, False),
        ("stop", "halt", True),
        ("logprobs", 20, True),
        ("logprobs", 0, True),
    ],
)
def test_boundaries(field, value, ok):
    assert (fields(SamplingParams(**{field: value})) == []) is ok


def test_min_tokens_above_max_tokens():
    assert fields(SamplingParams(max_tokens=3, min_tokens=4)) == ["min_tokens"]
    assert fields(SamplingParams(max_tokens=0, min_tokens=4)) == ["max_tokens"]  # one problem, reported once


def test_validate_normalises_a_single_stop_string():
    p = SamplingParams(stop="halt")
    p.validate(100)
    assert p.stop == ["halt"]
