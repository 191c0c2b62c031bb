"""Dynamic speculation: choose the per-row draft budget k each step, 0 (plain decoding) included.

Model: a step with budget k emits G(k) tokens per row on average: (1 - a^(k+1)) / (1 - a) with a the
per-token acceptance, G(0) = 1; in Tetris mode the measured mean at k once k has been tried (Tetris spreads
the same budget unevenly over rows, so its gain is not the formula's). The drafter needs about (k + e) * t_tok (e = Tetris' extra drafts; no
drafting at all when k = 0), the verifier T_v(k). In the two-batch pipeline a step costs max(draft, verify),
in sequential SD their sum. We pick the k with the best G(k) / step time.

Costs depend on how many rows a step carries, so draft and verify times are kept per batch-size bucket
(powers of two): when load changes (a burst, then a trickle) the controller switches to that bucket's
measurements, borrowing from the nearest measured bucket until it has its own. Every `explore_every` steps
it tries a neighbour of the current k (0 included) so the estimates stay fresh and it can come back from 0.
"""

from __future__ import annotations


def bucket(rows: int) -> int:
    """Batch-size bucket: 1, 2, 3-4, 5-8, ... -> 0, 1, 2, 3, ..."""
    return max(0, (max(1, rows) - 1).bit_length())


class AdaptiveK:
    def __init__(self, k_max: int, overlap: bool, k_start: int | None = None, ema: float = 0.2,
                 explore_every: int = 48, extra: int = 0, allow_zero: bool = True, tetris: bool = False):
        self.k_max, self.overlap, self.ema, self.explore_every = k_max, overlap, ema, explore_every
        self.extra, self.k_min, self.tetris = extra, 0 if allow_zero else 1, tetris
        self.k = k_start if k_start is not None else max(1, k_max // 2)
        self.alpha = 0.7
        self.t_draft_tok: dict[int, float] = {}         # bucket -> seconds per drafted position
        self.t_verify: dict[int, dict[int, float]] = {}  # bucket -> k -> seconds per verify step
        self.gain: dict[int, float] = {}                 # k -> measured tokens per row per step
        self.rows = 1
        self.steps = 0
        self.history: list[int] = []

    def _mix(self, old, new, reset: bool = False):
        """Running mean. reset (costs): a value off by more than 2x replaces it, a regime change (a cost is
        observed only while its budget is used, so a slow mean would keep it stale for long)."""
        if old is None or (reset and not 0.5 <= new / max(old, 1e-12) <= 2.0):
            return new
        return (1 - self.ema) * old + self.ema * new

    def observe(self, k: int, draft_s: float, verify_s: float, accepted: int, rejections: int,
                rows: int = 1) -> None:
        """One verdict: budget k per row, `rows` rows, `accepted` drafts kept in all, `rejections` rows that
        hit a rejection before their last draft (per-token acceptance = accepted / (accepted + rejections),
        the maximum-likelihood value for independent acceptances, unbiased by the draft count)."""
        b = bucket(rows)
        self.rows = rows
        if k > 0:
            self.t_draft_tok[b] = self._mix(self.t_draft_tok.get(b), draft_s / (k + self.extra), True)
        self.t_verify.setdefault(b, {})[k] = self._mix(self.t_verify.get(b, {}).get(k), verify_s, True)
        self.gain[k] = self._mix(self.gain.get(k), 1 + accepted / max(rows, 1))
        if accepted + rejections:
            self.alpha = min(0.99, max(0.01, self._mix(self.alpha, accepted / (accepted + rejections))))

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

    def choose(self, rows: int | None = None) -> int:
        """The budget for the next step of a batch of `rows` rows (default: the last observed)."""
        self.steps += 1
        if rows is not None:
            self.rows = rows
        if not self.t_verify:
            return self.k
        ks = range(self.k_min, self.k_max + 1)
        best = max(ks, key=lambda k: self.expected_tokens(k) / max(self.step_time(k), 1e-9))
        if self.steps % self.explore_every == 0:
            best = min(self.k_max, max(self.k_min, best + (1 if (self.steps // self.explore_every) % 2 else -1)))
        self.k = best
        self.history.append(best)
        return best
