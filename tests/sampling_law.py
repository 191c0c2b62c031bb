"""The statistics the sampled-law tests share: chi-square helpers, the small target/draft laws, and samplers
that are deliberately wrong (the controls every law test must reject). Imported by tests in several folders."""

from __future__ import annotations

import math

import torch

from minedraft.sampling.reference import process_logits
from minedraft.sampling_params import SamplingParams

ALPHA = 1e-3


# -- chi-square, without scipy ----------------------------------------------------------------------

def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi2(dof): 1 - regularized lower gamma P(dof/2, x/2) by its power series."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= z / (a + n)
        total += term
    lower = math.exp(a * math.log(z) - z - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def chi2_critical(dof: int, alpha: float = ALPHA) -> float:
    """x with chi2_sf(x, dof) == alpha, by bisection."""
    lo, hi = 0.0, 10.0 * dof + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, dof) > alpha else (lo, mid)
    return (lo + hi) / 2


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of counts against probs; tokens with probability 0 must never occur."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    zero = probs <= 0
    assert counts[zero].sum() == 0, f"tokens with target probability 0 were emitted: {counts.tolist()}"
    exp = n * probs[~zero]
    stat = float(((counts[~zero] - exp) ** 2 / exp).sum())
    return stat, int((~zero).sum()) - 1


# -- a sampler harness -----------------------------------------------------------------------------

V = 6
TARGET_LOGITS = torch.tensor([
    [2.0, 1.0, 0.5, 0.0, -1.0, -2.0],
    [-1.0, 0.0, 2.5, 0.3, 0.1, -0.5],
    [0.0, 0.0, 0.0, 1.5, -1.0, 1.0],
    [1.0, -2.0, 0.5, 0.5, 2.0, 0.0],
])
# a draft far from the target (total variation 0.4-0.85 from p, depending on the processing), with enough
# overlap that all k drafts are sometimes accepted
DRAFT_LOGITS = torch.tensor([
    [0.0, 1.0, 1.5, 0.5, 1.0, 2.0],
    [1.0, 1.5, 0.5, 0.0, 0.5, 1.0],
    [1.0, 1.0, 0.5, -0.5, 0.5, 1.0],
])


def emitted_counts(accept_fn, k: int, params: SamplingParams, trials: int, seed: int = 0):
    """Run accept_fn `trials` times; count the token emitted at output position 0, and at position 1 when
    there is one (the first draft was accepted). Returns (counts0, counts1, p, histogram of accepted counts)."""
    g = torch.Generator().manual_seed(seed)
    target = TARGET_LOGITS[: k + 1]
    q = process_logits(DRAFT_LOGITS[:k], params)
    drafts = torch.multinomial(q, trials, replacement=True, generator=g).T.tolist()  # [trials, k]
    c0, c1 = torch.zeros(V, dtype=torch.long), torch.zeros(V, dtype=torch.long)
    hist = torch.zeros(k + 1, dtype=torch.long)
    for d in drafts:
        n, tok = accept_fn(d, q, target, params, g)
        assert 0 <= n <= k
        out = d[:n] + [tok]
        c0[out[0]] += 1
        if len(out) > 1:
            c1[out[1]] += 1
        hist[n] += 1
    return c0, c1, process_logits(target, params), hist


def wrong_residual_accept(draft_tokens, q, target_logits, params, gen):
    """A classic mistake: on rejection, resample from p instead of norm(max(0, p - q))."""
    k = len(draft_tokens)
    p = process_logits(target_logits, params)
    for i, x in enumerate(draft_tokens):
        if torch.rand(1, generator=gen).item() >= float(p[i, x] / q[i, x]):
            return i, int(torch.multinomial(p[i], 1, generator=gen))
    return k, int(torch.multinomial(p[k], 1, generator=gen))


def always_accept(draft_tokens, q, target_logits, params, gen):
    """Another mistake: trust the draft (the output then follows q)."""
    p = process_logits(target_logits, params)
    return len(draft_tokens), int(torch.multinomial(p[len(draft_tokens)], 1, generator=gen))


SAMPLED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
]
