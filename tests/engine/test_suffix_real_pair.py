"""Suffix and hybrid drafts on the real pair (SmolLM2-135M, skipped when not pulled): greedy output through the
pipeline is token for token transformers' own generate on the target alone (fixtures of test_real_pair.py)."""

from __future__ import annotations

import asyncio

import pytest

from minedraft.config import EngineConfig
from minedraft.engine.engine import Engine
from minedraft.sampling_params import SamplingParams
from test_real_pair import MAX_TOKENS, hf_reference, pair, prompts, tok  # noqa: F401 (fixtures)


@pytest.mark.parametrize("draft,mode", [("suffix", "minedraft"), ("suffix", "sequential"),
                                        ("hybrid", "minedraft")])
async def test_suffix_greedy_equals_transformers_generate(pair, prompts, hf_reference, draft, mode):  # noqa: F811
    d = "suffix" if draft == "suffix" else f"suffix+{pair[1]}"
    cfg = EngineConfig(target=pair[0], draft=d, mode=mode, k=6, max_prompt_tokens=256, max_tokens_limit=64,
                       kv_cache_tokens=8192, max_batch_size=8)
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
