"""The OpenAI-compatible HTTP server, driven by real clients (the official `openai` package, httpx, curl)
against a real server on 127.0.0.1: outputs identical to Engine.generate / Engine.chat, streaming, stop
strings, seeds, usage, disconnects, error statuses and bodies, API key, loopback-only binding, and /metrics
parsed by prometheus_client. One engine (bundled tiny pair) serves the whole module."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minedraft.config import EngineConfig

try:  # the HTTP client the installed openai package is built on
    import httpx2 as httpx
except ImportError:
    import httpx
from http_harness import ServerThread

PROMPT = "The while statement is used for"
MAX_BODY = 64 * 1024
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def srv():
    # small queue and batch so 429 is reachable; everything else the defaults
    # fixed k: the metrics tests read drafts by position
    s = ServerThread(EngineConfig(max_batch_size=4, max_queue=2, adaptive_k=False), max_body_bytes=MAX_BODY).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _gen(srv, prompt, **params):
    return srv.call(srv.engine.generate(prompt, params))


def test_models_and_health(srv, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny-target"]
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 200 and r.json()["ok"] is True


def test_completion_greedy_identical_to_engine(srv, client, model):
    ref = _gen(srv, PROMPT, max_tokens=24)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(srv.engine.tokenizer.encode(PROMPT)) == ref.stats.prompt_tokens
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_greedy_identical_to_engine_chat_and_template(srv, client, model):
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a list?"}]
    ref = srv.call(srv.engine.chat(msgs, {"max_tokens": 20}))
    # Engine.chat is generate() on the tokenizer's own template with the assistant turn opened
    text = srv.engine.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = srv.engine.tokenizer.encode(text, add_special_tokens=False)
    assert _gen(srv, ids, max_tokens=20).text == ref.text
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)


def test_streaming_chunks_concatenate(srv, client, model):
    ref = _gen(srv, PROMPT, max_tokens=40)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 1  # really streamed, not one blob
    assert "".join(texts) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)

    msgs = [{"role": "user", "content": "Tell me about loops."}]
    cref = srv.call(srv.engine.chat(msgs, {"max_tokens": 30}))
    cchunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=30, temperature=0,
                                                  stream=True))
    assert cchunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in cchunks) == cref.text
    assert cchunks[-1].choices[0].finish_reason == cref.finish_reason


def test_stop_strings(srv, client, model):
    full = _gen(srv, PROMPT, max_tokens=40, ignore_eos=True).text
    stop = full[12:16]
    assert stop.strip() and full.find(stop) >= 1
    want = full[:full.find(stop)]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "@@@"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    parts = [(c.choices[0].text, c.choices[0].finish_reason) for c in streamed]
    assert "".join(t for t, _ in parts) == want and parts[-1][1] == "stop"


def test_seeds_reproducible(srv, client, model):
    def sample(seed):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=32, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    a = sample(7)
    assert sample(7) == a
    assert _gen(srv, PROMPT, max_tokens=32, temperature=1.0, seed=7, ignore_eos=True).text == a
    assert any(sample(s) != a for s in (8, 9))


def test_curl_streaming(srv):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    ref = _gen(srv, PROMPT, max_tokens=24)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": True})
    out = subprocess.run(["curl", "-N", "-s", "--max-time", "60", "-H", "Content-Type: application/json",
                          "-d", body, srv.url + "/v1/completions"], capture_output=True, text=True, check=True).stdout
    assert "\r" not in out and out.endswith("data: [DONE]\n\n")  # OpenAI's framing: LF, blank line per event
    data = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
    assert all(c["object"] == "text_completion" for c in chunks)


def _wait_idle(srv, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = srv.sync(srv.engine.stats)
        if st["running"] == 0 and st["waiting"] == 0:
            return st
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {st}")


def test_disconnect_mid_stream_frees_cache(srv):
    before = _wait_idle(srv)
    body = {"prompt": PROMPT, "max_tokens": 500, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", srv.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(line.startswith("data: {") for line in got)
            assert srv.sync(srv.engine.stats)["running"] == 1  # still generating when we hang up
    after = _wait_idle(srv)
    assert after["aborted"] == before["aborted"] + 1
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
    deadline = time.monotonic() + 10  # the workers drop it at their next step
    while True:
        usage = srv.call(srv.engine.kv_usage())
        if all(p["seqs"] == 0 and p["used_blocks"] == 0 for p in usage.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(p["seqs"] == 0 and p["used_blocks"] == 0 for p in usage.values()), usage


def test_disconnect_before_a_non_streamed_reply_aborts(srv):
    """No stream: the server still notices the hang-up (ASGI http.disconnect) and aborts the request."""
    import socket
    from urllib.parse import urlsplit
    before = _wait_idle(srv)
    errors_before = _http_count(srv, "/v1/completions", "500")
    u = urlsplit(srv.url)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 500, "temperature": 0, "ignore_eos": True}).encode()
    with socket.create_connection((u.hostname, u.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while srv.sync(srv.engine.stats)["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.sync(srv.engine.stats)["running"] == 1
    after = _wait_idle(srv)
    assert after["aborted"] == before["aborted"] + 1 and after["finished"] == before["finished"]
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
    assert _http_count(srv, "/v1/completions", "500") == errors_before  # a hang-up is not a server error


def _http_count(srv, route, status) -> float:
    fams = text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
    return sum(s.value for f in fams for s in f.samples if s.name == "minedraft_http_requests_total"
               and s.labels == {"route": route, "status": status})


def _post(url, body, **kw):
    raw = isinstance(body, (bytes, str)) or hasattr(body, "__next__")  # bytes, text, or a chunk generator
    return httpx.post(url, content=body if raw else json.dumps(body),
                      headers={"Content-Type": "application/json", **kw.pop("headers", {})}, timeout=60, **kw)


def test_usage_reports_this_requests_drafts(srv):
    """usage.completion_tokens_details: drafted, accepted and rejected draft tokens of this request, so a client
    sees that speculate=false took effect without reading /metrics."""
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    on = _post(srv.url + "/v1/completions", body).json()["usage"]["completion_tokens_details"]
    off = _post(srv.url + "/v1/completions", {**body, "speculate": False}).json()["usage"]
    assert on["draft_tokens"] > 0 and 0 <= on["accepted_prediction_tokens"] <= on["draft_tokens"]
    assert on["accepted_prediction_tokens"] + on["rejected_prediction_tokens"] == on["draft_tokens"]
    assert off["completion_tokens"] == 24 and off["completion_tokens_details"] == {
        "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0, "draft_tokens": 0}


def _error(r, status, type_=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    if type_:
        assert err["type"] == type_
    return err


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    ({"prompt": PROMPT, "n": 2, "stream": True}, "n"),          # n > 1 without streaming only
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "seed": -3}, "seed"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 100000}, "max_tokens"),    # over the engine's limit: the engine refuses
    ({"prompt": PROMPT, "logprobs": 30}, "logprobs"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),                          # a token id outside the vocabulary
    ({"prompt": "", "stream": True}, "prompt"),  # refused by the engine before any event: a status, not a stream
    ({"prompt": PROMPT, "max_tokens": 100000, "stream": True}, "max_tokens"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ([1, 2], None),
    # fields it does not know are refused, not ignored: they may ask for something it does not do
    ({"prompt": PROMPT, "min_p": 0.1}, "min_p"),
    ({"prompt": PROMPT, "repetition_penalty": -1.2}, "repetition_penalty"),
    ({"prompt": PROMPT, "min_tokens": 4}, "min_tokens"),
    ({"prompt": PROMPT, "max_token": 4}, "max_token"),
    ({"prompt": PROMPT, "messages": [{"role": "user", "content": "x"}]}, "messages"),  # the other endpoint's
    ({"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
    ({"prompt": PROMPT, "top_k": -2}, "top_k"),
    ({"prompt": PROMPT, "stop_token_ids": "x"}, "stop_token_ids"),
    ({"prompt": PROMPT, "stop": ["never"] * 17}, "stop"),           # MAX_STOP_STRINGS (issue 35)
    ({"prompt": PROMPT, "stop": ["y" * 129]}, "stop"),              # MAX_STOP_CHARS
    (b'{"prompt": "a\\ud800b"}', None),                # a lone surrogate: not text any tokenizer takes
    (b'{"model": "\\ud800", "prompt": "a"}', None),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),  # nested past json's recursion limit
])
def test_completion_bad_requests_400(srv, body, param):
    err = _error(_post(srv.url + "/v1/completions", body), 400, "invalid_request_error")
    if param:
        assert err["param"] == param


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 1000, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 1000, "stream": True}),
    ("/v1/completions", {"prompt": "x" * 20000, "max_tokens": 4})])
def test_a_refused_request_leaves_no_reference_cycle(srv, path, body):
    """A refused request's objects (its parsed body: MBs for 12,000 messages) are freed when it ends, not by a
    later full gc: a cycle through the failed task kept them, and server RSS grew 717 -> 2,337 MB over ~230
    refused chats (issue 35)."""
    import gc

    from minedraft.serving.http import openai_api as oa
    gc.collect()
    gc.disable()
    try:
        _error(_post(srv.url + path, body), 400)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        kept = [type(o).__name__ for o in gc.garbage if isinstance(o, (BaseException, oa.ParsedRequest))]
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
    assert not kept


def test_transfer_encoding_with_content_length_refused_at_once(srv):
    import socket
    host, port = srv.url.rsplit("/", 1)[-1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"transfer-encoding: chunked\r\ncontent-length: 20\r\n\r\n" + b'{"prompt": "abcdefg"}')
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split()[1] == b"400" and b"connection: close" in head.lower()
    assert "Transfer-Encoding and Content-Length" in json.loads(body)["error"]["message"]


def test_chat_max_completion_tokens(srv, client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], temperature=0,
                                       max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    _error(_post(srv.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_completion_tokens": 0}), 400)


@pytest.mark.parametrize("messages", [None, [], "hi", [{"role": "wizard", "content": "x"}], [{"role": "user"}],
                                      [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                                      [{"role": "user", "content": "a\ud800"}],
                                      [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],
                                      [{"role": "user", "content": "hi", "name": "bob"}],  # unknown keys
                                      [{"role": "user", "content": "x"}] * 1000])  # > max_prompt_tokens messages
def test_chat_bad_messages_400(srv, messages):
    """(also: content with a lone surrogate)"""
    body = {"max_tokens": 4} if messages is None else {"messages": messages, "max_tokens": 4}
    _error(_post(srv.url + "/v1/chat/completions", body), 400, "invalid_request_error")


def test_harmless_fields_accepted_and_stop_token_ids_honoured(srv, client, model):
    base = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    ref = _post(srv.url + "/v1/completions", base).json()
    r = _post(srv.url + "/v1/completions", {**base, "user": "u1", "metadata": {"a": "b"}, "store": False,
                                            "service_tier": "auto", "parallel_tool_calls": False,
                                            "prompt_cache_retention": "24h",
                                            # vLLM-style extensions at the values that change nothing
                                            "repetition_penalty": 1.0, "min_p": 0, "min_tokens": 0,
                                            "skip_special_tokens": True, "frequency_penalty": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    r = _post(srv.url + "/v1/completions", {**base, "stream": True,
                                            "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert r.status_code == 200 and "[DONE]" in r.text
    hot = _post(srv.url + "/v1/completions", {**base, "temperature": 3.5, "seed": 1})  # above OpenAI's cap: served
    assert hot.status_code == 200 and hot.json()["usage"]["completion_tokens"] == 12
    err = _error(_post(srv.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                           "prompt": "x"}), 400)
    assert err["param"] == "prompt"
    ids = srv.call(srv.engine.generate(PROMPT, {"max_tokens": 12, "temperature": 0, "ignore_eos": True})).token_ids
    exp = srv.call(srv.engine.generate(PROMPT, {"max_tokens": 12, "temperature": 0, "stop_token_ids": [ids[4]]}))
    assert exp.finish_reason == "stop" and len(exp.token_ids) <= 5
    r = _post(srv.url + "/v1/completions", {**base, "ignore_eos": False, "stop_token_ids": [ids[4]]}).json()
    assert r["choices"][0]["text"] == exp.text and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == len(exp.token_ids)


def test_model_retrieve(srv, client, model):
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")


def test_openai_client_sees_status_errors(client, model):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=3, stream=True)
    assert "n > 1" in e.value.message


def test_404_413(srv):
    _error(httpx.get(srv.url + "/v1/nothing"), 404, "not_found_error")
    err = _error(_post(srv.url + "/v1/completions", {"prompt": "x" * (MAX_BODY + 10)}), 413)
    assert err["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"y" * 1024
        yield b'"}'
    _error(_post(srv.url + "/v1/completions", chunked()), 413)


def test_429_when_queue_full(srv, model):
    """4 running (max_batch_size) + 2 waiting (max_queue) fill the engine: the next request is refused."""
    _wait_idle(srv)
    params = {"max_tokens": 500, "ignore_eos": True}

    async def fill():
        import asyncio
        tasks = [asyncio.ensure_future(srv.engine.generate(PROMPT, params, request_id=f"fill-{i}"))
                 for i in range(6)]
        await asyncio.sleep(0.05)  # every submit has run
        return tasks
    tasks = srv.call(fill())
    try:
        st = srv.sync(srv.engine.stats)
        assert st["running"] == 4 and st["waiting"] == 2
        err = _error(_post(srv.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}), 429)
        assert err["code"] == "overloaded"
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model=model, prompt=PROMPT, max_tokens=4, stream=True)
    finally:
        for i in range(6):
            srv.call(srv.engine.abort(f"fill-{i}"))
    assert all(t.result().finish_reason == "abort" for t in tasks)
    _wait_idle(srv)


def test_503_when_engine_dead():
    """An app whose engine is not running answers 503 (and /health says so); no worker processes needed."""
    s = ServerThread(start_engine=False).start()
    try:
        err = _error(_post(s.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}), 503, "server_error")
        assert err["code"] == "engine_dead"
        assert httpx.get(s.url + "/health").status_code == 503
    finally:
        s.stop()


def test_api_key_enforced(srv):
    url = srv.add_server(api_key=KEY)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        err = _error(_post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, headers=headers), 401)
        assert err["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="tiny-target", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    assert httpx.get(url + "/health").status_code == 200  # liveness stays open for probes


def test_metrics_parse_and_match_engine_stats(srv, client, model):
    for p in ("A function definition", "The for statement", PROMPT):
        client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0)
    _wait_idle(srv)
    text = httpx.get(srv.url + "/metrics").text
    st = srv.sync(srv.engine.stats)
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def by_pos(name, suffix=""):
        return {int(s.labels["position"]): s.value for s in fams[name].samples if s.name == name + suffix}
    drafted = by_pos("minedraft_position_drafted", "_total")
    accepted = by_pos("minedraft_position_accepted", "_total")
    rate = by_pos("minedraft_acceptance_by_position")
    k = srv.engine.config.k
    assert sorted(drafted) == list(range(k))
    assert [drafted[i] for i in range(k)] == st["drafted_by_position"]
    assert [accepted[i] for i in range(k)] == st["accepted_by_position"]
    assert all(rate[i] == pytest.approx(accepted[i] / drafted[i]) for i in range(k))
    assert rate[0] > 0 and all(accepted[i] <= accepted[i - 1] for i in range(1, k))  # prefix acceptance
    counts = {s.name: s.value for f in fams.values() for s in f.samples if s.name.endswith("_count")}
    assert counts["minedraft_verify_seconds_count"] == counts["minedraft_step_seconds_count"] == st["steps"]
    one = {s.name: s.value for f in fams.values() for s in f.samples if not s.labels}
    assert one["minedraft_output_tokens_total"] == st["output_tokens"]
    assert one["minedraft_kv_blocks_free"] == st["kv_blocks_free"] and one["minedraft_engine_up"] == 1
    http = {(s.labels["route"], s.labels["status"]): s.value for s in fams["minedraft_http_requests"].samples
            if s.name == "minedraft_http_requests_total"}
    assert http[("/v1/completions", "200")] >= 3


def test_timeline_has_recent_draft_and_verify(srv, client, model):
    client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    tl = httpx.get(srv.url + "/dashboard/timeline").json()
    lanes = {iv[0] for iv in tl["intervals"]}
    assert lanes == {"drafter", "verifier"}
    assert tl["chat"] is False  # the bundled pair is a base model: the dashboard keeps a plain completion
    assert all(-tl["window_s"] - 1 < iv[2] <= iv[3] <= 0.01 for iv in tl["intervals"])


def test_zz_worker_death_mid_stream_then_503(srv):
    """Runs last in this module (it kills the module's engine): a stream in flight gets an in-band OpenAI error
    event and [DONE]; afterwards requests get 503, /health 503 and minedraft_engine_up 0."""
    import os
    import signal as sig
    body = {"prompt": PROMPT, "max_tokens": 500, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", srv.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(srv.engine.procs[1].pid, sig.SIGKILL)  # the verifier
            rest = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    errors = [json.loads(d)["error"] for d in rest[:-1] if "error" in json.loads(d)]
    assert len(errors) == 1 and errors[0]["code"] == "engine_dead" and errors[0]["type"] == "server_error"
    err = _error(_post(srv.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}), 503, "server_error")
    assert err["code"] == "engine_dead"
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 503 and health.json()["verifier_alive"] is False
    assert "minedraft_engine_up 0.0" in httpx.get(srv.url + "/metrics").text


def test_an_internal_error_is_a_500_reply_not_a_dropped_connection():
    """A handler's unexpected error becomes a 500 JSON reply inside the app; left to Starlette's catch-all it
    would be re-raised after the reply (the server then drops the keep-alive connection)."""
    import asyncio
    from types import SimpleNamespace

    from minedraft.serving.http.app import create_app

    def broken():
        raise RuntimeError("probe failed")
    engine = SimpleNamespace(config=EngineConfig(), health=broken, step_stats=None)
    app = create_app(engine)

    async def go():
        transport = httpx.ASGITransport(app=app)  # raises whatever the app lets escape
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get("/health")
    r = asyncio.run(go())
    assert r.status_code == 500 and "probe failed" in r.json()["error"]["message"]

    async def hang_up():  # the body never finishes arriving: a 499, not a server error
        async def receive():
            return {"type": "http.disconnect"}
        sent = []

        async def send(msg):
            sent.append(msg)
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b"",
                 "root_path": "", "scheme": "http", "server": ("t", 80), "client": ("c", 1)}
        await app(scope, receive, send)
        return sent[0]["status"]
    assert asyncio.run(hang_up()) == 499


def test_default_body_limit_follows_the_prompt_limit():
    from minedraft.serving.http.app import body_limit_for
    assert body_limit_for(768) == 1 << 20
    assert body_limit_for(32768) == 96 * 32768 + (64 << 10)


def test_refusal_pacer_answers_bursts_at_once_and_paces_the_rest():
    from minedraft.serving.http.guard import RefusalPacer
    p = RefusalPacer(10)
    assert [p.delay(100.0) for _ in range(10)] == [0.0] * 10           # a second's worth at once
    assert [round(p.delay(100.0), 3) for _ in range(3)] == [0.1, 0.2, 0.3]
    assert p.delay(200.0) == 0.0 and p.paced == 3                        # idle time refills the budget
    with pytest.raises(ValueError, match="refusal rate"):
        RefusalPacer(0)


def test_a_flood_of_refused_requests_is_paced_and_valid_requests_are_not():
    """30 bad requests at once against a refusal rate of 10/s: every one gets its JSON 400, the last ones about
    2 s late; a valid completion sent meanwhile is answered at its usual speed. (Its own server: the module's
    is shut down by an earlier test.)"""
    own = ServerThread(EngineConfig(), refusal_rate=10).start()
    try:
        _paced_flood(own.url)
    finally:
        own.stop()


def _paced_flood(url: str) -> None:

    async def run():
        async with httpx.AsyncClient(timeout=30) as c:
            async def bad():
                r = await c.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": -1})
                return r.status_code, r.json()["error"]["type"], time.monotonic()

            async def good():
                await asyncio.sleep(0.3)
                t0 = time.monotonic()
                r = await c.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
                return r.status_code, time.monotonic() - t0
            t0 = time.monotonic()
            return t0, await asyncio.gather(good(), *(bad() for _ in range(30)))
    t0, (ok, *refused) = asyncio.run(run())
    assert {(s, t) for s, t, _ in refused} == {(400, "invalid_request_error")}
    assert max(t for _, _, t in refused) - t0 >= 1.5          # (30 - 10) / 10 = 2 s of pacing
    assert ok[0] == 200 and ok[1] < 1.0, ok
