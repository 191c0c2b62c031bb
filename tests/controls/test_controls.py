"""controls/logits.py: penalties, logit bias and a grammar mask applied per position under speculation.

The processing is checked against a plain reference written here from the definitions; drafts leave no trace
(push/pop, matcher rollback); and the law of speculative sampling with a history-dependent control is the law of
the target alone under the same control, by the chi-square of test_sampling. The same statistic rejects a verifier
that scores every position with the step's starting history instead of advancing through the drafts.
"""

from __future__ import annotations

import math

import pytest
import torch

from minedraft.sampling_params import SamplingParams
from minedraft.controls import logits as controls
from minedraft.sampling.batch_sampling import RowParams, process_batch, sample_draft_step, verify_batch
from minedraft.controls.logits import RowControl, process_positions, process_rows
from sampling_law import DRAFT_LOGITS, TARGET_LOGITS, V, chi2_critical

PROMPT = [4, 1]


def reference_logits(x: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams, allowed=None):
    """The definition, token by token: repetition on prompt + output, frequency/presence on output, bias, mask."""
    y = x.clone().float()
    for t in range(y.shape[0]):
        if p.repetition_penalty != 1.0 and t in prompt + out:
            y[t] = y[t] / p.repetition_penalty if y[t] > 0 else y[t] * p.repetition_penalty
        c = out.count(t)
        y[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    for t, b in p.logit_bias:
        y[t] += b
    if allowed is not None:
        y[~allowed] = float("-inf")
    return y


class ToyMatcher:
    """A grammar over 6 tokens: never the same token twice in a row, token 3 never first, token 5 only after 0."""

    def __init__(self):
        self.hist: list[int] = []

    def allowed(self) -> torch.Tensor:
        return toy_allowed(self.hist)

    def consume(self, t: int) -> bool:
        if not bool(self.allowed()[t]):
            return False
        self.hist.append(t)
        return True

    def rollback(self, n: int) -> None:
        del self.hist[len(self.hist) - n:]


def toy_allowed(hist: list[int]) -> torch.Tensor:
    a = torch.ones(V, dtype=torch.bool)
    if not hist:
        a[3] = False
    else:
        a[hist[-1]] = False
    if not hist or hist[-1] != 0:
        a[5] = False
    return a


PENALISED = SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=1.5, presence_penalty=0.5,
                           logit_bias={2: 1.0, 5: -0.5})


def test_apply_matches_the_definition_and_push_pop_leave_no_trace():
    g = torch.Generator().manual_seed(0)
    c = RowControl(PENALISED, PROMPT, V, ToyMatcher())
    out = []
    for step in range(6):
        x = torch.randn(V, generator=g) * 3
        want = reference_logits(x, PROMPT, out, PENALISED, toy_allowed(out))
        assert torch.equal(torch.isinf(c.apply(x)), torch.isinf(want))
        torch.testing.assert_close(c.apply(x), want)
        drafts = [int(t) for t in torch.randint(0, V, (3,), generator=g)]
        before = (c.out.clone(), c.seen.clone(), list(c.matcher.hist))
        c.push(drafts)
        c.pop(drafts)
        assert torch.equal(c.out, before[0]) and torch.equal(c.seen, before[1]) and c.matcher.hist == before[2]
        tok = int(torch.nonzero(toy_allowed(out))[step % int(toy_allowed(out).sum())])
        c.push([tok])
        out.append(tok)


def test_a_refused_draft_is_not_fed_and_unwinds():
    c = RowControl(SamplingParams(regex=None), [], V, ToyMatcher())
    c.push([1, 1, 2])  # the second 1 is refused: 2 is not fed either (the matcher's state is not that history)
    assert c.matcher.hist == [1] and c._refused == 2
    c.pop([1, 1, 2])
    assert c.matcher.hist == [] and c._refused == 0


def test_process_positions_scores_each_position_after_the_drafts_before_it():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, V, generator=g)
    ctls = [RowControl(PENALISED, PROMPT, V, ToyMatcher()), None]
    drafts = [[0, 5, 2], [1]]
    got = process_positions(logits, ctls, drafts)
    for j in range(4):
        want = reference_logits(logits[0, j], PROMPT, drafts[0][:j], PENALISED, toy_allowed(drafts[0][:j]))
        torch.testing.assert_close(got[0, j], want)
    assert torch.equal(got[1], logits[1])
    assert ctls[0].matcher.hist == [] and not ctls[0].out.any()  # back where it was


def test_rows_without_controls_are_not_copied():
    x = torch.randn(3, V)
    assert process_rows(x, [None, None, None]) is x


