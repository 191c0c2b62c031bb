"""minedraft.sampling.reference: logit processing, greedy verification, and the losslessness of speculative sampling.

The statistical tests run `accept()` many times on fixed synthetic logits with drafts drawn from q and check
with a chi-square test that what comes out follows the (processed) target distribution p. The same statistic
is shown to reject two plausible wrong samplers, so a passing run is evidence, not luck.
"""

from __future__ import annotations


import pytest
import torch

from minedraft.sampling.reference import accept, make_generator, process_logits, sample_draft
from minedraft.sampling_params import SamplingParams
from sampling_law import (SAMPLED, TARGET_LOGITS, V, always_accept, chi2_critical, chi2_sf, chi2_stat, emitted_counts,
                          wrong_residual_accept)

def test_chi2_helpers_match_tables():
    # textbook values of the 0.999 quantile
    for dof, table in ((1, 10.828), (3, 16.266), (4, 18.467), (5, 20.515), (7, 24.322)):
        assert chi2_critical(dof) == pytest.approx(table, abs=2e-3)
    assert chi2_sf(4.351, 5) == pytest.approx(0.5, abs=1e-3)  # median of chi2(5)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("params", SAMPLED, ids=["t1", "t0.7-topk4", "t1.3-topp0.8"])
def test_speculative_output_follows_target(k, params):
    trials = 10_000
    c0, c1, p, hist = emitted_counts(accept, k, params, trials, seed=k)
    # every branch ran: rejection of the first draft, and acceptance of all k (bonus token)
    assert hist[0] > 500 and hist[k] > 50, hist.tolist()
    stat, dof = chi2_stat(c0, p[0])
    assert stat < chi2_critical(dof), f"position 0: chi2={stat:.1f} counts={c0.tolist()} p={p[0].tolist()}"
    # position 1 exists only when draft 0 was accepted; given that, it must still follow p[1] (for k=1 it is
    # the bonus token, for k=3 an accepted draft or a residual sample)
    assert c1.sum() > 500
    stat, dof = chi2_stat(c1, p[1])
    assert stat < chi2_critical(dof), f"position 1: chi2={stat:.1f} counts={c1.tolist()} p={p[1].tolist()}"


@pytest.mark.parametrize("wrong", [wrong_residual_accept, always_accept], ids=["residual=p", "always-accept"])
def test_statistic_rejects_wrong_samplers(wrong):
    params = SamplingParams(temperature=1.0)
    c0, _, p, _ = emitted_counts(wrong, 1, params, 10_000, seed=1)
    stat, dof = chi2_stat(c0, p[0])
    assert stat > 5 * chi2_critical(dof), f"a wrong sampler passed: chi2={stat:.1f}"


def test_draft_equal_to_target_is_always_accepted():
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    q = process_logits(TARGET_LOGITS[:3], params)
    for _ in range(200):
        d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(3)]
        n, _ = accept(d, q, TARGET_LOGITS, params, g)
        assert n == 3


def test_zero_target_probability_draft_is_always_rejected():
    # top_k=2 on the target: a draft outside the target's top 2 must be rejected, and the replacement must be
    # one of the target's top 2 tokens
    params = SamplingParams(temperature=1.0, top_k=2)
    g = torch.Generator().manual_seed(0)
    q = torch.full((1, V), 1.0 / V)
    top2 = set(torch.topk(TARGET_LOGITS[0], 2).indices.tolist())
    bad = next(t for t in range(V) if t not in top2)
    for _ in range(200):
        n, tok = accept([bad], q, TARGET_LOGITS[:2], params, g)
        assert n == 0 and tok in top2


# -- greedy verification --------------------------------------------------------------------------

def one_hot_logits(argmaxes: list[int], vocab: int = 50, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(argmaxes), vocab, generator=g)
    x[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return x


GREEDY = SamplingParams(temperature=0.0)


def test_greedy_accepts_matching_prefix_then_target_token():
    target = [7, 3, 9, 11]
    logits = one_hot_logits(target)
    assert accept([7, 3, 4], None, logits, GREEDY, None) == (2, 9)
    assert accept([8, 3, 9], None, logits, GREEDY, None) == (0, 7)
    assert accept([7, 5, 9], None, logits, GREEDY, None) == (1, 3)  # later matches do not count


def test_greedy_all_match_gets_bonus_token():
    target = [7, 3, 9, 11]
    assert accept([7, 3, 9], None, one_hot_logits(target), GREEDY, None) == (3, 11)


def test_greedy_no_drafts_is_plain_argmax():
    assert accept([], None, one_hot_logits([42]), GREEDY, None) == (0, 42)


def test_greedy_ignores_top_k_and_top_p():
    logits = one_hot_logits([5, 6])
    params = SamplingParams(temperature=0.0, top_k=1, top_p=0.1)
    assert accept([5], None, logits, params, None) == (1, 6)


# -- logit processing -----------------------------------------------------------------------------

def distinct_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 2


@pytest.mark.parametrize("t", [0.25, 1.0, 3.0])
def test_temperature_scales_softmax(t):
    x = distinct_logits(3, 20, 0)
    probs = process_logits(x, SamplingParams(temperature=t))
    ref = torch.exp(x.double() / t)
    ref = ref / ref.sum(-1, keepdim=True)
    torch.testing.assert_close(probs.double(), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 3, 10])
