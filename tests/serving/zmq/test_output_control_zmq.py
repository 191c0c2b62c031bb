"""Output controls over the ZeroMQ protocol, through the Python client: the same tokens and logprobs as the engine
gives in process, structured output, a per-request draft budget in the request's stats, and bad grammars refused
as invalid_request before the engine sees them."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio

from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.engine.engine import Engine
from minedraft.errors import InvalidRequestError
from minedraft.sampling_params import SamplingParams
from minedraft.serving.zmq.server import Server

amod = pytest.mark.asyncio(loop_scope="module")
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "n": {"type": "integer", "maximum": 99}},
          "required": ["k", "n"], "additionalProperties": False}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_pair):
    # fixed k: logprobs are compared bit for bit between two runs, which needs the same verify shapes in both
    cfg = EngineConfig(target=tiny_pair.target, draft=tiny_pair.draft, k=3, max_prompt_tokens=64,
                       max_tokens_limit=64, kv_cache_tokens=8192, max_batch_size=8, adaptive_k=False)
    async with Engine(cfg) as e:
        yield e


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(engine):
    async with Server(engine, "tcp://127.0.0.1:*") as s:
        async with Client(s.endpoint, timeout=30) as c:
            yield c


@amod
async def test_controls_over_zmq_equal_the_engine(engine, client):
    p = SamplingParams(max_tokens=24, frequency_penalty=1.0, logit_bias={3: 2.0}, logprobs=2, draft_budget=1)
    want = await engine.generate("The class statement", p)
    got = await client.generate("The class statement", p)
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert len(got.logprobs) == len(got.token_ids) and all(len(top) == 2 for _, top in got.logprobs)
    assert got.stats.draft_tokens <= got.stats.steps  # budget 1
    deltas = [d async for d in client.stream("The class statement", p.to_dict())]
    assert [x for d in deltas for x in (d.logprobs or [])] == want.logprobs
    off = await client.generate("The class statement", {"max_tokens": 24, "speculate": False})
    assert off.stats.draft_tokens == 0


@amod
async def test_json_schema_over_zmq(client):
    r = await client.generate("Record:", {"max_tokens": 48, "json_schema": SCHEMA})
    if r.finish_reason == "stop":
        obj = json.loads(r.text)
        assert obj["k"] in ("x", "y") and obj["n"] <= 99
    plain = await client.generate("Record:", {"max_tokens": 8})
    assert plain.logprobs is None


@amod
async def test_bad_grammar_is_invalid_request(client):
    with pytest.raises(InvalidRequestError, match="unclosed"):
        await client.generate("x", {"regex": "a("})
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        await client.generate("x", {"logit_bias": {"100000": 1}})
