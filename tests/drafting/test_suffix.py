"""The suffix index (minedraft/drafting/suffix_index.py) against a brute-force oracle, its knobs, and its memory bound."""

import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minedraft.drafting.suffix_index import SuffixConfig, SuffixIndex


def oracle(texts, ctx, cfg, budget, own_end=None):  # noqa: C901
    """Brute force: every position of every text, the longest match of ctx's suffix ending there, then the most
    frequent continuation among the positions of that longest match (ties to the most recent)."""
    occ = []  # (text index, end position), most recent last
    for ti, t in enumerate(texts):
        last = len(t) if own_end is None else own_end
        for p in range(1, last):
            L = 0
            while L < min(cfg.max_depth, p, len(ctx)) and t[p - 1 - L] == ctx[-1 - L]:
                L += 1
            if L:
                occ.append((L, ti, p))
    if not occ:
        return [], 0
    best = max(L for L, _, _ in occ)
    alive = [(ti, p) for L, ti, p in reversed(occ) if L == best]
    limit = min(budget, int(cfg.spec_factor * best + cfg.spec_offset))
    out, cum = [], 1.0
    for t in range(limit):
        counts = {}
        for ti, p in alive:
            if p + t < len(texts[ti]):
                x = texts[ti][p + t]
                counts[x] = counts.get(x, 0) + 1
        if not counts:
            break
        tok = max(counts, key=counts.__getitem__)
        m = best + t
        pr = cum * counts[tok] / sum(counts.values()) * m / (m + cfg.match_prior)
        if pr < cfg.min_prob:
            break
        out.append(tok)
        cum = pr
        alive = [(ti, p) for ti, p in alive if p + t < len(texts[ti]) and texts[ti][p + t] == tok]
    return out, best


BIG = dict(max_candidates=10**9)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 8),
       st.sampled_from([0.0, 0.1, 0.4]), st.sampled_from([1.0, 2.0]), st.integers(1, 12), st.sampled_from([0, 1.5]))
