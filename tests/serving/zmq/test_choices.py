"""n > 1 over the ZeroMQ protocol: `result.choices`, sampled once per choice from one cached prompt; a request
without n gets the reply it always did; a stream with n > 1 is refused."""

from __future__ import annotations

import pytest
import pytest_asyncio

from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.engine.engine import Engine
from minedraft.errors import InvalidRequestError
from minedraft.serving.zmq.server import Server

PROMPT = list(range(5, 45))  # 40 tokens: two full blocks of 16 shared by the siblings


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_pair):
    cfg = EngineConfig(target=tiny_pair.target, draft=tiny_pair.draft, k=3, max_prompt_tokens=64,
                       max_tokens_limit=16, kv_cache_tokens=4096, max_batch_size=8)
    async with Engine(cfg) as e, Server(e, "tcp://127.0.0.1:*") as s, Client(s.endpoint, timeout=60) as c:
        c.engine = e
        yield c


@pytest.mark.asyncio(loop_scope="module")
async def test_generate_with_n_returns_choices_from_one_prefill(client):
    params = {"n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    before = client.engine.stats()["prefill_tokens"]
    res = await client.generate_choices(PROMPT, params)
    assert len(res) == 3 and len({tuple(r.token_ids) for r in res}) == 3
    assert client.engine.stats()["prefill_tokens"] - before == 40 + 2 * (40 - 32)
    assert [r.token_ids for r in await client.generate_choices(PROMPT, params)] == [r.token_ids for r in res]
    plain = await client.generate(PROMPT, {**params, "n": 1})   # no choices field: the old reply
    assert plain.token_ids == res[0].token_ids and plain.stats.cached_tokens == 32


@pytest.mark.asyncio(loop_scope="module")
async def test_stream_with_n_is_refused(client):
    with pytest.raises(InvalidRequestError):
        async for _ in client.stream(PROMPT, {"n": 2}):
            pass
