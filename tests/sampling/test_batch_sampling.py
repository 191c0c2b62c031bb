"""minedraft.sampling.batch_sampling and minedraft.sampling.rng: the batched sampler against the per-row reference
(minedraft.sampling.reference), in value (greedy, logit processing) and in law (chi-square, as in test_sampling)."""

from __future__ import annotations

import pytest
import torch

from minedraft.sampling import rng
from minedraft.sampling.batch_sampling import RowParams, categorical, process_batch, sample_draft_step, verify_batch
from minedraft.sampling.reference import accept, process_logits
from minedraft.sampling_params import SamplingParams
from sampling_law import DRAFT_LOGITS, SAMPLED, TARGET_LOGITS, V, chi2_critical, chi2_stat

GREEDY = SamplingParams(temperature=0.0)


# -- counter-based random numbers ----------------------------------------------------------------

def splitmix64_finalizer(x: int) -> int:
    """The published SplitMix64 output function on Python ints (uint64)."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_mix_is_splitmix64_bit_for_bit():
    xs = [0, 1, 2, 12345, 2**62 + 7, 2**63 - 1, -1, -(2**63), -987654321]
    got = rng.mix(torch.tensor(xs, dtype=torch.long)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [splitmix64_finalizer(x & ((1 << 64) - 1)) for x in xs]


def test_uniforms_are_uniform_and_keyed_by_every_counter():
    seeds = torch.arange(200).repeat_interleave(500)
    pos = torch.arange(500).repeat(200)
    u = rng.uniform(seeds, rng.ACCEPT, pos)
    assert bool(((u > 0) & (u < 1)).all())
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    stat, dof = chi2_stat(counts.long(), torch.full((20,), 1 / 20))
    assert stat < chi2_critical(dof)
    base = rng.uniform(torch.tensor([5]), rng.DRAFT, torch.tensor([9]), 0)
    for other in (rng.uniform(torch.tensor([6]), rng.DRAFT, torch.tensor([9]), 0),
                  rng.uniform(torch.tensor([5]), rng.ACCEPT, torch.tensor([9]), 0),
                  rng.uniform(torch.tensor([5]), rng.DRAFT, torch.tensor([10]), 0),
                  rng.uniform(torch.tensor([5]), rng.DRAFT, torch.tensor([9]), 1)):
        assert not torch.equal(base, other)
    assert torch.equal(base, rng.uniform(torch.tensor([5]), rng.DRAFT, torch.tensor([9]), 0))
    # neighbouring counters are not correlated (a weak hash would make u(seed, pos) ~ u(seed, pos + 1))
    u2 = rng.uniform(torch.zeros(20000, dtype=torch.long), rng.TARGET, torch.arange(20000))
    assert abs(float(torch.corrcoef(torch.stack([u2[:-1], u2[1:]]))[0, 1])) < 0.03


# -- logit processing and categorical sampling ---------------------------------------------------

MIXED = [GREEDY, SamplingParams(temperature=0.7, top_k=4), SamplingParams(temperature=1.3, top_p=0.8),
         SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, top_k=5, top_p=0.7),
         SamplingParams(temperature=1.0, top_k=100), SamplingParams(temperature=1e-30),
         SamplingParams(temperature=0.5, seed=3)]


def test_process_batch_equals_per_row_process_logits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(MIXED), 3, 40, generator=g) * 2
    rp = RowParams.of(MIXED, list(range(len(MIXED))))
    got = process_batch(x, rp)
    for b, params in enumerate(MIXED):
        torch.testing.assert_close(got[b], process_logits(x[b], params), atol=1e-6, rtol=1e-5)


def test_categorical_follows_probs_and_never_picks_zero_mass():
    p = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    n = 30000
    u = rng.uniform(torch.arange(n), rng.TARGET, torch.zeros(n, dtype=torch.long))
    tok = categorical(p.expand(n, -1), u)
    stat, dof = chi2_stat(torch.bincount(tok, minlength=6), p)
    assert stat < chi2_critical(dof)
    edge = categorical(p.expand(3, -1), torch.tensor([1 - 2**-53, 0.0, 0.5], dtype=torch.float64))
    assert edge.tolist() == [4, 1, 3]  # token 1 holds [0, 0.5), token 3 [0.5, 0.7)


# -- greedy: the batched verdict is the per-row one, token for token ------------------------------

def test_verify_batch_greedy_equals_accept_with_ragged_counts():
    g = torch.Generator().manual_seed(1)
    B, K, Vb = 12, 5, 30
    logits = torch.randn(B, K + 1, Vb, generator=g)
    target = logits.argmax(-1)
    drafts = target[:, :K].clone()
    # break each row's drafts at a different place (or not at all)
    for b in range(B):
        cut = b % (K + 1)
        if cut < K:
            drafts[b, cut] = (drafts[b, cut] + 1) % Vb
    counts = torch.tensor([b % (K + 1) if b % 3 else K for b in range(B)])
    rp = RowParams.of([GREEDY] * B, [0] * B)
    n, tok = verify_batch(logits, drafts, counts, None, rp, torch.zeros(B, dtype=torch.long))
    for b in range(B):
        c = int(counts[b])
        assert (n[b], tok[b]) == accept(drafts[b, :c].tolist(), None, logits[b, :c + 1], GREEDY, None)
    assert len(set(n)) > 2


# -- sampled: the batched sampler's output law is the target's ------------------------------------

def batched_trial(params: SamplingParams, k: int, trials: int, seed0: int = 0):
    """`trials` independent rows (distinct seeds) through sample_draft_step and verify_batch with the fixed
    logits of test_sampling. Returns (counts at output position 0, at position 1, p, histogram of n)."""
    plist = [params] * trials
    seeds = [seed0 + i for i in range(trials)]
    rp = RowParams.of(plist, seeds)
    pos0 = torch.full((trials,), 7, dtype=torch.long)
    draw = torch.zeros(trials, dtype=torch.long)
    toks, qs = [], []
    for i in range(k):
        t, q, _ = sample_draft_step(DRAFT_LOGITS[i].expand(trials, V), rp, pos0 + i, draw)
        toks.append(t)
        qs.append(q)
    drafts = torch.stack(toks, 1)
    q = torch.stack(qs, 1)
    logits = TARGET_LOGITS[:k + 1].expand(trials, -1, -1)
    n, tok = verify_batch(logits, drafts, torch.full((trials,), k), q, rp, pos0)
    n, tok = torch.tensor(n), torch.tensor(tok)
    out0 = torch.where(n > 0, drafts[:, 0], tok)
    out1 = torch.where(n > 1, drafts[:, min(1, k - 1)], tok)[n > 0]
    p = process_logits(TARGET_LOGITS[:k + 1], params)
    return torch.bincount(out0, minlength=V), torch.bincount(out1, minlength=V), p, torch.bincount(n, minlength=k + 1)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("params", SAMPLED + [SamplingParams(temperature=1.0, seed=1)],
                         ids=["t1", "t0.7-topk4", "t1.3-topp0.8", "t1-seeded"])
def test_batched_output_follows_target(k, params):
    c0, c1, p, hist = batched_trial(params, k, 20_000, seed0=100 * k)
    assert hist[0] > 500 and hist[k] > 50, hist.tolist()
    for counts, probs in ((c0, p[0]), (c1, p[1])):
        stat, dof = chi2_stat(counts, probs)
        assert stat < chi2_critical(dof), f"chi2={stat:.1f} counts={counts.tolist()} p={probs.tolist()}"


def test_statistic_rejects_shared_draft_and_accept_numbers(monkeypatch):
    """A plausible bug: the drafter and the verifier draw from the same stream, so the acceptance test
    reuses the number that chose the draft. The same chi-square must catch it."""
    monkeypatch.setattr(rng, "ACCEPT", rng.DRAFT)
    c0, _, p, _ = batched_trial(SamplingParams(temperature=1.0), 1, 20_000)
    stat, dof = chi2_stat(c0, p[0])
    assert stat > 5 * chi2_critical(dof), stat


def test_rejection_rows_accept_more_than_coupled_rows():
    """Unseeded rows keep rejection sampling's acceptance (the maximal coupling); seeded rows pay for
    their batch-invariance with a lower one. Both are exact (test above); this pins which path is which."""
    _, _, _, plain = batched_trial(SamplingParams(temperature=1.0), 1, 20_000)
    _, _, _, coupled = batched_trial(SamplingParams(temperature=1.0, seed=5), 1, 20_000)
    assert plain[1] > coupled[1] * 1.05, (plain.tolist(), coupled.tolist())


# -- seeds: a row's verdict does not depend on its neighbours --------------------------------------

def test_row_verdict_does_not_depend_on_the_rest_of_the_batch():
    K = 3
    mine = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, seed=9), GREEDY]
    for params in mine:
        alone_in = None
        for companions in (0, 5, 17):
            B = 1 + companions
            plist = [params] + [SamplingParams(temperature=1.0 + 0.1 * (i % 3)) for i in range(companions)]
            rp = RowParams.of(plist, [42] + list(range(companions)))
            torch.manual_seed(companions)  # everything but row 0 changes between runs
            logits = torch.randn(B, K + 1, V)
            logits[0] = TARGET_LOGITS
            draft_logits = torch.randn(B, K, V)
            draft_logits[0] = DRAFT_LOGITS
            pos = torch.tensor([11] + [3] * companions)
            toks, qs = [], []
            for i in range(K):
                t, q, _ = sample_draft_step(draft_logits[:, i], rp, pos + i, torch.zeros(B, dtype=torch.long))
                toks.append(t)
                qs.append(q)
            counts = torch.tensor([K] + [i % (K + 1) for i in range(companions)])
            q = torch.stack(qs, 1) if qs[0] is not None else None
            n, tok = verify_batch(logits, torch.stack(toks, 1), counts, q, rp, pos)
            mine_out = (torch.stack(toks, 1)[0].tolist(), n[0], tok[0])
            alone_in = alone_in or mine_out
            assert mine_out == alone_in, params


def test_coupled_row_output_does_not_depend_on_its_draft_count():
    """A seeded row's next token is argmax(log p + G(seed, position)) whether it had 0 or 3 drafts."""
    params = SamplingParams(temperature=1.0, seed=0)
    firsts = {c: [] for c in (0, 1, 3)}
    for seed in range(300):
        rp = RowParams.of([params], [seed])
        pos = torch.tensor([4])
        toks, qs = [], []
        for i in range(3):
            t, q, _ = sample_draft_step(DRAFT_LOGITS[i][None], rp, pos + i, torch.zeros(1, dtype=torch.long))
            toks.append(t)
            qs.append(q)
        for c in firsts:
            n, tok = verify_batch(TARGET_LOGITS[None], torch.stack(toks, 1), torch.tensor([c]),
                                  torch.stack(qs, 1), rp, pos)
            out = torch.stack(toks, 1)[0, :n[0]].tolist() + [tok[0]]
            firsts[c].append(out[0])
    assert firsts[0] == firsts[1] == firsts[3]


