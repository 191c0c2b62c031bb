"""Self-drafts (draft="self:int4" / "self:bf16"): the target's own weights, converted at load, run as the draft.

Greedy output equals the target alone in every mode, with Tetris and dynamic speculation; the sampled law is the
target's (chi-square on the first two tokens, with an always-accepting sampler rejected by the same statistic); a
bad scheme fails in the config, before any worker starts; the draft's memory is reported.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from minedraft.config import EngineConfig
from minedraft.engine.engine import Engine
from minedraft.engine.local_engine import LocalEngine
from minedraft.sampling.reference import process_logits
from minedraft.sampling_params import SamplingParams
from minedraft.drafting import load, self_draft
from minedraft.workers import verifier
from minedraft.runner.model_runner import load_causal_lm

from sampling_law import chi2_critical, chi2_stat

PROMPTS = ["The quick brown fox", "In Python, a class", "def f(x):", "The while statement", "Strings are",
           "A function definition defines", "Exceptions are raised", "The import system"]


def _kw(target: str, **kw) -> dict:
    return dict(target=target, max_prompt_tokens=64, max_tokens_limit=64, kv_cache_tokens=8192, max_batch_size=8,
                **kw)


@pytest.fixture(scope="module")
def alone(bundled_pair):
    target, _ = bundled_pair
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    return [r.token_ids for r in LocalEngine(EngineConfig(mode="autoregressive", **_kw(target)))
            .generate(PROMPTS, params)]


# -- the conversion ----------------------------------------------------------------------------------------

def test_int4_linear_is_the_grouped_dequantized_matmul():
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 64, bias=True)
    q = self_draft.Int4Linear(lin, 32)
    w = lin.weight.detach().view(64, 4, 32)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    deq = (((w - lo) / s).round() * s + lo).view(64, 128)
    x = torch.randn(5, 128)
    want = x @ deq.T + lin.bias.detach()
    got = q(x)
    assert got.dtype == x.dtype and got.shape == (5, 64)
    assert (got - want).abs().max() < 0.05 * want.abs().max()   # bf16 activations
    assert (x @ lin.weight.detach().T - want).abs().max() > 0    # and it is not the float weight


@pytest.mark.parametrize("scheme", ["int4", "bf16"])
def test_self_draft_is_smaller_and_keeps_float32_positions(bundled_pair, scheme):
    target, _ = bundled_pair
    full = load_causal_lm(target)
    fb = self_draft.weight_bytes(full)
    r = load.load_draft(f"self:{scheme}", target, 1024)
    assert r.draft_info["scheme"] == f"self:{scheme}"
    assert r.draft_info["weight_bytes"] < (0.35 if scheme == "int4" else 0.55) * fb
    assert all(b.dtype == torch.float32 for b in r.model.model.rotary_emb.buffers())
    assert any(isinstance(m, self_draft.Int4Linear) for m in r.model.modules()) == (scheme == "int4")


def test_bad_scheme_fails_in_the_config_with_one_line():
    with pytest.raises(ValueError) as e:
        EngineConfig(draft="self:int3")
    msg = str(e.value)
    assert "\n" not in msg and "draft" in msg and "self:int4" in msg and "self:bf16" in msg and "int3" in msg


def test_bad_scheme_fails_in_the_cli_before_any_worker(bundled_pair):
    target, _ = bundled_pair
    p = subprocess.run([sys.executable, "-m", "minedraft", "generate", "hi", "--target", target, "--draft",
                        "self:int3"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "self:int3" in lines[0] and "self:int4" in lines[0], p.stderr
    assert "worker" not in p.stderr.lower()


def test_self_draft_of_a_tensor_parallel_drafter_is_refused(bundled_pair):
    target, _ = bundled_pair
    with pytest.raises(ValueError, match="draft_tp=1"):
        EngineConfig(draft="self:int4", draft_tp=2, **_kw(target))


# -- greedy: exactly the target alone ------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["int4", "bf16"])
def test_local_sequential_equals_target_alone(bundled_pair, alone, scheme):
    target, _ = bundled_pair
    eng = LocalEngine(EngineConfig(draft=f"self:{scheme}", mode="sequential", k=4, **_kw(target)))
    res = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [r.token_ids for r in res] == alone
    acc = sum(r.stats.accepted_tokens for r in res) / sum(r.stats.draft_tokens for r in res)
    assert acc > 0.6, acc  # the target's own weights: most drafts are the target's tokens


CASES = [("int4", dict(mode="minedraft")), ("int4", dict(mode="sequential")), ("int4", dict(mode="autoregressive")),
         ("int4", dict(mode="minedraft", tetris=True)), ("int4", dict(mode="minedraft", adaptive_k=True)),
         ("bf16", dict(mode="minedraft")), ("bf16", dict(mode="sequential")), ("bf16", dict(mode="autoregressive")),
         ("bf16", dict(mode="sequential", tetris=True)), ("bf16", dict(mode="sequential", adaptive_k=True))]


@pytest.mark.parametrize("scheme,kw", CASES, ids=[f"{s}-{'-'.join(map(str, k.values()))}" for s, k in CASES])
async def test_engine_greedy_equals_target_alone(bundled_pair, alone, scheme, kw):
    target, _ = bundled_pair
    async with Engine(EngineConfig(draft=f"self:{scheme}", k=3, **_kw(target), **{"adaptive_k": False, **kw})) \
            as engine:
        res = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=40, ignore_eos=True))
                                     for p in PROMPTS))
        where = await engine.placement()
        stats = engine.stats()
    assert [r.token_ids for r in res] == alone
    if kw["mode"] != "autoregressive":
        d, v = where["drafter"]["model"], where["verifier"]["model"]
        assert d["scheme"] == f"self:{scheme}" and 0 < d["weight_bytes"] < 0.51 * v["weight_bytes"]
        if not kw.get("adaptive_k"):
            assert stats["accepted_tokens"] > 0.5 * stats["draft_tokens"]


# -- sampled: the target's law -------------------------------------------------------------------------------

def _first_two(tiny_pair, n=4000, batch=500, **kw):
    params = dict(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    prompt = [5, 9, 11, 40, 2]
    eng = LocalEngine(EngineConfig(mode="sequential", k=2, draft="self:int4", **_kw(tiny_pair.target, **kw)))
    counts: dict = {}
    kept = replaced = 0
    for start in range(0, n, batch):
        res = eng.generate([prompt] * batch, [SamplingParams(seed=start + i, **params) for i in range(batch)])
        for r in res:
            counts[tuple(r.token_ids[:2])] = counts.get(tuple(r.token_ids[:2]), 0) + 1
            kept += r.stats.accepted_tokens > 0
            replaced += r.stats.accepted_tokens == 0
    target = load_causal_lm(tiny_pair.target)
    sp = SamplingParams(**params)
    with torch.no_grad():
        p1 = process_logits(target(torch.tensor([prompt])).logits[0, -1:], sp)[0]
        cells, probs = [], []
        for a in p1.nonzero().flatten().tolist():
            p2 = process_logits(target(torch.tensor([prompt + [a]])).logits[0, -1:], sp)[0]
            for b in p2.nonzero().flatten().tolist():
                cells.append((a, b))
                probs.append(float(p1[a] * p2[b]))
    stat, dof = chi2_stat(torch.tensor([counts.get(c, 0) for c in cells]), torch.tensor(probs))
    if set(counts) - set(cells):  # a pair the target's top_k never allows: probability 0, chi-square infinite
        stat = float("inf")
    return stat, dof, kept / n, replaced / n


def test_sampled_law_is_the_targets(tiny_pair):
    """tiny_pair's target has random weights (peaky init), so its int4 copy is a draft far enough from it that
    rejections are common: the residual sampler's work is in the law being checked."""
    stat, dof, kept, replaced = _first_two(tiny_pair)
    assert kept > 0.2 and replaced > 0.05, (kept, replaced)
    assert stat < chi2_critical(dof), f"chi2={stat:.1f} dof={dof}"