def test_own_text_matches_oracle(text, budget, min_prob, factor, depth, prior):
    cfg = SuffixConfig(max_depth=depth, min_prob=min_prob, spec_factor=factor, global_tokens=0, match_prior=prior,
                       **BIG)
    ix = SuffixIndex(cfg)
    ix.add(7, text[:len(text) // 2])
    ix.extend(7, text[len(text) // 2:])  # built in two parts, as prompt then verdicts
    want, L = oracle([text], text, cfg, budget, own_end=len(text))
    got = ix.propose([7], budget)[0]
    assert got.tokens == want
    if want:
        assert got.match_len == L and got.source == "self"
        assert all(0 < p <= 1 for p in got.probs) and got.probs == sorted(got.probs, reverse=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=25), min_size=1, max_size=5),
       st.lists(st.integers(0, 3), min_size=1, max_size=10), st.integers(1, 6))
def test_global_matches_oracle(outputs, ctx, budget):
    cfg = SuffixConfig(max_depth=6, min_prob=0.0, spec_factor=2.0, **BIG)
    ix = SuffixIndex(cfg)
    for i, out in enumerate(outputs):
        ix.add(i, [9, 9, 9])  # prompts stay out of the global index by default
        ix.extend(i, out)
        ix.remove(i)
    want, _ = oracle(outputs, ctx, cfg, budget)
    g = ix.glob
    L, cands = g.longest(ctx, cfg)
    got, _ = g.walk(cands, min(budget, int(cfg.spec_factor * L)), 0.0, g.end) if L else ([], [])
    assert got == want


def test_own_prompt_matched_from_first_step():
    prompt = list(range(100, 140)) + [7, 8] + list(range(100, 110))  # the answer starts restating the prompt
    ix = SuffixIndex(SuffixConfig())
    ix.add(1, prompt)
    p = ix.propose([1], 8)[0]
    assert p.source == "self" and p.match_len == 10
    assert p.tokens == list(range(110, 118))
    assert p.probs[0] == pytest.approx(10 / 11.5) and p.probs == sorted(p.probs, reverse=True)


def test_length_grows_with_match_and_is_cut_at_low_probability():
    ix = SuffixIndex(SuffixConfig(spec_factor=1.0, min_prob=0.4, match_prior=0))
    ix.add(1, [1, 2, 3, 4, 5, 6, 0, 1])  # a one-token match: one token proposed
    assert ix.propose([1], 8)[0].tokens == [2]
    ix.add(2, [5, 1, 2, 9, 5, 1, 3, 8, 5, 1, 3, 7, 5, 1])  # after "5 1": 3 twice, 2 once; then 8 or 7
    p = ix.propose([2], 8)[0]
    assert p.tokens == [3] and p.probs == pytest.approx([2 / 3])  # 3 then 7 would be 1/3 < 0.4
    ix.cfg = SuffixConfig(min_prob=0.3, spec_factor=1.0, match_prior=0)
    assert ix.propose([2], 8)[0].probs == pytest.approx([2 / 3, 1 / 3])  # 2 = match length: no third
    ix.add(3, [5, 1, 2, 9, 5, 1, 3, 8, 5, 1])  # a 50/50 split is cut at min_prob 0.6 ...
    ix.cfg = SuffixConfig(min_prob=0.6, spec_factor=1.0, match_prior=0)
    assert ix.propose([3], 8)[0].tokens == []
    ix.cfg = SuffixConfig(min_prob=0.5, spec_factor=1.0, match_prior=0)  # ... and kept at 0.5, the tie going to the most recent occurrence
    assert ix.propose([3], 8)[0].tokens == [3, 8]  # then one occurrence left: 8 at the same 0.5


def test_match_prior_shortens_weak_matches():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]  # one earlier occurrence of a 1-token match: weak evidence
    ix = SuffixIndex(SuffixConfig(spec_factor=8.0, min_prob=0.3, match_prior=1.5))
    ix.add(1, text)
    p = ix.propose([1], 8)[0]
    assert p.tokens == [2] and p.probs == pytest.approx([1 / 2.5])  # the next, at 1/2.5 x 2/3.5, is cut
    ix.cfg = SuffixConfig(spec_factor=8.0, min_prob=0.3, match_prior=0)
    assert ix.propose([1], 8)[0].tokens == [2, 3, 4, 5, 6, 7, 8, 9]


def test_no_match_proposes_nothing_and_budget_caps():
    ix = SuffixIndex()
    ix.add(1, [1, 2, 3])
    ix.add(2, list(range(50)) * 2)
    props = ix.propose([1, 2], [8, 3])
    assert props[0].tokens == [] and props[0].source == "" and props[0].score == 0
    assert props[1].tokens == [0, 1, 2]
    assert ix.propose([2], 0)[0].tokens == []


def test_global_index_serves_other_requests_and_prompts_are_configurable():
    out = list(range(200, 230))
    for gp in (False, True):
        ix = SuffixIndex(SuffixConfig(global_prompts=gp, spec_factor=1.0))
        ix.add(1, list(range(300, 320)))
        ix.extend(1, out)
        ix.remove(1)
        ix.add(2, [5, 6] + out[:6])
        p = ix.propose([2], 8)[0]
        assert p.source == "global" and p.tokens == out[6:12]  # match length 6: six tokens
        ix.add(3, list(range(305, 312)))  # the first request's prompt
        assert (ix.propose([3], 4)[0].tokens == [312, 313, 314, 315]) == gp
        ix.remove(3, publish=False)
        assert ix.global_held == len(out) + (20 if gp else 0)


def test_own_text_wins_over_global_only_on_score():
    ix = SuffixIndex()
    ix.add(1, [1, 2, 3, 4, 9])
    ix.remove(1)
    ix.add(2, [1, 2, 3, 4, 5, 6, 1, 2, 3, 4])  # both have "1 2 3 4"; own continues 5 6, global 9 (then the end)
    p = ix.propose([2], 4)[0]
    assert p.source == "self" and p.tokens[:2] == [5, 6]


def _flood(ix, n, rng, length=400):
    for i in range(n):
        ix.add(i, [rng.randrange(49152) for _ in range(length)])
        ix.extend(i, [rng.randrange(49152) for _ in range(50)])
        ix.remove(i)


def test_memory_bound_under_a_flood_of_long_prompts():
    """Long random prompts (every window new: the index's worst case) flood the global index: the tokens it holds
    stay within the budget, old texts are evicted, and the memory it holds levels off once full (the dicts keep
    the table size their deletions left, then reuse it)."""
    budget = 4000
    ix = SuffixIndex(SuffixConfig(global_tokens=budget, global_prompts=True))
    rng = random.Random(0)
    tracemalloc.start()
    try:
        _flood(ix, 20, rng)             # 9k tokens offered: twice the budget
        full = tracemalloc.get_traced_memory()[0]
        _flood(ix, 40, rng)             # 18k more
        later = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert ix.global_held <= budget and ix.evicted_texts >= 50
    assert len(ix.glob.toks) <= budget + len(ix.texts)  # separators only beyond the budget
    assert sum(len(v) if isinstance(v, list) else 1 for v in ix.glob.index[8].values()) <= budget
    assert later < 1.05 * full, (full, later)
    assert later / budget < 1000, later / budget  # bytes per held token, all four window lengths included
    assert not ix.rows and ix.glob.base > 0
