"""Dynamic speculation for suffix drafts alone in sequential mode: draft when a drafted token saves more than it costs.

A suffix draft costs no forward to make and the index already sends a row only the tokens it expects the target to
keep (a row with no match drafts nothing), so the one decision is whether scoring those tokens is worth it at the
current load. AdaptiveK (engine/dynamic.py) decides that from the goodput of short probes; for suffix drafts that
fails: they are bursty (a copied stretch accepts five tokens a step, free text none), so a four-step probe mostly
lands where nothing is copied, ties plain decoding, and the controller settles at k = 0. Measured on grounded
prompts at B = 1 (Intel Xeon, kernel runner): k = 0.4 on average, 23.4 tok/s, where k = 6 gave 41.2.

The gate instead compares two measured quantities, both averaged over many steps:
* what a drafted token saves: its acceptance (accepted / drafted over the last `window` drafting steps, all loads:
  it is the workload's, not the batch size's) times the time one emitted token takes at plain decoding at this
  load (a step that scores only its rows, over its rows);
* what it costs: the verifier's extra time per scored token at this load (a robust slope of verify time over the
  tokens a step scores: ragged suffix drafts give every load a spread of them) plus the drafter's time per token.
It drafts (budget k) while saving > `margin` x cost (1.5: what the two leave out, rows of a batch finishing apart
and prefill's share of a run, took the gain of a saving 1.24x the cost at 16 rows of grounded prompts: 0.90-1.03x
plain decoding), else runs plain decoding (k = 0) and probes k for `probe_steps` steps now and then (every
`explore_every` steps, the gap doubling up to `max_gap_factor` times while the choice stands, and at once the
longest gap while saving is under half of margin x cost: a probe's steps do not pay; at 16 rows of open chat,
probing from every 32 steps, a tenth of the steps ran at k and the run at 0.93x plain decoding) so the acceptance
stays current; a probe whose own drafts pay replaces the older acceptance (the text being written changed). It
starts at k: trying a suffix draft costs a few scored tokens.
"""

from __future__ import annotations

from collections import deque
from statistics import median


def bucket(rows: int) -> int:
    """Batch-size bucket, by which both controllers (this one and engine/dynamic.py's AdaptiveK) keep their costs:
    1, 2, 3-4, 5-8, ... -> 0, 1, 2, 3, ..."""
    return max(0, (max(1, rows) - 1).bit_length())


