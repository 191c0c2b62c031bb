"""Suffix drafting: propose what followed the longest earlier occurrence of a row's recent tokens (no model).

Two indexes are searched for every row:
* the row's own text (its prompt and its output so far), built when the request arrives and extended at every
  verdict, so text the answer repeats from its prompt (code being edited, a passage being quoted) is found from the
  first step;
* a global index of recent requests' outputs (and, with `global_prompts`, their prompts), shared by all rows and
  bounded by `global_tokens`: when a finished request's text would pass the budget, the oldest texts are evicted.

A text is stored once as a flat array of token ids; the index maps each window of the last n tokens (n in
`_KEYS`) to the positions where it ends. The lookup takes the longest key length whose window of the row's recent
tokens occurs, extends each occurrence backwards to its full match length (up to `max_depth`), keeps the
occurrences of the longest match (the deepest node of a suffix tree of depth `max_depth`) and walks forward from
them: at each position the most frequent next token is proposed. Its probability is estimated as its share of
the occurrences still following times m / (m + `match_prior`), m the match length it extends (the match so far
plus the draft before it: one earlier occurrence of a long stretch is good evidence, of one token weak evidence;
on the target's answers to the grounded dev prompts a token extending a 1-token match was right 28% of the time,
2: 56%, 4: 75%, 8: 87%, 32: 98%), multiplied along the draft. The knobs:

* `max_depth`: matches longer than this count as equally strong (and cost no more to find);
* `spec_factor`, `spec_offset`: a row drafts at most floor(spec_factor x match length + spec_offset) tokens (and
  at most the engine's per-row budget k), so a one-token match proposes one token and a long one up to k;
* `min_prob`: the draft stops before a token whose estimated probability (the product along the draft) is below
  it, so a continuation that the occurrences disagree on is not sent to the verifier;
* `match_prior`: see above (0: the occurrences' shares alone, as a suffix tree's counts give them);
* `max_candidates`: only the most recent occurrences of a short window are examined (bounds the work per row).

A proposal's score is the sum of those probabilities, the expected number of its tokens the target accepts if the
estimates hold; the two indexes' proposals are compared on it, and the hybrid drafter compares it to a threshold.
Defaults: chosen with scripts/bench/suffix_sim.py on the grounded dev split (SmolLM2-135M's greedy answers), where they
gave 2.31 tokens per verify step for 2.2 draft tokens at k = 8 (a naive longest match of up to 8: 2.68 for 6.7).
Pure Python, no torch, no I/O: the drafter process calls it once per step for all its rows (`propose`).
"""

from __future__ import annotations

import bisect
from array import array
from collections import deque
from dataclasses import dataclass, field

from ..config import SuffixConfig

_KEYS = (8, 4, 2, 1)  # window lengths indexed, longest first: a match of length L is found through the longest <= L
_SEP = -1              # stands between texts in the global array: never matches, ends every continuation


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # estimated probability that each prefix is accepted
    match_len: int = 0
    source: str = ""                                  # "self" | "global" | "" (no match)

    @property
    def score(self) -> float:
        return sum(self.probs)


def _key(window) -> int:
    return window[0] if len(window) == 1 else hash(tuple(window))


class _Store:
    """Token array plus window index. Positions are absolute (they survive eviction at the front: `base` is the
    absolute position of toks[0]); an index value is one position or an ascending list of them."""

    def __init__(self):
        self.toks = array("i")
        self.base = 0
        self.index: dict[int, dict[int, int | list[int]]] = {n: {} for n in _KEYS}

    @property
    def end(self) -> int:
        return self.base + len(self.toks)

    def extend(self, tokens, start_of_text: int) -> None:
        """Append tokens of the text that begins at absolute position start_of_text and index the windows that end
        inside them (never a window reaching before that text)."""
        old = self.end
        self.toks.extend(tokens)
        toks, base = self.toks, self.base
        for n, idx in self.index.items():
            for e in range(max(old + 1, start_of_text + n), self.end + 1):
                k = _key(toks[e - n - base:e - base])
                v = idx.get(k)
                if v is None:
                    idx[k] = e
                elif isinstance(v, int):
                    idx[k] = [v, e]
                else:
                    v.append(e)

    def drop_front(self, upto: int, starts_ends: list[tuple[int, int]]) -> None:
        """Forget absolute positions < upto (whole texts, given as (start, end)): unindex their windows, free
        their tokens."""
        toks, base = self.toks, self.base
        for n, idx in self.index.items():
            keys = set()
            for s, e in starts_ends:
                for x in range(s + n, e + 1):
                    keys.add(_key(toks[x - n - base:x - base]))
            for k in keys:
                v = idx.get(k)
                if v is None:
                    continue
                if isinstance(v, int):
                    if v < upto:
                        del idx[k]
                    continue
                i = bisect.bisect_left(v, upto)
                if i:
                    del v[:i]
                    if not v:
                        del idx[k]
                    elif len(v) == 1:
                        idx[k] = v[0]
        del self.toks[:upto - base]
        self.base = upto

    def longest(self, ctx, cfg: SuffixConfig, limit_end: int | None = None) -> tuple[int, list[int]]:
        """(match length, end positions of its occurrences, most recent first) of the longest suffix of ctx that
        occurs with at least one token after it; (0, []) if none."""
        toks, base = self.toks, self.base
        end = self.end if limit_end is None else limit_end
        for n in _KEYS:
            if len(ctx) < n or n > cfg.max_depth:  # matches are capped at max_depth: a longer key would miss some
                continue
            v = self.index[n].get(_key(ctx[-n:]))
            if v is None:
                continue
            cands = [v] if isinstance(v, int) else v[::-1][:cfg.max_candidates]
            best, out = 0, []
            for p in cands:
                if p >= end or toks[p - base] == _SEP:
                    continue  # the row's own end, or a text's: nothing follows it
                lim = min(cfg.max_depth, len(ctx), p - base)
                L = 0
                while L < lim and toks[p - 1 - L - base] == ctx[-1 - L]:
                    L += 1
                if L > best:
                    best, out = L, [p]
                elif L == best and L:
                    out.append(p)
            if out:
                return best, out
        return 0, []

    def walk(self, cands: list[int], limit: int, min_prob: float, end: int, match_len: int = 0,
             prior: float = 0.0) -> tuple[list[int], list[float]]:
        """The most frequent continuation of the occurrences ending at cands (which match match_len tokens), with
        its estimated probabilities."""
        toks, base = self.toks, self.base
        out, probs, cum, alive = [], [], 1.0, cands
        for t in range(limit):
            counts: dict[int, int] = {}
            for p in alive:  # most recent first: a tie goes to the most recent occurrence
                if p + t < end:
                    x = toks[p + t - base]
                    if x != _SEP:
                        counts[x] = counts.get(x, 0) + 1
            if not counts:
                break
            tok = max(counts, key=counts.__getitem__)
            m = match_len + t
            pr = cum * counts[tok] / sum(counts.values()) * (m / (m + prior) if prior else 1.0)
            if pr < min_prob:
                break
            out.append(tok)
            probs.append(pr)
            cum = pr
            alive = [p for p in alive if p + t < end and toks[p + t - base] == tok]
        return out, probs


