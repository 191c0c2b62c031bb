"""Output controls over HTTP, read by the official `openai` client: logprobs equal to the target's log-softmax
computed by transformers on the same sequence (streamed and not), structured output that always parses and
validates with `jsonschema` under speculation, and 400s that name the problem before any worker work."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import torch

from minedraft.config import EngineConfig
from minedraft.engine.chat import chat_prompt_ids

from http_harness import ServerThread

try:
    import httpx2 as httpx
except ImportError:
    import httpx

PROMPT = "The while statement is used for"
LOGPROB_TOL = 1e-4  # float32 paged-KV forward vs transformers' full forward, same weights


@pytest.fixture(scope="module")
def srv():
    s = ServerThread(EngineConfig(max_batch_size=16, k=3, adaptive_k=False)).start()  # fixed k: acceptance printed
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def hf(srv):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(srv.engine.config.target, dtype=torch.float32).eval()


def log_softmax_rows(hf, prompt_ids, out_ids):
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt_ids + out_ids])).logits[0].float(), -1)
    return lp[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(out_ids)]


def test_completion_logprobs_equal_transformers(srv, client, model, hf):
    tok = srv.engine.tokenizer
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    text = r.choices[0].text
    # the token ids come from the engine's own run of the same greedy request
    res = srv.call(srv.engine.generate(PROMPT, {"max_tokens": 16, "temperature": 0, "ignore_eos": True}))
    out = res.token_ids
    rows = log_softmax_rows(hf, tok.encode(PROMPT), out)
    assert len(lp.token_logprobs) == len(out) == 16
    assert "".join(lp.tokens) == text
    for i, t in enumerate(out):
        assert lp.token_logprobs[i] == pytest.approx(float(rows[i, t]), abs=LOGPROB_TOL)
        top = rows[i].topk(3)
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(top.values.tolist(),
                                                                                  abs=LOGPROB_TOL)
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(out))]
    # streamed: the same numbers, chunk by chunk
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs_equal_transformers_streamed_and_not(srv, client, model, hf):
    tok = srv.engine.tokenizer
    msgs = [{"role": "user", "content": "Tell me about loops."}]
    kw = dict(model=model, messages=msgs, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    res = srv.call(srv.engine.chat(msgs, {"max_tokens": 12, "temperature": 0, "ignore_eos": True}))
    rows = log_softmax_rows(hf, chat_prompt_ids(tok, msgs), res.token_ids)
    assert len(content) == len(res.token_ids)
    for i, (c, t) in enumerate(zip(content, res.token_ids)):
        assert c.logprob == pytest.approx(float(rows[i, t]), abs=LOGPROB_TOL)
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(rows[i].topk(2).values.tolist(), abs=LOGPROB_TOL)
    for c in content:  # each token's text is its bytes decoded (U+FFFD for part of a character)
        assert c.token == bytes(c.bytes).decode("utf-8", "replace")
    streamed = [x for ch in client.chat.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert [x.logprob for x in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)
    assert [x.token for x in streamed] == [c.token for c in content]


def test_logprobs_leave_out_the_stop_token_as_the_text_does(srv, client, model):
    """A request that ends on a stop token has it in token_ids but not in its text: the logprobs (chat content,
    completion tokens) follow the text, streamed and not."""
    free = srv.call(srv.engine.generate(PROMPT, {"max_tokens": 12, "temperature": 0, "ignore_eos": True}))
    stop_at = next(i for i in range(3, 12) if free.token_ids[i] not in free.token_ids[:i])
    stop_id = free.token_ids[stop_at]
    kw = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == stop_at and "".join(lp.tokens) == r.choices[0].text
    streamed = [t for c in client.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    msgs = [{"role": "user", "content": "Tell me about loops."}]
    free = srv.call(srv.engine.chat(msgs, {"max_tokens": 12, "temperature": 0, "ignore_eos": True}))
    stop_at = next(i for i in range(3, 12) if free.token_ids[i] not in free.token_ids[:i])
    ckw = dict(model=model, messages=msgs, max_tokens=12, temperature=0, logprobs=True,
               extra_body={"ignore_eos": True, "stop_token_ids": [free.token_ids[stop_at]]})
    c = client.chat.completions.create(**ckw)
    assert c.choices[0].finish_reason == "stop" and len(c.choices[0].logprobs.content) == stop_at
    assert "".join(x.token for x in c.choices[0].logprobs.content) == c.choices[0].message.content
    streamed = [x.token for ch in client.chat.completions.create(stream=True, **ckw)
                if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert streamed == [x.token for x in c.choices[0].logprobs.content]


def test_penalties_and_bias_change_the_output_over_http(client, model):
    base = dict(model=model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**base).choices[0].text
    pen = client.completions.create(frequency_penalty=1.5, presence_penalty=0.5, **base).choices[0].text
    assert pen != plain


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}},
     "required": ["color", "size"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
     "minItems": 1, "maxItems": 4}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -1000, "maximum": 1000},
                                      "y": {"type": "number", "exclusiveMinimum": 0}, "ok": {"type": "boolean"}},
     "required": ["x", "y", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999}, "role": {"enum": ["admin", "guest"]}},
        "required": ["id", "role"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "integer", "maximum": 99},
        "maxItems": 3}}, "required": ["user", "scores"], "additionalProperties": False},
]


def test_200_json_objects_validate_under_speculation(srv, client, model):
    """50 sampled objects per schema through the engine (concurrently), 5 per schema through the openai client;
    every one that ends on eos parses and validates (at least 40 per schema: 200 in all); one cut by max_tokens
    ends with `length`."""
    n = 50

    async def run(schema, i):
        return await srv.engine.generate(f"Record {i}:", {"max_tokens": 128, "temperature": 0.8, "seed": i,
                                                          "json_schema": schema})
    async def all_of():
        return await asyncio.gather(*[run(s, i) for s in SCHEMAS for i in range(n)])
    res = srv.call(all_of(), timeout=600)
    valid = [0] * len(SCHEMAS)
    for j, r in enumerate(res):
        assert r.finish_reason in ("stop", "length")
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), SCHEMAS[j // n])
            valid[j // n] += 1
    assert min(valid) >= 40, valid
    drafted = sum(r.stats.draft_tokens for r in res)
    assert drafted > 0  # speculation was on
    accepted = sum(r.stats.accepted_tokens for r in res)
    print(f"\nstructured: {sum(valid)} valid of {len(res)}; acceptance {accepted / drafted:.3f}")
    for s in SCHEMAS:
        for i in range(5):
            c = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Give me object {i}"}], max_tokens=64,
                temperature=1.0, seed=i, response_format={"type": "json_schema",
                                                          "json_schema": {"name": "x", "schema": s, "strict": True}})
            if c.choices[0].finish_reason == "stop":
                jsonschema.validate(json.loads(c.choices[0].message.content), s)
    c = client.completions.create(model=model, prompt="An object:", max_tokens=48, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if c.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(c.choices[0].text), dict)


def test_regex_and_grammar_extensions(client, model):
    r = client.completions.create(model=model, prompt="Answer:", max_tokens=20, temperature=0,
                                  extra_body={"regex": r"(yes|no)\. [0-9]{1,3}"})
    import re
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(r"(yes|no)\. [0-9]{1,3}", r.choices[0].text)
    g = 'start: "A" ("," ITEM)* "."\nITEM: /[a-z]{1,5}/'
    r = client.completions.create(model=model, prompt="List:", max_tokens=30, temperature=0,
                                  extra_body={"grammar": g})
    if r.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"A(,[a-z]{1,5})*\.", r.choices[0].text)


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}}, "response_format", "nope"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"regex": "a("}, "regex", "unclosed"),
    ({"grammar": "start: foo"}, "grammar", "foo"),
    ({"regex": "a", "grammar": 'start: "a"'}, "grammar", "at most one"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "vocabulary"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "100"),
    ({"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
    ({"logprobs": 21}, "logprobs", "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs", "chat field"),
    ({"draft_budget": -1}, "draft_budget", "draft_budget"),
])
def test_bad_controls_are_400s_naming_the_problem(srv, body, param, words):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_chat_top_logprobs_needs_logprobs(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "top_logprobs": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
