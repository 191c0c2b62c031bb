"""Suffix drafts (draft="suffix") and the hybrid (draft="suffix+<model>") through the sampler, LocalEngine and the
pipeline: greedy identity, the sampled law, first-step prompt matches, cancellation and worker death."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from minedraft.config import EngineConfig, parse_draft
from minedraft.engine.engine import Engine
from minedraft.engine.local_engine import LocalEngine
from minedraft.errors import EngineDeadError
from minedraft.sampling_params import SamplingParams
from minedraft.sampling import batch_sampling
from minedraft.sampling.batch_sampling import RowParams, verify_batch
from minedraft.sampling.reference import process_logits
from sampling_law import TARGET_LOGITS, V, chi2_critical, chi2_stat

# the random tiny target falls into loops, which its own text then predicts: suffix drafts get accepted
PROMPTS = [list(range(3, 23)) + list(range(3, 9)), [7, 7, 8, 9, 7, 7, 8], [40, 41, 42, 43], [100],
           [5, 9, 11, 40, 2] * 3, list(range(60, 90))]


def _cfg(pair, draft="suffix", **kw) -> EngineConfig:
    d = draft.replace("MODEL", pair.draft)
    base = dict(target=pair.target, draft=d, k=6, max_prompt_tokens=128, max_tokens_limit=64, kv_cache_tokens=8192,
                max_batch_size=16, adaptive_k=False)  # fixed k unless a test asks for dynamic speculation
    base.update(kw)
    return EngineConfig(**base)


def _greedy(n=40):
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(tiny_pair):
    ref = LocalEngine(_cfg(tiny_pair, draft="MODEL", mode="autoregressive"))
    return [r.token_ids for r in ref.generate(PROMPTS, _greedy())]


def test_parse_draft_and_config_checks(tiny_pair):
    assert parse_draft("suffix") == (True, None)
    assert parse_draft("suffix+/m/d") == (True, "/m/d") and parse_draft("/m/d") == (False, "/m/d")
    c = _cfg(tiny_pair)
    assert c.suffix_drafts and c.draft_model is None
    for bad in (dict(tetris=True), dict(suffix_options={"min_prob": 2}), dict(draft="suffix+/nowhere"),
                dict(draft="MODEL", suffix_options={"max_depth": 4}), dict(draft_tp=2)):
        with pytest.raises(ValueError):
            _cfg(tiny_pair, **bad)


def test_mode_auto_is_sequential_for_suffix_drafts_alone(tiny_pair):
    """The default mode ("auto") resolves in the config: sequential SD for suffix drafts alone (nothing for the
    overlap to hide), minedraft with a draft model (the hybrid included); a mode given explicitly stands."""
    from minedraft.config import EngineConfig
    assert EngineConfig.mode == "auto"
    assert _cfg(tiny_pair, mode="auto").mode == "sequential"
    assert _cfg(tiny_pair, mode="auto", draft="suffix+MODEL").mode == "minedraft"
    assert _cfg(tiny_pair, mode="auto", draft="MODEL").mode == "minedraft"
    assert _cfg(tiny_pair, mode="minedraft").mode == "minedraft"
    with pytest.raises(ValueError, match="auto"):
        _cfg(tiny_pair, mode="fast")


def test_suffix_drafter_shares_the_verifiers_cores(tiny_pair):
    """Suffix drafts alone run no model: in minedraft mode the drafter shares the verifier's cores (all of them),
    as in autoregressive mode; with a draft model (the hybrid) the halves stay disjoint."""
    from minedraft.cores import available_cores, resolve
    allowed = available_cores()
    d, t = resolve(None, None, _cfg(tiny_pair, mode="minedraft").core_mode, allowed)
    assert d == t == allowed
    if len(allowed) > 1:
        d, t = resolve(None, None, _cfg(tiny_pair, draft="suffix+MODEL").core_mode, allowed)
        assert not set(d) & set(t)
    _cfg(tiny_pair, draft_cores=allowed, target_cores=allowed)  # sharing given explicitly is accepted too


# -- the sampler: a deterministic draft (q None) is rejection sampling with a one-hot q -----------------------

def _det_trial(trials, drafts_row, params, q=None):
    rp = RowParams.of([params] * trials, list(range(trials)))
    k = len(drafts_row)
    drafts = torch.tensor([drafts_row] * trials)
    logits = TARGET_LOGITS[:k + 1].expand(trials, -1, -1)
    n, tok = verify_batch(logits, drafts, torch.full((trials,), k), q, rp, torch.full((trials,), 7))
    n, tok = torch.tensor(n), torch.tensor(tok)
    out0 = torch.where(n > 0, drafts[:, 0], tok)
    out1 = torch.where(n > 1, drafts[:, min(1, k - 1)], tok)[n > 0]
    return torch.bincount(out0, minlength=V), torch.bincount(out1, minlength=V), n


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.0, seed=3)], ids=["t1", "topk4", "seeded"])
def test_deterministic_drafts_follow_the_target(params):
    p = process_logits(TARGET_LOGITS[:3], params)
    for drafts in ([0, 2], [3, 2], [1, 4]):  # likely, middling and unlikely first drafts
        c0, c1, n = _det_trial(20_000, drafts, params)
        assert (n > 0).sum() > 100 and (n == 0).sum() > 100
        for counts, probs in ((c0, p[0]), (c1, p[1])):
            stat, dof = chi2_stat(counts, probs)
            assert stat < chi2_critical(dof), f"chi2={stat:.1f} counts={counts.tolist()} p={probs.tolist()}"
    # q None is exactly a one-hot q: the same numbers, the same verdicts
    onehot = torch.zeros(500, 2, V).scatter_(2, torch.tensor([[3, 2]] * 500)[..., None], 1.0)
    assert all(torch.equal(a, b) for a, b in zip(_det_trial(500, [3, 2], params), _det_trial(500, [3, 2], params,
                                                                                             onehot)))


def test_statistic_rejects_a_sampler_that_trusts_the_deterministic_draft():
    """The wrong sampler: a draft with q = 0 for its own token would be accepted always (p / q = inf)."""
    params = SamplingParams(temperature=1.0)
    c0, _, _ = _det_trial(20_000, [3, 2], params, q=torch.zeros(20_000, 2, V))
    stat, dof = chi2_stat(c0, process_logits(TARGET_LOGITS[:1], params)[0])
    assert stat > 5 * chi2_critical(dof), stat


# -- LocalEngine (in-process sequential SD) ---------------------------------------------------------------------

@pytest.mark.parametrize("draft", ["suffix", "suffix+MODEL"])
def test_local_greedy_equals_target_alone(tiny_pair, alone, draft):
    """Two waves: the first drafts from each request's own text (mostly rejected), the second also from the first
    wave's outputs in the global index (mostly accepted)."""
    eng = LocalEngine(_cfg(tiny_pair, draft=draft, mode="sequential", hybrid_threshold=1.0))
    res = eng.generate(PROMPTS, _greedy()) + eng.generate(PROMPTS, _greedy())
    assert [r.token_ids for r in res] == alone * 2
    drafted, accepted = (sum(getattr(r.stats, f) for r in res) for f in ("draft_tokens", "accepted_tokens"))
    assert accepted > 100 and drafted > accepted + 10
    if draft == "suffix":
        assert eng.draft is None  # no draft model loaded


