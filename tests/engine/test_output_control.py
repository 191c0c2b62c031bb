"""Output controls end to end on the tiny pair: greedy output with penalties, logit bias or a grammar is token for
token the target alone under the same control, computed here by a reference (Hugging Face full forwards, the
controls written from their definitions, llguidance's matcher fed the reference's own tokens), in every mode; a
per-request draft budget is honoured beside other rows; logprobs are the target's log-softmax.
"""

from __future__ import annotations

import asyncio
import functools
import json

import pytest
import torch

from minedraft.engine.engine import Engine
from minedraft.engine.local_engine import LocalEngine
from minedraft.sampling_params import SamplingParams
from conftest import engine_config

_cfg = functools.partial(engine_config, max_prompt_tokens=128, max_tokens_limit=64, kv_cache_tokens=8192,
                         block_size=16)
PROMPTS = ["Hello", "The quick brown fox", "def f(x):\n    return", "In Python, a class is", "Sorting", "while"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "n", "tags"], "additionalProperties": False}
CONTROLS = {
    "penalties": dict(frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.2),
    "bias": dict(logit_bias={5: 3.0, 17: -100, 40: 2.5}),
    "json": dict(json_schema=SCHEMA),
    "regex": dict(regex=r"(yes|no), [a-z]{2,8}( [a-z]{1,8}){0,4}\."),
}


@pytest.fixture(scope="module")
def hf_target(tiny_pair):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()


def reference(model, tok, tiny_pair, prompt_ids: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding of the target alone under p's controls, by their definitions."""
    V = tiny_pair.vocab_size
    matcher = None
    if p.structured:
        import llguidance as llg
        import llguidance.hf
        llt = llguidance.hf.from_tokenizer(tok, n_vocab=V, eos_token=[tiny_pair.eos_token_id])
        kind, text = p.structured
        g = {"json_schema": lambda: llg.LLMatcher.grammar_from_json_schema(
            json.loads(text), defaults={"whitespace_flexible": False}),
             "regex": lambda: llg.LLMatcher.grammar_from_regex(text)}[kind]()
        matcher = llg.LLMatcher(llt, g)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < p.max_tokens:
            x = model(torch.tensor([prompt_ids + out])).logits[0, -1].float()
            if p.repetition_penalty != 1.0:
                idx = torch.tensor(sorted(set(prompt_ids + out)))
                v = x[idx]
                x[idx] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V).float()
            x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
            for t, b in p.logit_bias:
                x[t] += b
            if matcher is not None:
                bits = matcher.compute_logit_bias()
                x[torch.frombuffer(bytearray(bits), dtype=torch.uint8)[:V] == 0] = float("-inf")
            t = int(x.argmax())
            out.append(t)
            if matcher is not None:
                assert matcher.consume_token(t)
            if t == tiny_pair.eos_token_id:
                break
    return out


@pytest.fixture(scope="module")
def refs(hf_target, tiny_tokenizer, tiny_pair):
    cache = {}

    def get(name: str, max_tokens: int = 40):
        if name not in cache:
            p = SamplingParams(max_tokens=max_tokens, **CONTROLS[name])
            cache[name] = [reference(hf_target, tiny_tokenizer, tiny_pair, tiny_tokenizer.encode(x), p)
                           for x in PROMPTS]
        return cache[name]
    return get


LOCAL_MODES = {"target-alone": dict(mode="autoregressive"), "sd-k3": dict(mode="sequential", k=3),
               "tetris": dict(mode="sequential", k=2, tetris=True, tetris_extra=2)}


@pytest.fixture(scope="module", params=list(LOCAL_MODES))
def local(request, tiny_pair):
    return request.param, LocalEngine(_cfg(tiny_pair, **LOCAL_MODES[request.param]))


@pytest.mark.parametrize("control", list(CONTROLS))
def test_greedy_with_control_is_the_target_alone_with_it(local, control, refs):
    mode, eng = local
    want = refs(control)
    res = eng.generate(PROMPTS, SamplingParams(max_tokens=40, **CONTROLS[control]))
    assert [r.token_ids for r in res] == want
    if mode != "target-alone":  # drafts were rejected, inside the grammar's region too
        drafted = sum(r.stats.draft_tokens for r in res)
        assert 0 < sum(r.stats.accepted_tokens for r in res) < drafted
    if control == "json":
        for r in res:
            if r.finish_reason == "stop":
                obj = json.loads(r.text)
                assert set(obj) == {"name", "n", "tags"}


def test_the_controls_change_the_output(refs, hf_target, tiny_tokenizer, tiny_pair):
    plain = [reference(hf_target, tiny_tokenizer, tiny_pair, tiny_tokenizer.encode(x), SamplingParams(max_tokens=40))
             for x in PROMPTS]
    for name in CONTROLS:
        assert refs(name) != plain, name


@pytest.mark.parametrize("mode", ["sd-k3", "tetris"])
def test_budget_zero_beside_budget_k_in_one_batch(tiny_pair, refs, mode):
    eng = LocalEngine(_cfg(tiny_pair, **{**LOCAL_MODES[mode], "k": 3}))
    params = [SamplingParams(max_tokens=40, speculate=(i % 3 != 0), draft_budget=[None, 1, 2][i % 3],
                             **CONTROLS["penalties"]) for i in range(len(PROMPTS))]
    res = eng.generate(PROMPTS, params)
    assert [r.token_ids for r in res] == refs("penalties")
    for p, r in zip(params, res):
        if not p.speculate:
            assert r.stats.draft_tokens == 0 and r.stats.steps == r.stats.output_tokens
        else:
            assert 0 < r.stats.draft_tokens <= p.draft_budget * r.stats.steps


def test_logprobs_are_the_targets_log_softmax(tiny_pair, hf_target, tiny_tokenizer):
    eng = LocalEngine(_cfg(tiny_pair, mode="sequential", k=3))
    res = eng.generate(PROMPTS[:3], SamplingParams(max_tokens=20, logprobs=3, frequency_penalty=1.0))
    for prompt, r in zip(PROMPTS, res):
        ids = tiny_tokenizer.encode(prompt)
        with torch.no_grad():
            lp = torch.log_softmax(hf_target(torch.tensor([ids + r.token_ids])).logits[0].float(), -1)
        assert len(r.logprobs) == len(r.token_ids)
        for i, (t, (chosen, top)) in enumerate(zip(r.token_ids, r.logprobs)):
            row = lp[len(ids) - 1 + i]
            assert chosen == pytest.approx(float(row[t]), abs=1e-4)
            assert [i for i, _ in top] == row.topk(3).indices.tolist()
            assert [v for _, v in top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("mode", ["minedraft", "sequential"])
def test_engine_modes_with_controls_and_budgets(tiny_pair, refs, mode):
    names = ["penalties", "bias", "json", "regex"]

    async def run():
        async with Engine(_cfg(tiny_pair, mode=mode, k=3)) as eng:
            jobs = []
            for name in names:
                for i, x in enumerate(PROMPTS):
                    p = SamplingParams(max_tokens=40, draft_budget=[0, 2, None][i % 3], **CONTROLS[name])
                    jobs.append(eng.generate(x, p))
            return await asyncio.gather(*jobs)
    res = asyncio.run(run())
    for j, name in enumerate(names):
        got = res[j * len(PROMPTS):(j + 1) * len(PROMPTS)]
        assert [r.token_ids for r in got] == refs(name), name
        for i, r in enumerate(got):
            if i % 3 == 0:
                assert r.stats.draft_tokens == 0
