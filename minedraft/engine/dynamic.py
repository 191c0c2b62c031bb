"""Dynamic speculation: choose the per-row draft budget k each step, 0 (plain decoding) included.

Model: a step with budget k emits G(k) tokens per row on average: (1 - a^(k+1)) / (1 - a) with a the
per-token acceptance, G(0) = 1; in Tetris mode the measured mean at k once k has been tried (Tetris spreads
the same budget unevenly over rows, so its gain is not the formula's). The drafter needs about (k + e) * t_tok (e = Tetris' extra drafts; no
drafting at all when k = 0), the verifier T_v(k). In the two-batch pipeline a step costs max(draft, verify),
in sequential SD their sum. We pick the k with the best G(k) / step time.

In minedraft mode with merging (`merge_zero`), k = 0 is not a pipeline step: the two half batches merge into
one (minedraft/pipeline.py) and the verifier borrows the drafter's cores (workers/plain_steps.py), so a k = 0 step
carries every running row while a k > 0 step carries half of them.

The model is only the prior. Once a budget has run a few steps at the current load, its measured goodput
(output tokens of the step over the wall time since the previous verdict) is what the choice compares: the
model leaves out hand-overs, the merge and Python, which decide between close budgets on a CPU.

Costs depend on how many requests are running, so draft and verify times are kept per batch-size bucket
(powers of two, of the running rows, not of one step's rows): when load changes (a burst, then a trickle) the controller switches to that bucket's
measurements, borrowing from the nearest measured bucket until it has its own. A cost is the median of its
last `window` measurements, so a one-off stall (a busy host) does not move it; a measurement more than 2x
away from that median is held back, and only a second one in a row replaces the window (the regime changed:
another load, a drafter that got cheaper). Every `explore_every` steps of a load (each load keeps its own
schedule across bursts; the gap doubles after each probe, up to `max_gap_factor` times, while that load's choice
stands) it tries another budget for `probe_steps` steps,
cycling through k - 1, k + 1 and 0 (the neighbouring levels when only some budgets are allowed: suffix drafts
alone choose between 0 and k), so the estimates stay fresh, plain decoding is re-measured even from a
large k, and it can come back from 0 (the caller drops the draft time of the first step after plain decoding:
it also caught the drafter up, and measures goodput only from the third step at one budget: the first ones
after a switch pay for the merge or split and for waking the borrowed cores' threads). Started at k = 0
(`k_start=0`), it begins every new load at k = 0 and runs no probe there until k = 0's goodput is measured.

Coming back from k = 0 costs a catch-up: the drafter skipped those steps and must first run every token it
missed (prompts admitted meanwhile, outputs of the plain steps): with a large batch and a slow draft, tens of
plain steps' worth (docs/ARCHITECTURE.md "Ragged drafts"). That cost is measured at each resume (`observe_resume`),
and a probe away from plain decoding at a load waits until its last measured catch-up is at most
`resume_share` (5%) of the plain-decoding time since that load's previous probe.

A drafting budget is chosen over plain decoding only when its rate is `zero_margin` (10%) higher. Speculation
costs what no single step's goodput shows: rows accept different numbers of drafts, so a batch that started
together finishes apart and its last steps run with few rows (docs/BENCHMARKS.md "The zero margin and per-load
probe schedules": a k = 1 that tied plain decoding step for step lost over whole runs); each switch also pays a
split and a merge.
"""

from __future__ import annotations

from collections import deque
from statistics import median

from .draft_gate import SuffixGate, bucket