def test_statistic_rejects_an_always_accepting_sampler(tiny_pair, monkeypatch):
    """The control: a verifier that accepts every draft emits the self-draft's law for the drafted tokens; the same
    statistic must reject it."""
    real = verifier.verify_batch

    def trusting(logits, drafts, counts, *a, **kw):
        _, toks = real(logits, drafts, counts, *a, **kw)
        return counts.tolist(), toks  # the bonus token is not the right one either; only the first two are counted
    monkeypatch.setattr(verifier, "verify_batch", trusting)
    stat, dof, kept, _ = _first_two(tiny_pair)
    assert kept > 0.99
    assert stat > 5 * chi2_critical(dof), f"a wrong sampler passed: chi2={stat:.1f} dof={dof}"


async def test_self_draft_of_a_tensor_parallel_target(bundled_pair, alone):
    """target_tp=2: the drafter (one rank) builds its draft from the whole target folder; the verifier's two ranks
    hold halves of the float32 target. Greedy output is still the target alone's."""
    target, _ = bundled_pair
    cfg = EngineConfig(draft="self:int4", k=3, mode="minedraft", target_tp=2, **_kw(target))
    async with Engine(cfg) as engine:
        res = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=40, ignore_eos=True))
                                     for p in PROMPTS))
        where = await engine.placement()
    assert [r.token_ids for r in res] == alone
    assert where["drafter"]["model"]["scheme"] == "self:int4"