def test_own_prompt_is_matched_from_the_first_step(tiny_pair):
    eng = LocalEngine(_cfg(tiny_pair, mode="sequential", k=8))
    x = list(range(30, 50))
    from minedraft.engine.request_state import RequestState, make_request
    st = RequestState("0", make_request(0, x + x[:6], _greedy(), eng.tokenizer, eng.config, 5000), eng.tokenizer)
    from collections import deque
    running: dict = {}
    eng._admit(deque([st]), running)
    drafts, q = eng.drafter.draft([0], 8)
    assert q is None and eng.drafter.sources == ["suffix"]
    assert len(drafts[0]) >= 5 and drafts[0] == x[6:6 + len(drafts[0])]  # cut where the estimate falls below 0.3


@pytest.mark.parametrize("budget", [0, 2])
def test_a_per_request_draft_budget_caps_suffix_drafts(tiny_pair, budget):
    eng = LocalEngine(_cfg(tiny_pair, mode="sequential", k=8))
    x = list(range(30, 50))
    from collections import deque

    from minedraft.engine.request_state import RequestState, make_request
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, draft_budget=budget)
    st = RequestState("0", make_request(0, x + x[:6], params, eng.tokenizer, eng.config, 5000), eng.tokenizer)
    eng._admit(deque([st]), {})
    drafts, _ = eng.drafter.draft([0], 8)
    assert len(drafts[0]) == budget and drafts[0] == x[6:6 + budget]  # the prompt repeats: a match of 8 or more


