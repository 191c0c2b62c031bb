"""Request validation (SamplingParams, make_request) and the incremental detokenizer with stop strings."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minedraft.config import EngineConfig
from minedraft.detokenize import IncrementalDetokenizer
from minedraft.errors import InvalidRequestError
from minedraft.request_state import make_request
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


# -- make_request -----------------------------------------------------------------------------------

VOCAB = 300


@pytest.fixture(scope="module")
def config(tiny_pair):
    return EngineConfig(target=tiny_pair.target, draft=tiny_pair.draft, max_prompt_tokens=16, max_tokens_limit=32,
                        kv_cache_tokens=1024, k=3)


def req(prompt, config, tok, params=None):
    return make_request(0, prompt, params, tok, config, VOCAB)


BAD_PROMPTS = [
    ("", "empty"),
    ([], "no tokens"),
    ("word " * 40, "max_prompt_tokens"),           # 40+ tokens, fewer than 16 * 16 characters
    ("x" * 1000, "limit"),                         # huge string, refused before tokenizing
    (list(range(17)), "max_prompt_tokens"),
    ([1, 2, VOCAB], "token ids"),
    ([1, -1], "token ids"),
    ([1, True], "token ids"),
    ([1, 2.0], "token ids"),
    (["a"], "token ids"),
    (5, "prompt must be"),
    (None, "prompt must be"),
    (b"bytes", "prompt must be"),
]


@pytest.mark.parametrize("prompt,msg", BAD_PROMPTS, ids=[repr(p)[:20] for p, _ in BAD_PROMPTS])
def test_make_request_rejects_bad_prompts(prompt, msg, config, tiny_tokenizer):
    with pytest.raises(InvalidRequestError, match=msg):
        req(prompt, config, tiny_tokenizer)


def test_make_request_rejects_bad_params(config, tiny_tokenizer):
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        req("hi", config, tiny_tokenizer, SamplingParams(max_tokens=33))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        req("hi", config, tiny_tokenizer, {"max_tokens": 33})
    with pytest.raises(InvalidRequestError, match="top_p"):
        req("hi", config, tiny_tokenizer, {"top_p": 0})
    with pytest.raises(InvalidRequestError, match="params must be"):
        req("hi", config, tiny_tokenizer, "greedy")


def test_make_request_accepts_limits(config, tiny_tokenizer):
    r = req(list(range(VOCAB - 16, VOCAB)), config, tiny_tokenizer, SamplingParams(max_tokens=32, seed=7))
    assert r.prompt_ids == list(range(VOCAB - 16, VOCAB)) and r.seed == 7 and r.params.max_tokens == 32
    r = req("The quick brown fox", config, tiny_tokenizer, {"temperature": 0.5, "max_tokens": 32})
    assert r.prompt_ids == tiny_tokenizer.encode("The quick brown fox") and r.params.temperature == 0.5
    seeds = {req("hi", config, tiny_tokenizer, SamplingParams(max_tokens=10)).seed for _ in range(8)}
    assert len(seeds) > 1 and all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)
    r = req("hi", config, tiny_tokenizer, SamplingParams(max_tokens=10))
    assert r.cache_tokens(3) == len(r.prompt_ids) + 10 + 3 + 1


# -- incremental detokenizer ------------------------------------------------------------------------

MULTIBYTE = "naïve café — 東京 ✓ 🎉 done"


def stream(tok, ids, chunks, stop=()):
    """Push ids in chunks of the given sizes (the rest in a final push); return (deltas, detokenizer)."""
    det = IncrementalDetokenizer(tok, tuple(stop))
    deltas, i = [], 0
    for c in chunks:
        deltas.append(det.push(ids[i:i + c]))
        i += c
    deltas.append(det.push(ids[i:], final=True))
    return deltas, det


def test_multibyte_streaming_one_token_at_a_time(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode(MULTIBYTE)
    assert tok.decode(ids) == MULTIBYTE
    # the test means something only if some tokens are partial characters
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 4
    deltas, det = stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) == MULTIBYTE == det.text
    assert not any("\ufffd" in d for d in deltas)
    assert det.ids == ids and not det.stopped


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="ab é東🎉\n", min_size=1, max_size=20), data=st.data())
def test_streaming_any_chunking_equals_full_decode(tiny_tokenizer, text, data):
    tok = tiny_tokenizer
    ids = tok.encode(text)
    chunks = data.draw(st.lists(st.integers(0, 4), max_size=len(ids)))
    deltas, det = stream(tok, ids, chunks)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_spanning_two_pushes(tiny_tokenizer):
    tok = tiny_tokenizer
    text, stop = "hello world, more text", "o w"
    ids = tok.encode(text)
    # find a split point inside the stop string's span
    cut = text.index(stop)
    bounds = [len(tok.decode(ids[:j])) for j in range(len(ids) + 1)]
    inside = [j for j, b in enumerate(bounds) if cut < b < cut + len(stop)]
    assert inside, "tokenization leaves no boundary inside the stop string"
    for j in inside:
        det = IncrementalDetokenizer(tok, (stop,))
        first = det.push(ids[:j])
        assert not det.stopped
        assert first == text[:cut], "text that might begin the stop string must be held back"
        second = det.push(ids[j:])
        assert det.stopped and second == "" and det.text == text[:cut] == "hell"
        assert det.push([5, 6], final=True) == "" and det.text == "hell"


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
def test_multibyte_stop_string(tiny_tokenizer, chunk):
    tok = tiny_tokenizer
    ids = tok.encode(MULTIBYTE)
    deltas, det = stream(tok, ids, [chunk] * (len(ids) // chunk), stop=["東京"])
    assert det.stopped
    assert "".join(deltas) == det.text == MULTIBYTE[: MULTIBYTE.index("東京")]
    assert not any("\ufffd" in d for d in deltas)


def held_back(text: str, stops) -> int:
    """Reference: length of the longest tail of text that is a proper prefix of some stop string."""
    return max([n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)


def test_partial_stop_held_back_then_released(tiny_tokenizer):
    tok = tiny_tokenizer
    text, stops = "abc abd", ("abx", "d!")
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, stops)
    emitted = ""
    for j in range(1, len(ids) + 1):
        emitted += det.push(ids[j - 1:j])
        prefix = tok.decode(ids[:j])
        assert emitted == prefix[: len(prefix) - held_back(prefix, stops)]
    assert emitted == "abc ab"  # the final "d" could still begin "d!"
    emitted += det.push([], final=True)
    assert emitted == text and not det.stopped


def test_stop_string_at_start_and_earliest_of_several(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode("stop here, or there")
    assert "".join(stream(tok, ids, [1] * len(ids), stop=["stop"])[0]) == ""
    for chunks in ([1] * len(ids), [len(ids)]):
        deltas, det = stream(tok, ids, chunks, stop=["there", "or", "here"])
        assert "".join(deltas) == "stop " and det.stopped


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="abc é東", min_size=2, max_size=16), data=st.data())
def test_single_stop_string_any_chunking(tiny_tokenizer, text, data):
    tok = tiny_tokenizer
    i = data.draw(st.integers(0, len(text) - 1))
    stop = text[i: i + data.draw(st.integers(1, 3))]
    ids = tok.encode(text)
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    deltas, det = stream(tok, ids, chunks, stop=[stop])
    assert det.stopped
    assert "".join(deltas) == det.text == text[: text.index(stop)]


def test_overlapping_stop_strings_do_not_depend_on_chunking(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode("xabcdyz")
    results = {"".join(stream(tok, ids, chunks, stop=["bc", "abcd"])[0])
               for chunks in ([1] * len(ids), [len(ids)], [2, 5])}
    assert results == {"xa"}