def test_top_k_keeps_exactly_the_k_best(top_k):
    x = distinct_logits(4, 30, 1)
    probs = process_logits(x, SamplingParams(temperature=0.8, top_k=top_k))
    for row, pr in zip(x, probs):
        best = set(sorted(range(30), key=lambda i: -row[i].item())[:top_k])
        assert set(pr.nonzero().flatten().tolist()) == best
        kept = torch.tensor(sorted(best))
        ref = torch.softmax(row[kept].double() / 0.8, -1)
        torch.testing.assert_close(pr[kept].double(), ref, atol=1e-6, rtol=1e-5)


def test_top_k_at_or_past_vocab_is_a_no_op():
    x = distinct_logits(2, 8, 2)
    base = process_logits(x, SamplingParams(temperature=1.0))
    for k in (8, 100):
        torch.testing.assert_close(process_logits(x, SamplingParams(temperature=1.0, top_k=k)), base)


def reference_top_p(probs: list[float], top_p: float) -> set[int]:
    """Smallest set of most likely tokens whose mass reaches top_p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return kept


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.55, 0.9, 0.99])
def test_top_p_keeps_smallest_set_reaching_mass(top_p):
    x = distinct_logits(6, 25, 3)
    full = process_logits(x, SamplingParams(temperature=1.0)).double()
    probs = process_logits(x, SamplingParams(temperature=1.0, top_p=top_p))
    for f, pr in zip(full, probs):
        cums = torch.cumsum(torch.sort(f, descending=True).values, 0)
        assert (cums - top_p).abs().min() > 1e-5, "test data too close to the boundary"
        kept = reference_top_p(f.tolist(), top_p)
        assert set(pr.nonzero().flatten().tolist()) == kept
        idx = torch.tensor(sorted(kept))
        torch.testing.assert_close(pr[idx].double(), f[idx] / f[idx].sum(), atol=1e-6, rtol=1e-5)
        # minimality: dropping the least likely kept token falls short of top_p
        assert f[idx].sum() - f[idx].min() < top_p


def test_top_p_always_keeps_the_top_token():
    x = torch.tensor([[5.0, 0.0, -1.0, -3.0]])
    probs = process_logits(x, SamplingParams(temperature=1.0, top_p=0.001))
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_top_k_then_top_p_on_renormalized_mass():
    # after top_k=3 the renormalized masses are ~[0.665, 0.245, 0.090]; top_p=0.85 keeps the first two, though
    # on the unfiltered distribution those two hold less than 0.85
    x = torch.tensor([[3.0, 2.0, 1.0, 0.9, 0.8, 0.7]])
    full = torch.softmax(x, -1)[0]
    assert full[:2].sum() < 0.85
    probs = process_logits(x, SamplingParams(temperature=1.0, top_k=3, top_p=0.85))[0]
    assert probs.nonzero().flatten().tolist() == [0, 1]
    torch.testing.assert_close(probs[:2], full[:2] / full[:2].sum())


def test_process_logits_rows_are_independent():
    x = distinct_logits(5, 12, 4)
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.7)
    batched = process_logits(x, params)
    for i in range(5):
        torch.testing.assert_close(batched[i], process_logits(x[i], params))
    torch.testing.assert_close(batched.sum(-1), torch.ones(5))


@pytest.mark.parametrize("t", [1e-38, 1e-300])
def test_tiny_positive_temperature_gives_a_distribution(t):
    x = torch.tensor([10.0, 3.0, 1.0, -5.0])
    probs = process_logits(x, SamplingParams(temperature=t))
    assert torch.isfinite(probs).all()
    assert probs.argmax().item() == 0 and probs.sum().item() == pytest.approx(1.0)


# -- draft sampling and generators ----------------------------------------------------------------

def test_sample_draft_greedy_and_sampled():
    x = distinct_logits(1, 40, 5)[0]
    tok, q = sample_draft(x, GREEDY, None)
    assert tok == int(x.argmax()) and q is None
    params = SamplingParams(temperature=1.0, top_k=3)
    allowed = set(torch.topk(x, 3).indices.tolist())
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(100):
        tok, q = sample_draft(x, params, g)
        torch.testing.assert_close(q, process_logits(x, params))
        assert tok in allowed
        seen.add(tok)
    assert len(seen) > 1


def test_make_generator_streams():
    a = torch.rand(5, generator=make_generator(7, 0))
    assert torch.equal(a, torch.rand(5, generator=make_generator(7, 0)))
    assert not torch.equal(a, torch.rand(5, generator=make_generator(7, 1)))
    assert not torch.equal(a, torch.rand(5, generator=make_generator(8, 0)))
    torch.rand(5, generator=make_generator(2**63 - 1, 1))  # the largest valid seed does not overflow