class AdaptiveK:
    def __init__(self, k_max: int, overlap: bool, k_start: int | None = None, ema: float = 0.2,
                 explore_every: int = 48, extra: int = 0, allow_zero: bool = True, tetris: bool = False,
                 merge_zero: bool = False, window: int = 12, min_measured: int = 3, probe_steps: int = 2,
                 max_gap_factor: int = 1, prior_margin: float = 1.25, zero_margin: float = 1.1,
                 resume_share: float = 0.05, levels: tuple[int, ...] | None = None):
        self.k_max, self.overlap, self.ema, self.explore_every = k_max, overlap, ema, explore_every
        self.merge_zero = merge_zero and overlap
        self.extra, self.k_min, self.tetris = extra, 0 if allow_zero else 1, tetris
        # the budgets it may choose: every k from k_min to k_max, or only these (e.g. (0, k) for suffix drafts,
        # whose per-row length the index already chooses: k only caps it, so the one decision is whether to draft)
        self.levels = tuple(sorted(levels)) if levels else tuple(range(self.k_min, k_max + 1))
        self.k_min = self.levels[0]
        self.k = k_start if k_start is not None else max(1, k_max // 2)
        if self.k not in self.levels:
            self.k = min(self.levels, key=lambda x: abs(x - self.k))
        self.alpha = 0.7
        self.window, self.min_measured, self.probe_steps = window, min_measured, probe_steps
        self.max_gap_factor, self.prior_margin, self.zero_margin = max_gap_factor, prior_margin, zero_margin
        self.zero_first = k_start == 0   # started at plain decoding: also begin every new load there
        self.resume_share = resume_share
        self.resume_s: dict[int, float] = {}            # bucket -> the last catch-up after plain decoding (s)
        self._bucket = None
        self._probes_done = 0
        self._sched: dict[int, dict] = {}                # bucket -> its probe schedule (see choose)
        self.t_draft_tok: dict[int, float] = {}         # bucket -> seconds per drafted position (median)
        self.t_verify: dict[int, dict[int, float]] = {}  # bucket -> k -> seconds per verify step (median)
        self._samples: dict[tuple, deque] = {}           # ("d", b) / ("v", b, k): recent costs; ("g", b, k): (tokens, s)
        self._odd: dict[tuple, float] = {}               # a cost far from its median, held back
        self.goodput: dict[int, dict[int, float]] = {}   # bucket -> k -> measured output tokens/s
        self._probe_left = 0
        self.gain: dict[int, float] = {}                 # k -> measured tokens per row per step
        self.rows = 1
        self.steps = 0
        self.history: list[int] = []

    def _mix(self, old, new):
        """Running mean (acceptance and gain: they change slowly and every step measures them)."""
        if old is None:
            return new
        return (1 - self.ema) * old + self.ema * new

    def _cost(self, key: tuple, value: float) -> float:
        """Median of the last `window` measurements of one cost."""
        q = self._samples.setdefault(key, deque(maxlen=self.window))
        if q:
            m = median(q)
            if abs(value - m) > max(m, value) / 2:   # more than 2x away: a stall, or a new regime
                prev = self._odd.pop(key, None)
                if prev is None:
                    self._odd[key] = value
                    return m
                q.clear()                             # two in a row: the regime changed
                q.append(prev)
            else:
                self._odd.pop(key, None)
        q.append(value)
        return median(q)

    def observe(self, k: int, draft_s: float | None, verify_s: float, accepted: int, rejections: int,
                rows: int = 1, step_rows: int | None = None, tokens: int | None = None,
                wall_s: float | None = None, drafted: int = 0) -> None:
        """One verdict: budget k per row, `rows` rows running (the load bucket), `step_rows` of them in this
        step (default: all), `accepted` drafts kept in all, `rejections` rows that hit a rejection before their
        last draft (per-token acceptance = accepted / (accepted + rejections), the maximum-likelihood value for
        independent acceptances, unbiased by the draft count). With `tokens` (emitted by this step) and
        `wall_s` (the time since the previous verdict) the step's measured goodput is kept too. `drafted` (the
        step's draft tokens) is SuffixGate's; this model counts budgets."""
        b = bucket(rows)
        self.rows = rows
        if k > 0 and draft_s is not None:
            self.t_draft_tok[b] = self._cost(("d", b), draft_s / (k + self.extra))
        self.t_verify.setdefault(b, {})[k] = self._cost(("v", b, k), verify_s)
        self.gain[k] = self._mix(self.gain.get(k), 1 + accepted / max(step_rows or rows, 1))
        if tokens is not None and wall_s:
            q = self._samples.setdefault(("g", b, k), deque(maxlen=self.window))
            q.append((tokens, wall_s))
            # tokens over time summed over the window (pipeline intervals alternate short and long, so a
            # median of per-step ratios would be biased), without the slowest step (one stall)
            kept = sorted(q, key=lambda x: x[1])[:-1] if len(q) >= 4 else list(q)
            self.goodput.setdefault(b, {})[k] = sum(t for t, _ in kept) / sum(w for _, w in kept)
        if accepted + rejections:
            self.alpha = min(0.99, max(0.01, self._mix(self.alpha, accepted / (accepted + rejections))))

    def observe_resume(self, seconds: float, rows: int) -> None:
        """The drafter's catch-up when drafting resumed after plain decoding, at `rows` running rows."""
        self.resume_s[bucket(rows)] = seconds

    def _resume_wait(self, b: int) -> int:
        """Plain steps a probe from k = 0 at load b waits so that its catch-up stays within resume_share."""
        r = self.resume_s.get(b)
        t0 = self.t_verify.get(b, {}).get(0)
        return int(r / (self.resume_share * t0)) if r and t0 else 0

    def expected_tokens(self, k: int) -> float:
        if k == 0:
            return 1.0
        if self.tetris and k in self.gain:
            return self.gain[k]
        a = self.alpha
        return (1 - a ** (k + 1)) / (1 - a)

    def _nearest(self, table: dict, b: int):
        return table[min(table, key=lambda x: (abs(x - b), -x))] if table else None

    @staticmethod
    def _fit(pts: dict[int, float], k: int) -> float:
        """Measured at k when tried; otherwise a line through the tried points (verify cost grows with k)."""
        if k in pts or len(pts) < 2:
            return pts.get(k) or pts[min(pts, key=lambda j: abs(j - k))]
        xs, ys = zip(*pts.items())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
        return max(1e-6, my + slope * (k - mx))

    def verify_time(self, k: int, rows: int | None = None) -> float:
        b = bucket(self.rows if rows is None else rows)
        own = self.t_verify.get(b, {})
        if len(own) >= 2 or k in own:
            return self._fit(own, k)
        near = self._nearest({x: t for x, t in self.t_verify.items() if len(t) >= 2 and x != b}, b) \
            or self._nearest({x: t for x, t in self.t_verify.items() if t}, b)
        if not own:
            return self._fit(near, k)
        (j, t), = own.items()  # one own point: the nearest bucket's shape, scaled to it
        return t * self._fit(near, k) / self._fit(near, j) if near and len(near) >= 2 else t

    def step_time(self, k: int, rows: int | None = None) -> float:
        tv = self.verify_time(k, rows)
        if k == 0:
            return tv
        b = bucket(self.rows if rows is None else rows)
        td = (self.t_draft_tok.get(b) or self._nearest(self.t_draft_tok, b) or 0.0) * (k + self.extra)
        return max(td, tv) if self.overlap else td + tv

    def _measured(self, b: int, k: int) -> bool:
        return len(self._samples.get(("g", b, k), ())) >= self.min_measured

    def rate(self, k: int, rows: int | None = None) -> float:
        """Output tokens per second at budget k: measured (the goodput of the recent steps at this load and k,
        which includes what the model leaves out: hand-overs, merging, Python) once there are
        `min_measured` of them, else predicted from the cost model (optimistic, so an untried k gets tried)."""
        rows = self.rows if rows is None else rows
        b = bucket(rows)
        if self._measured(b, k):
            return self.goodput[b][k]
        per_step = rows if (k == 0 and self.merge_zero) or not self.overlap else rows / 2
        return per_step * self.expected_tokens(k) / max(self.step_time(k, rows), 1e-9)

    def choose(self, rows: int | None = None) -> int:
        """The budget for the next step of a batch of `rows` rows (default: the last observed)."""
        self.steps += 1
        if rows is not None:
            self.rows = rows
        if not self.t_verify:
            return self.k
        rates = {k: self.rate(k) for k in self.levels}
        best = max(rates, key=rates.get)
        b = bucket(self.rows)
        measured = [k for k in rates if self._measured(b, k)]
        # a new load: plain decoding until its own goodput is known (even when a probe already measured another
        # budget here: without it a drafting budget stands on the model's word and k = 0 is never measured)
        zero_unknown = self.zero_first and not self._measured(b, self.k_min)
        if zero_unknown:
            best = self.k_min
        elif measured and best not in measured:
            # the model's prior alone moves the choice only for a clear gain: a wrong switch costs the
            # transition and several slow steps, and the probes below measure every budget anyway
            known = max(measured, key=rates.get)
            if rates[best] < self.prior_margin * rates[known]:
                best = known
        if best != self.k_min == 0 and rates[best] < self.zero_margin * rates[0]:
            best = 0  # drafting has to beat plain decoding clearly: costs a step's goodput does not show
        # Each load keeps its own probe schedule, counted in its own steps: load that comes in bursts (a batch,
        # its tail, the next batch) would otherwise restart probing at the base rate with every burst.
        st = self._sched.setdefault(b, {"steps": 0, "next": self.explore_every, "gap": self.explore_every,
                                        "best": None, "last": 0})
        st["steps"] += 1
        if best != st["best"]:   # the choice at this load changed: explore at the base rate
            st["best"], st["gap"] = best, self.explore_every
            st["next"] = min(st["next"], st["steps"] + st["gap"])
        if b != self._bucket:
            self._bucket, self._probe_left = b, 0       # a probe begun at another load measures nothing here
        if self._probe_left:
            self._probe_left -= 1
            best = self.k
        elif st["steps"] >= st["next"] and not zero_unknown \
                and not (best == 0 and st["steps"] - st["last"] < self._resume_wait(b)):
            st["last"] = st["steps"]
            i = self.levels.index(best)  # the neighbouring budgets, and plain decoding
            near = self.levels[max(0, i - 1):i] + self.levels[i + 1:i + 2] + (0,)
            probes = [p for p in dict.fromkeys(near) if p != best and p in self.levels]
            if probes:
                best = probes[self._probes_done % len(probes)]
                self._probes_done += 1
                self._probe_left = self.probe_steps - 1
            # a probe costs steps at a worse budget: while the choice stands, probe half as often each time
            st["gap"] = min(2 * st["gap"], self.max_gap_factor * self.explore_every)
            st["next"] = st["steps"] + st["gap"]
        self.k = best
        self.history.append(best)
        return best


class DynamicSpeculation:
    """The verdict listener that runs dynamic speculation in an engine: it turns each verdict into an
    observation for its AdaptiveK controller and sends the controller's choice to the drafter (`set_k`).

    `scheduler` needs `running` (rows admitted) and `set_k(k)`; the listener is appended to its
    `verdict_listeners` by the Engine, so it sees every verdict after the scheduler has applied it."""

    def __init__(self, cfg, scheduler):
        merge = cfg.mode == "minedraft"  # the workers merge the two batches at k = 0 (spec "merge_on_zero")
        suffix_alone = cfg.suffix_drafts and cfg.draft_model is None
        if suffix_alone and not merge:
            # draft or not by what a drafted token saves against what it costs (engine/draft_gate.py): short
            # probes of bursty suffix drafts tie plain decoding and left k = 6's 1.8x unused at B = 1
            self.controller = SuffixGate(cfg.k)
        else:
            self.controller = AdaptiveK(cfg.k, overlap=merge, extra=cfg.max_draft - cfg.k, tetris=cfg.tetris,
                                        merge_zero=merge,
                                        # suffix drafts alone (two-batch mode): draft (up to k, lengths the
                                        # index's) or not; an i.i.d.-acceptance model of shorter caps does not
                                        # fit drafts that are all or nothing (a copied span), and lost 0.66-0.85x
                                        # to k = 6 at B <= 2
                                        levels=(0, cfg.k) if suffix_alone else None,
                                        # start as autoregressive mode runs; drafting has to prove itself
                                        k_start=0,
                                        # goodput is measured from a probe's third step: probe 4, a bit rarer
                                        probe_steps=4, explore_every=64, max_gap_factor=8)
        self.scheduler, self.merge = scheduler, merge
        self.last_k = self.last_t1 = None
        self.run = 0  # steps in a row at last_k
        scheduler.set_k(self.controller.k)

    def __call__(self, m) -> None:
        """One verdict (ipc.messages.Verdict)."""
        res = m.results
        if not res:
            return
        prev_t1, self.last_t1 = self.last_t1, m.t1
        if m.prefill:  # a step that also scored prompts says nothing about the cost of k
            self.last_t1, self.run = None, 0
            return
        k = m.k  # the step's per-row budget (Tetris rows carry different counts)
        running = max(len(res), len(self.scheduler.running))  # costs are kept by load (running rows)
        if self.merge and k == 0 and len(res) < running:
            self.last_t1, self.run = None, 0
            return  # a half batch on its way to the merge: not what a k = 0 step costs
        resumed = k > 0 and self.last_k == 0
        self.run = self.run + 1 if k == self.last_k and prev_t1 is not None else 0
        self.last_k = k
        draft_s = None if resumed else m.draft_t1 - m.draft_t0  # resumed: it also caught the drafter up
        if resumed:  # both halves catch up in the two-batch pipeline
            self.controller.observe_resume((m.draft_t1 - m.draft_t0) * (2 if self.merge else 1),
                                           max(len(res), len(self.scheduler.running)))
        # goodput: this step's tokens over the time since the previous verdict, from the third step at k
        wall = m.t1 - prev_t1 if self.run >= 2 and m.t1 > prev_t1 else None
        ctl = self.controller
        # rows that carried no drafts (budget 0, speculate=False, no suffix match) tell nothing about k's gain
        drafting = sum(1 for r in res if r.num_drafted) or len(res)
        ctl.observe(k, draft_s, m.t1 - m.t0, sum(r.num_accepted for r in res),
                    sum(1 for r in res if r.num_accepted < r.num_drafted), rows=running,
                    # the gate weighs every scored token (rows + drafts); AdaptiveK the drafting rows' gain
                    step_rows=len(res) if isinstance(ctl, SuffixGate) else drafting,
                    tokens=sum(len(r.new_tokens) for r in res), wall_s=wall, drafted=sum(r.num_drafted for r in res))
        new_k = ctl.choose(running)
        if new_k != k:
            self.scheduler.set_k(new_k)
