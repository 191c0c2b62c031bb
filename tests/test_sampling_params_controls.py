"""SamplingParams' output-control fields: validation naming the field, the wire form (unchanged for a request
that uses none of them), and grammar problems found in the caller's process."""

from __future__ import annotations

import math

import pytest

from minedraft.errors import InvalidRequestError
from minedraft.sampling_params import SamplingParams

BAD = [
    ("presence_penalty", 2.5), ("presence_penalty", math.nan), ("presence_penalty", "1"), ("presence_penalty", True),
    ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", math.inf),
    ("logit_bias", {"x": 1}), ("logit_bias", {5: 200}), ("logit_bias", {5: "1"}), ("logit_bias", {-1: 1}),
    ("logit_bias", 7), ("logprobs", -1), ("logprobs", 21), ("logprobs", True), ("logprobs", 1.0),
    ("speculate", 0), ("draft_budget", -1), ("draft_budget", 1.5), ("draft_budget", True),
    ("json_schema", {"type": "foo"}), ("json_schema", "{not json"), ("json_schema", "[1]"),
    ("regex", "a("), ("regex", 5), ("grammar", "start: foo"),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_controls_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field
    with pytest.raises(InvalidRequestError):
        SamplingParams.from_dict({field: value})


def test_one_grammar_at_most_and_no_ignore_eos_with_one():
    with pytest.raises(InvalidRequestError, match="at most one"):
        SamplingParams(regex="a", grammar='start: "a"')
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(regex="a", ignore_eos=True)


def test_schema_problem_is_named():
    with pytest.raises(InvalidRequestError, match="nope"):
        SamplingParams(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nope"}}})


def test_wire_form_unchanged_without_controls_and_round_trips_with_them():
    plain = SamplingParams(temperature=0.5, max_tokens=9)
    assert set(plain.to_dict()) == {"temperature", "top_k", "top_p", "max_tokens", "stop_token_ids", "stop", "seed",
                                    "ignore_eos"}
    full = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                          logit_bias={"7": 2, 3: -100}, logprobs=2, speculate=False, draft_budget=1,
                          json_schema={"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}})
    d = full.to_dict()
    assert d["logit_bias"] == {"3": -100, "7": 2}
    assert SamplingParams.from_dict(d) == full
    assert full.logit_bias == ((3, -100), (7, 2))
    assert full.json_schema.index('"b"') < full.json_schema.index('"a"')  # property order is kept
    assert full.max_drafts == 0 and SamplingParams(draft_budget=2).max_drafts == 2
    assert full.has_controls and not plain.has_controls and not SamplingParams(logprobs=3).has_controls
    hash(full)
