"""StepStats, the verdict listener behind /metrics and the dashboard, on hand-made verdict messages."""

from __future__ import annotations

import pytest

from minedraft.engine.step_stats import StepStats
from minedraft.ipc.messages import StepResult, Verdict


def _verdict(batch, results, draft, verify):
    rows = [StepResult(rid=i, new_tokens=[], num_drafted=d, num_accepted=a, finish_reason=None)
            for i, (d, a) in enumerate(results)]
    return Verdict(batch=batch, step=0, results=rows, t0=verify[0], t1=verify[1], prefill=False,
                   draft_t0=draft[0], draft_t1=draft[1], k=max((d for d, _ in results), default=0), more=False)


def test_step_stats_positions_times_and_timeline():
    s = StepStats(4, timeline_s=1.0)
    steps = []
    s.subscribers.append(steps.append)
    s(_verdict(0, [(4, 2), (4, 4), (4, 0)], (10.0, 10.1), (10.1, 10.4)))  # idle before: step from draft start
    s(_verdict(1, [(4, 1)], (10.1, 10.3), (10.4, 10.6)))                  # overlapped: from the last verdict
    assert s.drafted_by_pos == [4, 4, 4, 4]
    assert s.accepted_by_pos == [3, 2, 1, 1]
    assert s.acceptance_by_position() == [0.75, 0.5, 0.25, 0.25]
    a, b = steps
    assert (a.drafted, a.accepted, b.drafted, b.accepted) == (12, 6, 4, 1)
    assert a.step_s == pytest.approx(0.4) and a.overlap == pytest.approx(0.3 / 0.4)
    assert b.step_s == pytest.approx(0.2) and b.overlap == pytest.approx(1.0)
    assert len(s.recent(1.0, 10.6)) == 4
    s(_verdict(0, [(4, 4)], (12.0, 12.1), (12.1, 12.2)))  # 1.6 s later: the old intervals leave the ring
    assert [iv[2] for iv in s.timeline] == [12.0, 12.1]
    assert s.recent(0.05, 12.2) == [("verifier", 0, 12.1, 12.2)]


def test_step_stats_grows_past_initial_k():
    s = StepStats(2)
    s(_verdict(0, [(3, 3)], (0, 1), (1, 2)))
    assert s.drafted_by_pos == [1, 1, 1] and s.accepted_by_pos == [1, 1, 1]
