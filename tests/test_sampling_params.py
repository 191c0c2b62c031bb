"""SamplingParams validation and its wire form."""

from __future__ import annotations

import math

import pytest

from minedraft.errors import InvalidRequestError
from minedraft.sampling_params import SamplingParams

# -- SamplingParams ---------------------------------------------------------------------------------

BAD_PARAMS = [
    ("temperature", -0.1), ("temperature", -1e-9), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "0.5"), ("temperature", True), ("temperature", None),
    ("top_p", 0), ("top_p", 0.0), ("top_p", 1.0000001), ("top_p", 2), ("top_p", -0.5), ("top_p", math.nan),
    ("top_p", True),
    ("top_k", -1), ("top_k", 1.5), ("top_k", True), ("top_k", "3"),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.0), ("max_tokens", True), ("max_tokens", "7"),
    ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("stop_token_ids", [1.0]), ("stop_token_ids", ["3"]),
    ("stop", [""]), ("stop", ""), ("stop", [5]), ("stop", ["ok", None]),
    ("seed", -1), ("seed", 2**63), ("seed", 1.5), ("seed", True), ("seed", "42"),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS, ids=[f"{f}={v!r}" for f, v in BAD_PARAMS])
def test_invalid_sampling_params_raise_value_error_naming_field(field, value):
    with pytest.raises(ValueError, match=field) as exc:
        SamplingParams(**{field: value})
    assert isinstance(exc.value, InvalidRequestError)
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams.from_dict({field: value})


# Wrong container types (what a JSON caller sends as `"stop": null` or `"stop_token_ids": 5`)
BAD_CONTAINERS = [("stop_token_ids", 5), ("stop_token_ids", None), ("stop", None), ("stop", 7)]


@pytest.mark.parametrize("field,value", BAD_CONTAINERS, ids=[f"{f}={v!r}" for f, v in BAD_CONTAINERS])
def test_from_dict_rejects_non_list_containers(field, value):
    with pytest.raises(InvalidRequestError):
        SamplingParams.from_dict({field: value})


@pytest.mark.parametrize("field,value", BAD_CONTAINERS, ids=[f"{f}={v!r}" for f, v in BAD_CONTAINERS])
def test_non_list_containers_name_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams.from_dict({field: value})
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_from_dict_unknown_field_is_named():
    with pytest.raises(InvalidRequestError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5, "max_tokens": 3})


def test_valid_params_and_round_trip():
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=12, stop_token_ids=[3, 4], stop="END",
                       seed=2**63 - 1, ignore_eos=True)
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4)
    assert not p.greedy and SamplingParams().greedy
    hash(p)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict(None) == SamplingParams()
    # edge values that are allowed
    for kw in (dict(temperature=0), dict(temperature=5), dict(top_p=1), dict(top_p=1e-9), dict(top_k=0),
               dict(max_tokens=1), dict(seed=0), dict(stop=["a", "bb"]), dict(stop_token_ids=[0])):
        SamplingParams(**kw)


@pytest.mark.parametrize("stop, match", [(["x"] * 17, "17 stop strings; the limit is 16 .MAX_STOP_STRINGS."),
                                         (["y" * 129], "129 characters; the limit is 128 .MAX_STOP_CHARS.")])
def test_stop_string_limits_named(stop, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        SamplingParams(stop=stop)
    assert e.value.param == "stop"
    SamplingParams(stop=["x" * 128] * 16)  # at the limits