class SuffixIndex:
    """Per-request indexes plus the global one (see the module docstring). Not thread-safe."""

    def __init__(self, cfg: SuffixConfig | None = None):
        self.cfg = cfg or SuffixConfig()
        self.rows: dict[int, tuple[_Store, int]] = {}  # rid -> (its text's store, prompt length)
        self.glob = _Store()
        self.texts: deque[tuple[int, int]] = deque()   # global texts as (start, end), oldest first
        self.evicted_texts = 0

    # -- life-cycle -------------------------------------------------------------------------------------------
    def add(self, rid: int, prompt_ids) -> None:
        s = _Store()
        s.extend(prompt_ids, 0)
        self.rows[rid] = (s, len(prompt_ids))

    def extend(self, rid: int, tokens) -> None:
        if tokens:
            self.rows[rid][0].extend(tokens, 0)

    def remove(self, rid: int, publish: bool = True) -> None:
        """Drop a request's own index; with publish, its output (and prompt if configured) joins the global one."""
        row = self.rows.pop(rid, None)
        if row is None or not publish:
            return
        s, plen = row
        self.publish(s.toks if self.cfg.global_prompts else s.toks[plen:])

    def publish(self, tokens) -> None:
        """Add one text to the global index, evicting the oldest texts past the budget."""
        budget = self.cfg.global_tokens
        tokens = tokens[max(0, len(tokens) - budget):] if budget else []
        if not tokens:
            return
        g = self.glob
        held = sum(e - s for s, e in self.texts)
        if held + len(tokens) > budget:
            gone = []
            while self.texts and held + len(tokens) > budget:
                s, e = self.texts.popleft()
                held -= e - s
                gone.append((s, e))
            self.evicted_texts += len(gone)
            g.drop_front(self.texts[0][0] if self.texts else g.end, gone)
        start = g.end
        g.extend(tokens, start)
        g.toks.append(_SEP)
        self.texts.append((start, start + len(tokens)))

    @property
    def global_held(self) -> int:
        """Tokens the global index holds now (excluding separators)."""
        return sum(e - s for s, e in self.texts)

    # -- drafting ---------------------------------------------------------------------------------------------
    def propose_one(self, rid: int, budget: int) -> Proposal:
        """The better (by score) of the row's own and the global index's proposals, at most budget tokens."""
        if budget <= 0:
            return Proposal()
        cfg = self.cfg
        own, _ = self.rows[rid]
        ctx = own.toks
        best = Proposal()
        for source, store in (("self", own), ("global", self.glob)):
            L, cands = store.longest(ctx, cfg)
            if not L:
                continue
            limit = min(budget, int(cfg.spec_factor * L + cfg.spec_offset))
            toks, probs = store.walk(cands, limit, cfg.min_prob, store.end, L, cfg.match_prior)
            p = Proposal(toks, probs, L, source)
            if toks and p.score > best.score:
                best = p
        return best

    def propose(self, rids: list[int], budgets: int | list[int]) -> list[Proposal]:
        """One proposal per row of a step (an empty one where nothing matches); budgets: per row or for all."""
        if isinstance(budgets, int):
            budgets = [budgets] * len(rids)
        return [self.propose_one(r, b) for r, b in zip(rids, budgets)]
