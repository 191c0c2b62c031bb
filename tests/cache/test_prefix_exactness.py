"""Prefix caching never changes output: greedy with caching == without == transformers.generate, for prefixes
shorter than a block, exactly k blocks and k blocks + 1 token, with drafts rejected near the boundary, in every
mode, with Tetris, a feature-conditioned draft and tensor parallelism; the sampled law (chi-square) with caching
on; memory pressure with many distinct prefixes evicts and keeps serving."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random

import pytest
import torch

from minedraft.engine.engine import Engine
from minedraft.engine.local_engine import LocalEngine
from minedraft.sampling_params import SamplingParams

from conftest import MODELS_DIR, engine_config
from sampling_law import chi2_critical, chi2_stat

BS = 4
_cfg = functools.partial(engine_config, k=3, block_size=BS, max_prompt_tokens=64, max_tokens_limit=32,
                         kv_cache_tokens=4096, max_batch_size=16)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
BASE = [random.Random(5).randrange(1, 300) for _ in range(40)]
BUNDLED = dataclasses.make_dataclass("Pair", ["target", "draft"])(str(MODELS_DIR / "tiny-target"),
                                                                  str(MODELS_DIR / "tiny-draft"))


def shared_prompts(shared: int, n: int = 6, seed: int = 0) -> list[list[int]]:
    """n prompts that agree on their first `shared` tokens and then differ (1 to 6 more tokens), plus one that
    is exactly the shared part and one that repeats another prompt whole."""
    rng = random.Random(seed)
    out = [BASE[:shared] + [rng.randrange(1, 300) for _ in range(rng.randint(1, 6))] for _ in range(n)]
    return out + [BASE[:max(shared, 1)], list(out[0])]


@functools.lru_cache(maxsize=None)
def _hf(target: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(target, local_files_only=True).eval()


def hf_greedy(target: str, prompts, max_tokens: int) -> list[list[int]]:
    model = _hf(target)
    out = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
            out.append(g[0, len(p):].tolist())
    return out


def run_local(cfg, rounds):
    """Each round's prompts in one generate() (they share while running), rounds one after the other (later
    rounds find the earlier ones' prompts and replies cached)."""
    eng = LocalEngine(cfg)
    prefill, drafted, accepted = [], [], []
    inner = eng.verifier.verify

    def verify(rids, drafts, q):
        res = inner(rids, drafts, q)
        prefill.extend(r.prefill_tokens for r in res)
        drafted.extend(r.num_drafted for r in res)
        accepted.extend(r.num_accepted for r in res)
        return res
    eng.verifier.verify = verify
    outs = [[r.token_ids for r in eng.generate(p, GREEDY)] for p in rounds]
    assert eng.target.cache.num_seqs == 0 and (not eng.drafter or eng.draft.cache.num_seqs == 0)
    eng.spec_counts = (sum(drafted), sum(accepted))
    return outs, eng, sum(prefill)


@pytest.mark.parametrize("shared", [3, 2 * BS, 2 * BS + 1, 5 * BS])
@pytest.mark.parametrize("mode,extra", [("sequential", {}), ("autoregressive", {}),
                                        ("sequential", {"tetris": True, "tetris_capacity": 5})])
def test_local_greedy_with_caching_equals_without_and_transformers(tiny_pair, shared, mode, extra):
    rounds = [shared_prompts(shared, seed=1), shared_prompts(shared, seed=1)[:3] + shared_prompts(shared, seed=2)]
    on, eng, computed_on = run_local(_cfg(tiny_pair, mode=mode, **extra), rounds)
    off, eng_off, computed_off = run_local(_cfg(tiny_pair, mode=mode, prefix_caching=False, **extra), rounds)
    assert on == off
    flat = [p for r in rounds for p in r]
    assert [t for r in on for t in r] == hf_greedy(tiny_pair.target, flat, GREEDY.max_tokens)
    st = eng.admission.blocks.stats
    assert computed_off == sum(map(len, flat))
    if shared > BS:  # something was shared, and the verifier computed only the rest
        assert st.hits >= BS * (len(flat) - 2) and computed_on == computed_off - st.hits
    else:            # shorter than a block + 1: nothing to share but whole repeated prompts
        assert computed_on == computed_off - st.hits
    if mode != "autoregressive":  # drafts were rejected as well as accepted: rollbacks ran
        assert 0 < eng.spec_counts[1] < eng.spec_counts[0]
    assert eng.admission.blocks.used_blocks == 0 and eng.admission.free_blocks == eng.admission.blocks.num_blocks