# -- the law -----------------------------------------------------------------------------------------------------
def control_trial(params: SamplingParams, make_matcher, trials: int, k: int = 2, seed0: int = 0):
    """`trials` rows through controlled drafting (k positions) and verification with the fixed logits of
    test_sampling. Returns (out0 [trials], n [trials], drafts [trials, k], tok [trials])."""
    seeds = [seed0 + i for i in range(trials)]
    plist = [params] * trials
    rp = RowParams.of(plist, seeds)
    ctls = [RowControl(params, PROMPT, V, make_matcher()) for _ in range(trials)]
    pos0 = torch.full((trials,), 7, dtype=torch.long)
    draw = torch.zeros(trials, dtype=torch.long)
    toks, qs = [], []
    for i in range(k):
        logits = process_rows(DRAFT_LOGITS[i].expand(trials, V), ctls)
        t, q, _ = sample_draft_step(logits, rp, pos0 + i, draw)
        toks.append(t)
        qs.append(q)
        for c, x in zip(ctls, t.tolist()):
            c.push([x])
    drafts = torch.stack(toks, 1)
    dl = drafts.tolist()
    for c, row in zip(ctls, dl):
        c.pop(row)
    logits = controls.process_positions(TARGET_LOGITS[:k + 1].expand(trials, -1, -1), ctls, dl)
    q = torch.stack(qs, 1) if qs[0] is not None else None
    n, tok = verify_batch(logits, drafts, torch.full((trials,), k), q, rp, pos0)
    n, tok = torch.tensor(n), torch.tensor(tok)
    out0 = torch.where(n > 0, drafts[:, 0], tok)
    return out0, n, drafts, tok


def law(params, hist, allowed_fn, j):
    allowed = allowed_fn(hist) if allowed_fn else None
    x = reference_logits(TARGET_LOGITS[j], PROMPT, hist, params, allowed)
    return process_batch(x[None, None], RowParams.of([params], [0]))[0, 0]


def stat_or_inf(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic; inf when a token of probability 0 occurred."""
    counts, probs = counts.double(), probs.double()
    zero = probs <= 0
    if counts[zero].sum() > 0:
        return math.inf, 1
    exp = counts.sum() * probs[~zero]
    return float(((counts[~zero] - exp) ** 2 / exp).sum()), int((~zero).sum()) - 1


def joint_statistic(params, allowed_fn, out0, n, drafts, tok):
    """Chi-square of position 0 against p0, plus, for each first token a, of position 1 (rows that accepted their
    first draft a) against p1 given a: the law at position 1 depends on a through the control."""
    total, dof = stat_or_inf(torch.bincount(out0, minlength=V), law(params, [], allowed_fn, 0))
    for a in range(V):
        rows = (n > 0) & (drafts[:, 0] == a)
        if rows.sum() < 200:
            continue
        out1 = torch.where(n[rows] > 1, drafts[rows, 1], tok[rows])
        s, d = stat_or_inf(torch.bincount(out1, minlength=V), law(params, [a], allowed_fn, 1))
        total, dof = total + s, dof + d
    return total, dof


CASES = {"penalties": (PENALISED, lambda: None, None),
         "penalties-seeded": (SamplingParams(temperature=1.0, frequency_penalty=2.0, presence_penalty=1.0, seed=5),
                              lambda: None, None),
         "grammar": (SamplingParams(temperature=1.0), ToyMatcher, toy_allowed),
         "grammar-penalties": (PENALISED, ToyMatcher, toy_allowed)}


@pytest.mark.parametrize("case", list(CASES))
def test_controlled_speculation_follows_the_controlled_target(case):
    params, make, allowed_fn = CASES[case]
    out0, n, drafts, tok = control_trial(params, make, 12_000, seed0=hash(case) % 1000)
    assert (n == 0).sum() > 300 and (n == 2).sum() > 300, torch.bincount(n).tolist()
    stat, dof = joint_statistic(params, allowed_fn, out0, n, drafts, tok)
    assert dof > 10 and stat < chi2_critical(dof), (stat, dof)


def _stale_positions(logits, ctls, drafts):
    """A plausible bug: every position scored with the step's starting history (the drafts not pushed)."""
    out = logits.float().clone()
    for b, c in enumerate(ctls):
        if c is not None:
            for j in range(len(drafts[b]) + 1):
                out[b, j] = c.apply(out[b, j])
    return out


@pytest.mark.parametrize("case", ["penalties", "grammar"])
def test_statistic_rejects_a_verifier_that_does_not_advance_through_drafts(case, monkeypatch):
    params, make, allowed_fn = CASES[case]
    monkeypatch.setattr(controls, "process_positions", _stale_positions)
    out0, n, drafts, tok = control_trial(params, make, 12_000)
    stat, dof = joint_statistic(params, allowed_fn, out0, n, drafts, tok)
    assert stat > 5 * chi2_critical(dof), (stat, dof)


def test_greedy_rows_take_the_argmax_of_the_controlled_law():
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0, logit_bias={0: -100})
    out0, n, drafts, tok = control_trial(params, ToyMatcher, 4)
    for b in range(4):
        seq = drafts[b, :n[b]].tolist() + [int(tok[b])]
        for j, t in enumerate(seq):
            assert t == int(reference_logits(TARGET_LOGITS[j], PROMPT, seq[:j], params, toy_allowed(seq[:j])).argmax())
