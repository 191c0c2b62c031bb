"""Per-step figures derived from the verdicts the scheduler receives: acceptance per draft position, Td, Tv,
step time, overlap, and a short timeline of recent draft/verify intervals (the dashboard's live `--plot`).

A StepStats is one of the scheduler's verdict listeners; other consumers (Prometheus histograms) subscribe to
the Step records it derives, so the arithmetic lives here only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..ipc.messages import Verdict

TIMELINE_S = 2.0  # intervals kept for the timeline (the dashboard shows the last second)


@dataclass(frozen=True)
class Step:
    batch: int
    draft_s: float      # Td: drafting this batch
    verify_s: float     # Tv: verifying it
    step_s: float       # wall time this step added: from the previous verdict (or from this draft's start,
    #                     when the pipeline was idle before it) to this verdict
    overlap: float      # max(Td, Tv) / step time: ~1 when drafter and verifier never wait on each other
    drafted: int        # draft tokens scored in this step (all requests)
    accepted: int
    results: tuple      # (num_drafted, num_accepted) per request


class StepStats:
    def __init__(self, positions: int, timeline_s: float = TIMELINE_S):
        """positions: draft positions counted from the start (the configured k); more are added as rows carry
        them (Tetris' extra drafts, a larger set_k)."""
        self.drafted_by_pos = [0] * positions  # drafts proposed at position i (0 = first draft token)
        self.accepted_by_pos = [0] * positions  # of those, accepted (all earlier ones were accepted too)
        self.timeline: deque = deque()        # (lane, batch, t0, t1) on time.monotonic()
        self.timeline_s = timeline_s
        self.subscribers: list = []           # callables(Step)
        self._prev_t1: float | None = None

    def __call__(self, m: Verdict) -> None:
        res = [(r.num_drafted, r.num_accepted) for r in m.results]
        for n_drafted, n_accepted in res:
            self._grow(n_drafted)
            for i in range(n_drafted):
                self.drafted_by_pos[i] += 1
            for i in range(n_accepted):
                self.accepted_by_pos[i] += 1
        td, tv = m.draft_t1 - m.draft_t0, m.t1 - m.t0
        start = m.draft_t0 if self._prev_t1 is None else max(self._prev_t1, m.draft_t0)
        step_s = max(m.t1 - start, 1e-9)
        self._prev_t1 = m.t1
        self._remember("drafter", m.batch, m.draft_t0, m.draft_t1, m.t1)
        self._remember("verifier", m.batch, m.t0, m.t1, m.t1)
        step = Step(m.batch, td, tv, step_s, max(td, tv) / step_s, sum(d for d, _ in res),
                    sum(a for _, a in res), tuple(res))
        for fn in self.subscribers:
            fn(step)

    def _grow(self, n: int) -> None:
        # adaptive k never exceeds the configured k, but set_k is public: grow rather than drop counts
        while len(self.drafted_by_pos) < n:
            self.drafted_by_pos.append(0)
            self.accepted_by_pos.append(0)

    def _remember(self, lane: str, batch: int, t0: float, t1: float, now: float) -> None:
        self.timeline.append((lane, batch, t0, t1))
        while self.timeline and self.timeline[0][3] < now - self.timeline_s:
            self.timeline.popleft()

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_pos, self.drafted_by_pos)]

    def recent(self, seconds: float, now: float) -> list[tuple]:
        """Intervals that end within `seconds` before `now` (time.monotonic())."""
        return [iv for iv in self.timeline if iv[3] >= now - seconds]