# -- fuzz: ragged batches of every row kind, extreme logits --------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(V=st.integers(2, 30), K=st.integers(0, 4), B=st.integers(1, 6), seed=st.integers(0, 2**31),
       scale=st.sampled_from([0.01, 1.0, 30.0]), kinds=st.lists(st.integers(0, 3), min_size=6, max_size=6))
def test_verify_batch_tokens_are_possible_and_greedy_rows_exact(V, K, B, seed, scale, kinds):
    g = torch.Generator().manual_seed(seed)
    menu = [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=3, top_p=0.6),
            SamplingParams(temperature=2.0, seed=seed)]
    plist = [menu[kinds[b]] for b in range(B)]
    rp = RowParams.of(plist, [seed + b for b in range(B)])
    logits = torch.randn(B, K + 1, V, generator=g) * scale
    pos = torch.randint(0, 500, (B,), generator=g)
    toks, qs = [], []
    for i in range(K):
        t, q, conf = sample_draft_step(torch.randn(B, V, generator=g) * scale, rp, pos + i,
                                       torch.zeros(B, dtype=torch.long))
        assert bool((conf <= 1e-6).all())
        toks.append(t)
        qs.append(q)
    drafts = torch.stack(toks, 1) if K else torch.zeros(B, 0, dtype=torch.long)
    q = torch.stack(qs, 1) if K and qs[0] is not None else None
    counts = torch.randint(0, K + 1, (B,), generator=g)
    n, tok = verify_batch(logits, drafts, counts, q, rp, pos)
    # the runner's packed form (distinct rows in any order, an index into them; places past a row's count
    # may read any row, here its last valid one) gives the same verdicts
    perm = torch.randperm(B * (K + 1), generator=g)
    index = perm.argsort().view(B, K + 1)
    index = index.gather(1, torch.minimum(torch.arange(K + 1)[None, :], counts[:, None]))
    assert verify_batch(logits.reshape(-1, V)[perm], drafts, counts, q, rp, pos, index) == (n, tok)
    p = process_batch(logits, rp)
    for b in range(B):
        c = int(counts[b])
        assert 0 <= n[b] <= c and 0 <= tok[b] < V
        assert p[b, n[b], tok[b]] > 0
        assert all(p[b, i, drafts[b, i]] > 0 for i in range(n[b]))
        if plist[b].greedy:
            assert (n[b], tok[b]) == accept(drafts[b, :c].tolist(), None, logits[b, :c + 1], GREEDY, None)