def test_rejections_happen_at_the_block_boundary(tiny_pair):
    """A prompt ending one token past a block boundary: its first drafts (in its second step: the first drafts
    nothing) sit two positions after shared blocks, and the tiny draft rejects some of them; the rollback must not
    touch the shared blocks (truncate would raise)."""
    cfg = _cfg(tiny_pair, mode="sequential", k=4)
    eng = LocalEngine(cfg)
    rejected, drafted_once = [], set()
    inner = eng.verifier.verify

    def verify(rids, drafts, q):
        res = inner(rids, drafts, q)
        first = [r for r in res if r.num_drafted and r.rid not in drafted_once]
        drafted_once.update(r.rid for r in first)
        rejected.extend(r.num_drafted - r.num_accepted for r in first)
        return res
    eng.verifier.verify = verify
    prompts = [BASE[:2 * BS] + [t] for t in range(1, 40)]  # 2 shared blocks + 1 own token each
    out = [r.token_ids for r in eng.generate(prompts, GREEDY)]
    assert out == hf_greedy(tiny_pair.target, prompts, GREEDY.max_tokens)
    assert sum(1 for r in rejected if r) >= 5, rejected  # first steps with a rejection right at the boundary
    assert eng.admission.blocks.stats.hits == 2 * BS * (len(prompts) - 1)


def test_feature_conditioned_draft_with_caching():
    """The bundled tiny-eagle on its target: the draft's features of a cached prefix come from the verifier's
    state store, so its drafts (and acceptance) are the same with caching as without."""
    pair = dataclasses.replace(BUNDLED, draft=str(MODELS_DIR / "tiny-eagle"))
    rounds = [shared_prompts(2 * BS + 1, seed=3), shared_prompts(2 * BS + 1, seed=3)]
    on, eng, _ = run_local(_cfg(pair, mode="sequential"), rounds)
    off, eng_off, _ = run_local(_cfg(pair, mode="sequential", prefix_caching=False), rounds)
    assert eng.drafter.features
    assert on == off
    assert [t for r in on for t in r] == hf_greedy(pair.target, [p for r in rounds for p in r], 12)
    assert eng.admission.blocks.stats.hits > 0
    assert eng.spec_counts == eng_off.spec_counts  # features aligned: the very same drafts were accepted


def test_memory_pressure_with_distinct_prefixes_evicts_and_keeps_serving(tiny_pair):
    """A cache of 40 blocks and 30 requests of 4 different 20-token prefixes, in rounds: cached prefixes must be
    evicted for new ones, and every output is still the target's."""
    cfg = _cfg(tiny_pair, mode="sequential", kv_cache_tokens=40 * BS, max_prompt_tokens=24, max_tokens_limit=12)
    eng = LocalEngine(cfg)
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 300) for _ in range(20)] for _ in range(6)]
    prompts = [prefixes[i % 6] + [rng.randrange(1, 300)] for i in range(30)]
    out = []
    for i in range(0, 30, 5):
        out += [r.token_ids for r in eng.generate(prompts[i:i + 5], GREEDY)]
    assert out == hf_greedy(tiny_pair.target, prompts, GREEDY.max_tokens)
    st = eng.admission.blocks.stats
    assert st.evictions > 0 and st.hits > 0
    eng.admission.blocks.check()


