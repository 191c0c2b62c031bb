"""Adaptive draft length: choose k per step so the drafter and verifier keep each other busy.

Model: a step that drafts k tokens emits E(k) = (1 - a^(k+1)) / (1 - a) tokens on average (a = per-token
acceptance); the drafter needs about k * t_tok, the verifier T_v(k). In the two-batch pipeline a step costs
max(draft, verify), in sequential SD their sum. We keep running means of the draft time per token, the verify
time at each k tried (nearest tried k for the others) and a, and pick the k with the best E(k) / step time.
Every `explore_every` steps we try a neighbour of the current k so the estimates stay fresh.
"""

from __future__ import annotations


class AdaptiveK:
    def __init__(self, k_max: int, overlap: bool, k_start: int | None = None, ema: float = 0.2,
                 explore_every: int = 48):
        self.k_max, self.overlap, self.ema, self.explore_every = k_max, overlap, ema, explore_every
        self.k = k_start or max(1, k_max // 2)
        self.alpha = 0.7
        self.t_draft_tok: float | None = None
        self.t_verify: dict[int, float] = {}
        self.steps = 0
        self.history: list[int] = []

    def _mix(self, old, new):
        return new if old is None else (1 - self.ema) * old + self.ema * new

    def observe(self, k: int, draft_s: float, verify_s: float, accepted: int, rejections: int) -> None:
        """One verdict: k drafted per request, `accepted` drafts kept in all, `rejections` requests that hit a
        rejection before the k-th draft (the per-token acceptance estimate is accepted / (accepted + rejections),
        the maximum-likelihood value for independent acceptances, unbiased by k)."""
        if k > 0:
            self.t_draft_tok = self._mix(self.t_draft_tok, draft_s / k)
        self.t_verify[k] = self._mix(self.t_verify.get(k), verify_s)
        if accepted + rejections:
            self.alpha = min(0.99, max(0.01, self._mix(self.alpha, accepted / (accepted + rejections))))

    def expected_tokens(self, k: int) -> float:
        a = self.alpha
        return (1 - a ** (k + 1)) / (1 - a)

    def verify_time(self, k: int) -> float:
        """Measured at k when tried; otherwise a line through the tried points (verify cost grows with k)."""
        if k in self.t_verify or len(self.t_verify) < 2:
            return self.t_verify.get(k) or self.t_verify[min(self.t_verify, key=lambda j: abs(j - k))]
        xs, ys = zip(*self.t_verify.items())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
        return max(1e-6, my + slope * (k - mx))

    def step_time(self, k: int) -> float:
        tv = self.verify_time(k)
        td = (self.t_draft_tok or 0.0) * k
        return max(td, tv) if self.overlap else td + tv

    def choose(self) -> int:
        self.steps += 1
        if not self.t_verify:
            return self.k
        best = max(range(1, self.k_max + 1), key=lambda k: self.expected_tokens(k) / max(self.step_time(k), 1e-9))
        if self.steps % self.explore_every == 0:
            best = min(self.k_max, max(1, best + (1 if (self.steps // self.explore_every) % 2 else -1)))
        self.k = best
        self.history.append(best)
        return best
