"""Reduced-vocabulary drafts (draft_vocab.json): the draft's head covers a subset of the target's vocabulary.

The runner maps input ids into the draft's vocabulary (tokens outside it share one 'other' row) and its logits back
to the target's, -inf outside the subset, so q is exactly zero there. Speculative decoding stays lossless: greedy
output equals the target alone, and the sampled law is the target's (chi-square, with a wrong sampler rejected).
"""

from __future__ import annotations

import json

import pytest
import torch

from minedraft.config import EngineConfig
from minedraft.engine.local_engine import LocalEngine
from minedraft.sampling.reference import accept, process_logits
from minedraft.sampling_params import SamplingParams
from minedraft.runner.model_runner import ModelRunner

from sampling_law import chi2_critical, chi2_stat, wrong_residual_accept

KEEP = 220  # of the tiny pair's 300 tokens


@pytest.fixture(scope="module")
def subset_draft(tiny_pair, tmp_path_factory):
    """The tiny pair's draft cut to KEEP tokens (eos included) plus one 'other' row."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    full = AutoModelForCausalLM.from_pretrained(tiny_pair.draft, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    ids = sorted({tiny_pair.eos_token_id, *torch.randperm(tiny_pair.vocab_size, generator=g)[:KEEP - 1].tolist()})
    cfg = full.config.to_dict()
    cfg["vocab_size"] = len(ids) + 1
    from transformers import LlamaConfig, LlamaForCausalLM
    small = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",)})).eval()
    sd = full.state_dict()
    idx = torch.tensor(ids)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = sd[name]
        sd[name] = torch.cat([w[idx], w.mean(0, keepdim=True)])
    small.load_state_dict(sd)
    d = tmp_path_factory.mktemp("subset_draft")
    small.save_pretrained(d)
    AutoTokenizer.from_pretrained(tiny_pair.draft).save_pretrained(d)
    (d / "draft_vocab.json").write_text(json.dumps({"target_vocab_size": tiny_pair.vocab_size, "token_ids": ids}))
    return str(d), ids, full


def test_runner_maps_logits_into_the_target_vocabulary(subset_draft, tiny_pair):
    path, ids, full = subset_draft
    r = ModelRunner.from_pretrained(path, 1024)
    assert r.vocab_size == tiny_pair.vocab_size
    prompt = ids[3:40]                         # only tokens the draft knows: logits must be the full draft's
    r.cache.allocate(0, 64)
    got = r.forward([0], [prompt], 1)[0, 0]
    with torch.no_grad():
        want = full(torch.tensor([prompt])).logits[0, -1]
    inside = torch.zeros(tiny_pair.vocab_size, dtype=torch.bool)
    inside[ids] = True
    assert torch.isneginf(got[~inside]).all()
    torch.testing.assert_close(got[inside], want[inside], atol=1e-4, rtol=1e-4)
    # a token outside the subset is read as the 'other' row, not rejected
    outside = next(t for t in range(tiny_pair.vocab_size) if t not in set(ids))
    assert torch.isfinite(r.forward([0], [[outside]], 1)[0, 0, inside]).all()


def test_mismatched_vocab_file_is_refused(subset_draft, tmp_path):
    import shutil
    path, ids, _ = subset_draft
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    (bad / "draft_vocab.json").write_text(json.dumps({"target_vocab_size": 300, "token_ids": ids[:-3]}))
    with pytest.raises(ValueError, match="draft_vocab.json"):
        ModelRunner.from_pretrained(str(bad), 1024)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_subset_draft_equals_target_alone(subset_draft, tiny_pair, k):
    path, _, _ = subset_draft
    kw = dict(target=tiny_pair.target, max_prompt_tokens=64, max_tokens_limit=48, kv_cache_tokens=4096)
    prompts = ["The quick brown fox", "In Python, a class", list(range(1, 30)), "def f(x):"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = LocalEngine(EngineConfig(mode="autoregressive", **kw)).generate(prompts, params)
    spec = LocalEngine(EngineConfig(mode="sequential", k=k, draft=path, **kw)).generate(prompts, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in alone]
    acc = sum(r.stats.accepted_tokens for r in spec) / sum(r.stats.draft_tokens for r in spec)
    assert 0 < acc < 1


def _subset_counts(accept_fn, params, trials=10_000, k=2):
    """Emitted first tokens when the draft's q is zero outside a subset (its logits are -inf there)."""
    target = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.5, 0.0, 2.5, 0.3, 0.1, -0.5],
                           [0.0, 0.0, 0.0, 1.5, -1.0, 1.0]])
    draft = torch.tensor([[0.0, 1.0, 1.5, 0.5, 1.0, 2.0], [1.0, 1.5, 0.5, 0.0, 0.5, 1.0]])
    draft[:, [0, 5]] = float("-inf")          # tokens 0 and 5 lie outside the draft's vocabulary
    q = process_logits(draft, params)
    assert (q[:, [0, 5]] == 0).all()
    g = torch.Generator().manual_seed(11)
    drafts = torch.multinomial(q, trials, replacement=True, generator=g).T.tolist()
    counts = torch.zeros(6, dtype=torch.long)
    for d in drafts:
        n, tok = accept_fn(d, q, target[: k + 1], params, g)
        counts[(d[:n] + [tok])[0]] += 1
    return counts, process_logits(target, params)[0]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9)])
def test_sampled_law_is_the_targets_with_a_subset_draft(params):
    counts, p = _subset_counts(accept, params)
    stat, dof = chi2_stat(counts, p)
    assert stat < chi2_critical(dof), f"chi2={stat:.1f} counts={counts.tolist()} p={p.tolist()}"
    assert counts[0] > 0 and counts[5] > 0    # tokens the draft can never propose still come out


def test_statistic_rejects_a_wrong_sampler_with_a_subset_draft():
    counts, p = _subset_counts(wrong_residual_accept, SamplingParams(temperature=1.0))
    stat, dof = chi2_stat(counts, p)
    assert stat > 5 * chi2_critical(dof)