def test_sampled_law_with_caching_is_the_targets(tiny_pair):
    """1200 seeded requests of one prompt (two shared blocks + 1 token): all but the first read the prompt's KV
    from the cache; their first token must follow the target's law (softmax at T = 1.5) by chi-square."""
    from minedraft.sampling.reference import process_logits
    prompt, trials = BASE[:2 * BS + 1], 1200
    sp = [SamplingParams(temperature=1.5, max_tokens=1, seed=1000 + i, ignore_eos=True) for i in range(trials)]
    eng = LocalEngine(_cfg(tiny_pair, mode="sequential"))
    res = eng.generate([prompt] * trials, sp)
    assert eng.admission.blocks.stats.hits == 2 * BS * (trials - 1)
    counts = torch.zeros(tiny_pair.vocab_size, dtype=torch.long)
    for r in res:
        counts[r.token_ids[0]] += 1
    with torch.no_grad():
        logits = _hf(tiny_pair.target)(torch.tensor([prompt])).logits[0, -1]
    p = process_logits(logits[None], sp[0])[0]
    big = p * trials >= 5   # pool the tail so the chi-square approximation holds
    stat, dof = chi2_stat(torch.cat([counts[big], counts[~big].sum()[None]]), torch.cat([p[big], p[~big].sum()[None]]))
    assert dof >= 5 and stat < chi2_critical(dof), f"chi2={stat:.1f} dof={dof}"


PIPELINE = [("minedraft", {}), ("sequential", {}), ("autoregressive", {}),
            ("minedraft", {"tetris": True, "tetris_capacity": 6}), ("minedraft", {"target_tp": 2})]


@pytest.mark.parametrize("mode,extra", PIPELINE, ids=["minedraft", "sequential", "autoregressive", "tetris", "tp2"])
async def test_pipeline_greedy_with_caching_equals_transformers(tiny_pair, mode, extra):
    """Engine (two worker processes) in every mode, with Tetris and a tensor-parallel target: prefixes shorter
    than a block, exactly 2 blocks and 2 blocks + 1, arriving at once (later ones wait for the first's prefill)
    and again once cached; the verifier computes exactly the prompt tokens the scheduler did not find cached."""
    prompts = shared_prompts(2 * BS + 1, seed=4) + shared_prompts(3, seed=5) + shared_prompts(2 * BS, seed=6)
    async with Engine(_cfg(tiny_pair, mode=mode, **extra)) as engine:
        first = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
        again = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts[:6]))
        st = engine.stats()
    got = [r.token_ids for r in first + again]
    assert got == hf_greedy(tiny_pair.target, prompts + prompts[:6], GREEDY.max_tokens)
    total = sum(map(len, prompts + prompts[:6]))
    assert st["prefix_cache_hits"] >= BS * 20 and st["prefill_tokens"] == total - st["prefix_cache_hits"]
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    if mode != "autoregressive":
        assert 0 < st["accepted_tokens"] < st["draft_tokens"]


async def test_pipeline_feature_conditioned_draft_with_caching():
    from minedraft.config import EngineConfig
    cfg = EngineConfig(target=BUNDLED.target, draft=str(MODELS_DIR / "tiny-eagle"), k=3, block_size=BS,
                       max_prompt_tokens=64, max_tokens_limit=32, kv_cache_tokens=4096, max_batch_size=16,
                       adaptive_k=False)  # fixed k: drafts must be accepted across the cached prefix
    prompts = shared_prompts(2 * BS + 1, seed=8)
    async with Engine(cfg) as engine:
        res = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts + prompts))
        st = engine.stats()
    assert [r.token_ids for r in res] == hf_greedy(BUNDLED.target, prompts + prompts, GREEDY.max_tokens)
    assert st["prefix_cache_hits"] > 0 and st["accepted_tokens"] > 0


async def test_requests_waiting_on_a_prefix_start_once_it_is_computed(tiny_pair):
    """Siblings that arrive with a request whose prefix they share wait only for its prefill, not for its end:
    a long first request must not hold short siblings back (they used to wait until a request was released)."""
    prompts = [BASE[:3 * BS] + [7 + i] for i in range(4)]
    long, short = SamplingParams(max_tokens=30, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True)
    done: list[int] = []

    async def one(i):
        await engine.generate(prompts[i], long if i == 0 else short)
        done.append(i)
    async with Engine(_cfg(tiny_pair, mode="sequential", max_tokens_limit=32)) as engine:
        await asyncio.gather(*(one(i) for i in range(4)))
        st = engine.stats()
    assert done[-1] == 0, f"finish order {done}: the siblings waited for the first request to end"
    assert st["prefix_cache_hits"] >= 3 * 3 * BS