class SuffixGate:
    def __init__(self, k_max: int, margin: float = 1.5, window: int = 64, fit_window: int = 96,
                 explore_every: int = 64, probe_steps: int = 4, max_gap_factor: int = 8):
        self.k_max, self.margin, self.levels, self.fit_window = k_max, margin, (0, k_max), fit_window
        self.k = k_max
        self.explore_every, self.probe_steps, self.max_gap_factor = explore_every, probe_steps, max_gap_factor
        self._acc: deque = deque(maxlen=window)           # (accepted, drafted) of recent drafting steps
        self._fit: dict[int, deque] = {}                  # bucket -> (scored tokens, verify s, rows) of drafting steps
        self._plain: dict[int, deque] = {}                # bucket -> verify s per row of steps that drafted nothing
        self._draft: dict[int, deque] = {}                # bucket -> drafter s per drafted token
        self._gap, self._next, self._probe_left, self._steps = explore_every, explore_every, 0, 0
        self._probe_ended = False
        self.rows = 1
        self.history: list[int] = []

    def observe(self, k: int, draft_s: float | None, verify_s: float, accepted: int, rejections: int,
                rows: int = 1, step_rows: int | None = None, tokens: int | None = None,
                wall_s: float | None = None, drafted: int = 0) -> None:
        """One verdict (AdaptiveK's signature; `drafted`: draft tokens the step scored, `step_rows`: its rows)."""
        b = bucket(rows)
        self.rows = rows
        n = step_rows or rows
        if not drafted:
            self._plain.setdefault(b, deque(maxlen=self.fit_window)).append(verify_s / n)
            return
        self._fit.setdefault(b, deque(maxlen=self.fit_window)).append((n + drafted, verify_s, n))
        self._acc.append((accepted, drafted))
        if draft_s is not None:
            self._draft.setdefault(b, deque(maxlen=self.fit_window)).append(draft_s / drafted)

    def observe_resume(self, seconds: float, rows: int) -> None:
        """Drafting resumed after plain decoding: the index's catch-up is a few list appends, nothing to weigh."""

    def acceptance(self) -> float | None:
        drafted = sum(d for _, d in self._acc)
        return sum(a for a, _ in self._acc) / drafted if drafted >= 16 else None

    def costs(self, rows: int) -> tuple[float, float] | None:
        """(seconds one emitted token takes at plain decoding, extra seconds per drafted token) at this load, from
        this load's steps or the nearest measured load's; None until some load has steps of different sizes."""
        b = bucket(rows)
        fits = {x: f for x, f in self._fit.items() if len(f) >= 8}
        for x in sorted(fits, key=lambda x: (x != b, abs(x - b))):
            pts = sorted(fits[x])
            lo, hi = pts[:len(pts) // 2], pts[len(pts) - len(pts) // 2:]
            s_lo, s_hi = median(p[0] for p in lo), median(p[0] for p in hi)
            if s_hi - s_lo < 1:
                continue  # every step scored about as many tokens: no slope here
            v_lo, v_hi = median(p[1] for p in lo), median(p[1] for p in hi)
            slope = max(0.0, (v_hi - v_lo) / (s_hi - s_lo))
            r = rows if x == b else median(p[2] for p in pts)
            plain = self._plain.get(b) or ()
            per_token = median(plain) if len(plain) >= 3 else max(v_lo - slope * max(0.0, s_lo - r), 1e-6) / max(r, 1)
            draft = self._draft.get(x) or self._draft.get(b) or ()
            return per_token, slope + (median(draft) if draft else 0.0)
        return None

    def _value(self, acc: float | None, costs: tuple[float, float] | None) -> float | None:
        if acc is None or costs is None:
            return None
        per_token, cost = costs
        return acc * per_token / max(self.margin * cost, 1e-9)

    def value(self, rows: int) -> float | None:
        """What a drafted token saves over margin x what it costs (above 1: drafting pays); None while unmeasured."""
        return self._value(self.acceptance(), self.costs(rows))

    def drafting_pays(self, rows: int) -> bool | None:
        v = self.value(rows)
        return None if v is None else v > 1

    def choose(self, rows: int | None = None) -> int:
        if rows is not None:
            self.rows = rows
        self._steps += 1
        costs = self.costs(self.rows)
        if self._probe_ended:
            self._probe_ended = False
            probe = list(self._acc)[-self.probe_steps:]
            drafted = sum(d for _, d in probe)
            if drafted and (self._value(sum(a for a, _ in probe) / drafted, costs) or 0) > 1:
                self._acc = deque(probe, maxlen=self._acc.maxlen)  # the text changed: older steps no longer say
        value = self._value(self.acceptance(), costs)
        pays = None if value is None else value > 1
        if self._probe_left:
            self._probe_ended = self._probe_left == 1
            self._probe_left -= 1
            k = self.k_max
        elif pays is None or pays:
            k = self.k_max
            self._gap, self._next = self.explore_every, self._steps + self.explore_every
        elif self._steps >= self._next:  # plain decoding: now and then a few drafting steps refresh the acceptance
            k, self._probe_left = self.k_max, self.probe_steps - 1
            self._probe_ended = self.probe_steps == 1
            # each probe costs steps that do not pay: the further from paying, the rarer (half way: the longest gap)
            far = value < 0.5
            self._gap = self.max_gap_factor * self.explore_every if far else min(
                2 * self._gap, self.max_gap_factor * self.explore_every)
            self._next = self._steps + self._gap
        else:
            k = 0
        self.k = k
        self.history.append(k)
        return k