def test_hybrid_q_is_the_models_for_model_rows_and_one_hot_for_suffix_rows(tiny_pair):
    eng = LocalEngine(_cfg(tiny_pair, draft="suffix+MODEL", mode="sequential", k=4, hybrid_threshold=1.0))
    from collections import deque

    from minedraft.engine.request_state import RequestState, make_request
    x = list(range(30, 50))
    sp = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    states = [RequestState(str(i), make_request(i, p, sp, eng.tokenizer, eng.config, 300), eng.tokenizer)
              for i, p in [(1000, x + x[:8]), (1001, [7, 8, 9])]]  # the first repeats its prompt, the second
    running = {}
    eng._admit(deque(states), running)                               # has nothing to copy
    eng.drafter.prefill([1000, 1001])   # the model's prompts fed (a row's first step drafts no model tokens)
    drafts, q = eng.drafter.draft([1000, 1001], 4)
    assert eng.drafter.sources == ["suffix", "model"] and drafts[0] == x[8:12] and len(drafts[1]) == 4
    assert torch.equal(q[0], torch.nn.functional.one_hot(torch.tensor(x[8:12]), q.shape[-1]).float())
    assert torch.allclose(q[1].sum(-1), torch.ones(4)) and bool((q[1] < 1).all())
    for rid in running:  # drop both (never verified) so their blocks and pending prefix are freed
        eng.verifier.remove(rid)
        eng.drafter.remove(rid)
        eng.admission.release(rid)
    res = eng.generate([x + x[:8], [7, 8, 9]] * 4, sp)  # sampled hybrid rows run to the end
    assert all(len(r.token_ids) == 8 for r in res)


def test_sampled_law_through_local_engine(tiny_pair, monkeypatch):
    """Unseeded sampled rows with suffix drafts (the prompt's repeat proposes its continuation at the first step):
    the first two tokens' joint law is the target's; the same run with a sampler that trusts the draft fails."""
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(tiny_pair.target, local_files_only=True).eval()
    params = dict(temperature=1.0, top_k=3, max_tokens=2, ignore_eos=True)
    sp = SamplingParams(**params)
    with torch.no_grad():
        base = [5, 9, 11, 40, 2]
        # choose the repeated token a so that it is neither sure nor unlikely after base + [a] + base
        cand = []
        for a in range(3, 200):
            p = process_logits(target(torch.tensor([base + [a] + base])).logits[0, -1:], sp)[0]
            cand.append((abs(float(p[a]) - 0.5), a))
        a = min(cand)[1]
        prompt = base + [a] + base
        p1 = process_logits(target(torch.tensor([prompt])).logits[0, -1:], sp)[0]
        cells, probs = [], []
        for t in p1.nonzero().flatten().tolist():
            p2 = process_logits(target(torch.tensor([prompt + [t]])).logits[0, -1:], sp)[0]
            for u in p2.nonzero().flatten().tolist():
                cells.append((t, u))
                probs.append(float(p1[t] * p2[u]))
    assert 0.15 < float(p1[a]) < 0.85

    def run(n=3000):
        eng = LocalEngine(_cfg(tiny_pair, mode="sequential", k=4, max_batch_size=500))
        counts: dict = {}
        drafted = 0
        for _ in range(n // 500):
            for r in eng.generate([prompt] * 500, SamplingParams(**params)):
                counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
                drafted += r.stats.draft_tokens > 0
        assert drafted == n  # every row got a suffix draft at its first step
        return torch.tensor([counts.get(c, 0) for c in cells]), set(counts) - set(cells)

    obs, stray = run()
    assert not stray
    stat, dof = chi2_stat(obs, torch.tensor(probs))
    assert stat < chi2_critical(dof), f"chi2={stat:.1f} dof={dof}"
    real = batch_sampling.verify_batch
    monkeypatch.setattr("minedraft.workers.verifier.verify_batch",
                        lambda logits, drafts, counts, q, *a, **kw: real(
                            logits, drafts, counts, torch.zeros(*drafts.shape, 5000) if q is None else q, *a, **kw))
    obs, _ = run()
    stat, _ = chi2_stat(obs, torch.tensor(probs))
    assert stat > 5 * chi2_critical(dof), stat


# -- the pipeline ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("draft,mode,dynamic", [("suffix", "minedraft", False), ("suffix", "sequential", False),
                                                ("suffix", "minedraft", True), ("suffix+MODEL", "minedraft", False),
                                                ("suffix+MODEL", "sequential", False)])
