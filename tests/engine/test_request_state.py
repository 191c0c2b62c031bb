"""Request validation at admission (make_request): prompts, params, limits, seeds."""

from __future__ import annotations


import pytest

from minedraft.config import EngineConfig
from minedraft.errors import InvalidRequestError
from minedraft.engine.request_state import make_request
from minedraft.sampling_params import SamplingParams

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


