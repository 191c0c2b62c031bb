"""n > 1 over HTTP and ZeroMQ: n choices whose prompt was computed once (the engine's prefill counter), each with
its own seed (distinct samples, reproducible, choice 0 = the n = 1 completion); streaming with n > 1 is refused."""

from __future__ import annotations


import pytest

from minedraft.config import EngineConfig
from minedraft.serving.zmq import protocol as P

try:
    import httpx2 as httpx
except ImportError:
    import httpx
from http_harness import ServerThread

PROMPT = ("The while statement is used for repeated execution as long as an expression is true. It repeatedly "
          "tests the expression and, if it is true, executes the first suite")


@pytest.fixture(scope="module")
def srv():
    s = ServerThread(EngineConfig(max_batch_size=8)).start()
    yield s
    s.stop()


def _post(srv, body):
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_n4_returns_four_choices_with_the_prompt_computed_once(srv):
    P_len = len(srv.engine.tokenizer.encode(PROMPT))
    bs = srv.engine.config.block_size
    assert P_len > 2 * bs
    body = {"prompt": PROMPT, "n": 4, "max_tokens": 12, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    before = srv.sync(srv.engine.stats)
    r = _post(srv, body)
    after = srv.sync(srv.engine.stats)
    texts = [c["text"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert len(set(texts)) == 4, texts                        # four distinct samples
    shared = (P_len - 1) // bs * bs                           # the siblings' own part is the last partial block
    assert after["prefill_tokens"] - before["prefill_tokens"] == P_len + 3 * (P_len - shared)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 3 * shared
    assert r["usage"]["prompt_tokens"] == P_len and r["usage"]["completion_tokens"] == 4 * 12
    again = _post(srv, body)                                  # reproducible (now all from the cache)
    assert [c["text"] for c in again["choices"]] == texts
    one = _post(srv, {**body, "n": 1})
    assert one["choices"][0]["text"] == texts[0]              # choice 0 is the n = 1 completion
    assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == shared


def test_prefix_cache_metrics_match_the_stats(srv):
    from prometheus_client.parser import text_string_to_metric_families
    for _ in range(2):  # the second finds the first's prompt cached
        _post(srv, {"prompt": PROMPT, "max_tokens": 2})
    st = srv.sync(srv.engine.stats)
    fams = {f.name: f.samples[0].value for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
            if f.samples}  # labelled families with no child yet (e.g. by draft source) have no sample
    assert fams["minedraft_prefix_cache_hits"] == st["prefix_cache_hits"] > 0
    assert fams["minedraft_prefix_cache_queries"] == st["prefix_cache_queries"]
    assert fams["minedraft_prefill_tokens"] == st["prefill_tokens"]
    assert fams["minedraft_prefix_cache_blocks"] == st["prefix_cache_blocks"] > 0
    assert 0 < fams["minedraft_prefix_cache_hit_rate"] == pytest.approx(st["prefix_cache_hit_rate"])
    assert "minedraft_prefix_cache_evictions" in fams


def test_n_with_stream_is_refused(srv):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "n": 2, "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_zmq_result_carries_choices_and_stays_the_same_without_n(srv):
    res = srv.call(srv.engine.generate_choices(PROMPT, {"n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 3}))
    msg = P.result_reply("7", res)
    assert [c["index"] for c in msg["choices"]] == [0, 1, 2]
    assert msg["token_ids"] == res[0].token_ids
    single = P.result_reply("8", res[0])
    assert "choices" not in single and set(single) == {"v", "t", "id", "text", "token_ids", "finish_reason", "stats"}