async def test_pipeline_greedy_equals_target_alone(tiny_pair, alone, draft, mode, dynamic):
    async with Engine(_cfg(tiny_pair, draft=draft, mode=mode, adaptive_k=dynamic)) as engine:
        if dynamic:
            engine.scheduler.set_k(6)  # start drafting; the controller may turn it off again
        res = []
        for _ in range(2):  # the second wave also drafts from the first one's outputs (the global index)
            res += await asyncio.gather(*(engine.generate(p, _greedy()) for p in PROMPTS))
        st = engine.stats()
    assert [r.token_ids for r in res] == alone * 2
    assert st["accepted_tokens"] > (0 if dynamic else 100) and st["draft_time_s"] > 0
    assert st["drafted_by_source"].get("suffix", 0) > 0
    assert st["accepted_by_source"]["suffix"] <= st["drafted_by_source"]["suffix"]
    assert sum(st["drafted_by_source"].values()) == st["draft_tokens"]
    if draft != "suffix":
        assert st["drafted_by_source"].get("model", 0) > 0


async def test_pipeline_cancel_midflight_with_suffix_drafts(tiny_pair, alone):
    async with Engine(_cfg(tiny_pair, max_tokens_limit=64)) as engine:
        long = SamplingParams(max_tokens=64, ignore_eos=True)
        tasks = [asyncio.ensure_future(engine.generate(p, long, request_id=f"r{i}")) for i, p in enumerate(PROMPTS)]
        by_name = engine.scheduler.by_name
        while not all(f"r{i}" in by_name and by_name[f"r{i}"].stats.output_tokens > 0 for i in (0, 2, 4)):
            await asyncio.sleep(0.002)
        for i in (0, 2, 4):
            assert await engine.abort(f"r{i}")
        done = await asyncio.gather(*tasks)
        deadline = time.monotonic() + 3
        while (await engine.kv_usage())["drafter"]["seqs"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        usage = await engine.kv_usage()
    for i, r in enumerate(done):
        assert r.token_ids[:40] == alone[i][:len(r.token_ids[:40])]
        assert (r.finish_reason == "abort") == (i in (0, 2, 4)) or r.finish_reason == "length"
    assert usage["drafter"]["seqs"] == 0 and usage["verifier"]["seqs"] == 0


@pytest.mark.parametrize("who,how", [("drafter", "raise"), ("drafter", "kill"), ("verifier", "kill")])
async def test_worker_death_with_suffix_drafts_fails_every_request(tiny_pair, who, how):
    fault = [who, "draft", 3, how] if how == "raise" else None
    engine = await Engine.start(_cfg(tiny_pair, max_batch_size=4), fault=fault)
    try:
        tasks = [asyncio.ensure_future(engine.generate(p, SamplingParams(max_tokens=64, ignore_eos=True)))
                 for p in PROMPTS * 2]
        if how == "kill":
            while engine.stats()["output_tokens"] < 8:
                await asyncio.sleep(0.005)
            engine.procs[0 if who == "drafter" else 1].kill()
        t0 = time.monotonic()
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert time.monotonic() - t0 < 5
        assert any(isinstance(r, EngineDeadError) for r in done)
        assert all(isinstance(r, EngineDeadError) or r.finish_reason == "length" for r in done)
    finally:
        await engine.shutdown()


def test_a_finished_request_publishes_its_whole_output(tiny_pair):
    """The global index gets every output token, the final step's included (it used to miss them: the last
    verdict finishes the request before its tokens were applied)."""
    eng = LocalEngine(_cfg(tiny_pair, mode="sequential"))
    res = eng.generate(PROMPTS[:2], _greedy(17))
    held = sum(e - s for s, e in eng.drafter.index.texts)
    assert held == sum(len(r.token_ids) for r in res) == 34
