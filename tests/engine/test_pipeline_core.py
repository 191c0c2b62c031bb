"""minedraft/pipeline.py without processes: the two batches' rhythm, merge and split at k = 0, aborts at every point
of a step, leases, Tetris budgets, and random event sequences against a simulated drafter and verifier."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minedraft.config import DraftBudget
from minedraft.pipeline import Pipeline


@dataclass
class Req:
    rid: int


class Sim:
    """A drafter loop and a verifier around a Pipeline, checking every message as a real run would need it."""

    def __init__(self, budget=DraftBudget(4), two=True, merge=False):
        self.p = Pipeline(budget, two, merge)
        self.budget = budget
        self.verifier_rows: set[int] = set()   # what the verifier holds
        self.flight: dict[int, tuple] = {}     # batch -> (step, lease) sent and not yet answered
        self.drafting: dict[int, object] = {}  # batch -> step between next_step and drafts_ready
        self.added, self.aborted, self.finished, self.dropped = [], set(), [], set()
        self.asked: set[int] = set()           # leases asked back
        self.steps = []

    # -- events --------------------------------------------------------------------------------------------
    def add(self) -> int:
        rid = len(self.added)
        self.added.append(rid)
        self.p.add(Req(rid))
        self.check()
        return rid

    def abort(self, rid: int) -> list[int]:
        self.aborted.add(rid)
        dropped = self.p.abort([rid])
        self._dropped(dropped)
        self.check()
        return dropped

    def set_k(self, k: int) -> None:
        self.p.set_k(k)
        self.check()

    def step(self):
        """next_step; the verifier applies a step's removals and adds when it reads it."""
        s = self.p.next_step()
        if s is None:
            return None
        assert s.batch not in self.flight and s.batch not in self.drafting
        assert s.step == sum(1 for x in self.steps if x.rids)
        for rid in s.removes:
            assert rid in self.verifier_rows and rid in self.dropped
            self.verifier_rows.remove(rid)
        for r in s.adds:
            assert r.rid not in self.verifier_rows and r.rid not in self.aborted
            self.verifier_rows.add(r.rid)
        assert len(set(s.rids)) == len(s.rids) and set(s.rids) <= self.verifier_rows
        assert not set(s.rids) & self.aborted, "an aborted row was drafted again"
        for other, _ in list(self.flight.values()) + [(x, None) for x in self.drafting.values()]:
            assert not set(s.rids) & set(other.rids), "a row in two batches at once"
        if s.rids:
            assert (s.per_row, s.capacity) == self.budget.at(self.p.k, len(s.rids)) and s.k == self.p.k
            self.drafting[s.batch] = s
        self.steps.append(s)
        self.check()
        return s

    def drafts_ready(self, b: int) -> bool:
        s = self.drafting.pop(b)
        lease = self.p.drafts_ready(b)
        if lease:
            assert self.p.k == 0 and not self.p.batches[1 - b] and 1 - b not in self.flight
        self.flight[b] = (s, lease)
        self.asked.discard(b)
        self.check()
        return lease

    def verdict(self, b: int, finish=None) -> list[int]:
        """The verdict of batch b: `finish` picks the rows that end in it (default: none)."""
        s, _ = self.flight.pop(b)
        assert not set(s.rids) & self.dropped, "a row was freed while the verifier still had it"
        done = [rid for i, rid in enumerate(s.rids) if finish is not None and finish(i, rid)]
        for rid in done:
            assert rid not in self.finished, "a request finished twice"
            self.finished.append(rid)
            self.verifier_rows.discard(rid)
        dropped = self.p.verdict(b, done)
        self._dropped(dropped)
        self.check()
        return dropped

    def _dropped(self, rids) -> None:
        for rid in rids:
            assert rid in self.aborted and rid not in self.dropped and rid not in self.finished
            self.dropped.add(rid)

    # -- invariants after every event -----------------------------------------------------------------------
    def check(self) -> None:
        p = self.p
        for b in p.yields():
            assert b in self.flight and self.flight[b][1], "asked back a batch that is not on a lease"
            self.asked.add(b)
        rows = p.batches[0] + p.batches[1]
        waiting = [r.rid for r, _ in p.pending]
        assert len(rows) == len(set(rows)) and not set(rows) & set(waiting), "a request held twice"
        assert p.batch_of == {rid: b for b in (0, 1) for rid in p.batches[b]}
        for b, (s, lease) in self.flight.items():
            o = 1 - b
            waits = p.pending or p.aborting or p.batches[o] or p.removed[o] or o in self.flight or o in self.drafting
            if lease and (waits or p.k):
                assert b in self.asked, "a lease goes on while work waits"

    def drain(self, rounds: int = 200) -> None:
        """Run until every request is done: verdicts finish every row; each must end within `rounds`."""
        for _ in range(rounds):
            for b in list(self.drafting):
                self.drafts_ready(b)
            for b in list(self.flight):
                self.verdict(b, lambda i, rid: True)
            while (s := self.step()) is not None:
                if s.rids:
                    self.drafts_ready(s.batch)
            if not (self.p.pending or self.p.rows or self.flight or self.drafting or self.p.ready()):
                break
        else:
            pytest.fail("requests starved")
        assert not self.verifier_rows, "the verifier still holds rows nobody will verify or remove"
        for rid in self.added:  # an aborted one finished, was dropped, or never reached a worker
            if rid not in self.aborted:
                assert self.finished.count(rid) == 1, f"request {rid} lost"


def _sent(sim: Sim, n: int = 8) -> list:
    """Steps built and sent until one is refused or n are sent."""
    out = []
    for _ in range(n):
        s = sim.step()
        if s is None:
            break
        if s.rids:
            sim.drafts_ready(s.batch)
        out.append(s)
    return out


def test_batches_swap_at_every_verdict():
    sim = Sim()
    for _ in range(4):
        sim.add()
    first = _sent(sim)
    assert [(s.batch, s.rids) for s in first] == [(0, [0, 2]), (1, [1, 3])]  # the smaller batch, ties to batch 0
    order = []
    for i in range(6):
        sim.verdict(i % 2)
        (s,) = _sent(sim)
        order.append(s.batch)
    assert order == [0, 1, 0, 1, 0, 1]


def test_one_batch_waits_for_its_verdict_in_sequential_mode():
    sim = Sim(two=False)
    for _ in range(3):
        sim.add()
    assert [(s.batch, s.rids) for s in _sent(sim)] == [(0, [0, 1, 2])]
    sim.add()
    assert sim.step() is None  # in flight: the new request waits
    sim.verdict(0, lambda i, rid: rid == 1)
    (s,) = _sent(sim)
    assert s.rids == [0, 2, 3] and [r.rid for r in s.adds] == [3]


def test_merge_at_k0_then_split_when_drafts_resume():
    sim = Sim(merge=True)
    for _ in range(4):
        sim.add()
    _sent(sim)
    sim.set_k(0)
    sim.verdict(1)
    assert sim.step() is None                    # batch 1 joined batch 0, which is still in flight
    assert sim.p.batches == ([0, 2, 1, 3], []) and sim.p.batch_of[1] == 0
    sim.verdict(0)
    (s,) = _sent(sim)
    assert (s.batch, s.rids, s.per_row) == (0, [0, 2, 1, 3], 0)
    assert sim.flight[0][1], "plain decoding of one batch goes on a lease"
    sim.add()                                    # a new request joins batch 0 too, and ends the lease
    assert sim.asked == {0}
    sim.set_k(3)
    sim.verdict(0)
    steps = _sent(sim)
    assert [(s.batch, s.rids) for s in steps] == [(0, [0, 2]), (1, [1, 3, 4])]  # split in half
    assert [r.rid for r in steps[1].adds] == [4] and steps[1].per_row == 3


def test_abort_at_every_point_of_a_step():
    sim = Sim()
    for _ in range(6):
        sim.add()
    assert sim.abort(5) == []                    # still waiting: forgotten, no worker ever sees it
    s0 = sim.step()                              # batch 0 drafting: [0, 2, 4]
    assert sim.abort(2) == []                    # waits for the verdict
    sim.drafts_ready(0)
    assert sim.abort(4) == []                    # in flight: waits too
    s1 = sim.step()
    sim.drafts_ready(1)
    assert 5 not in s0.rids + s1.rids and [r.rid for r in s1.adds] == [1, 3]
    assert sim.verdict(0, lambda i, rid: rid == 4) == [2]  # 4 finished on its own; 2 leaves now
    assert sim.abort(4) == [] and sim.abort(0) == [0]      # finished: nothing; idle batch: at once
    (s,) = _sent(sim, 1)
    assert (s.batch, s.rids, sorted(s.removes)) == (0, [], [0, 2])  # removals still reach the verifier
    assert sim.abort(0) == []                    # twice: nothing
    sim.verdict(1)
    sim.drain()
    assert sorted(sim.dropped) == [0, 2] and sorted(sim.finished) == [1, 3, 4]


def test_a_request_added_while_both_batches_are_in_flight_joins_its_batch_next():
    sim = Sim()
    for _ in range(3):
        sim.add()
    _sent(sim)                                   # batch 0: [0, 2], batch 1: [1]
    new = sim.add()                              # both busy: it waits, for batch 1 (the smaller)
    assert sim.step() is None and sim.p.pending[0][1] == 1
    sim.verdict(0)
    (s,) = _sent(sim)
    assert (s.batch, s.adds) == (0, [])          # batch 0 goes first, without it
    sim.verdict(1)
    (s,) = _sent(sim)
    assert (s.batch, s.rids, [r.rid for r in s.adds]) == (1, [1, new], [new])


def test_tetris_budget_scales_with_k():
    b = DraftBudget(4, tetris=True, extra=2)
    assert (b.max_draft, b.at(4, 3), b.at(2, 3), b.at(0, 3)) == (6, (6, 12), (4, 6), (0, None))
    fixed = DraftBudget(4, tetris=True, extra=2, capacity=10)
    assert (fixed.at(4, 3), fixed.at(2, 3), fixed.at(1, 50)) == ((6, 10), (4, 5), (3, 2))
    assert DraftBudget(3).at(3, 5) == (3, None) and DraftBudget(3).max_draft == 3
    sim = Sim(budget=fixed)
    for _ in range(3):
        sim.add()
    sim.set_k(9)                                 # clamped to the configured k
    assert sim.p.k == 4
    sim.set_k(2)
    (s,) = _sent(sim, 1)
    assert (s.k, s.per_row, s.capacity) == (2, 4, 5)


def test_a_lease_is_asked_back_once_when_work_arrives():
    """Autoregressive mode (one batch, k = 0): the verifier steps the batch on alone until a request arrives."""
    sim = Sim(budget=DraftBudget(0), two=False)
    sim.add()
    (s,) = _sent(sim)
    assert sim.flight[0][1] and s.per_row == 0
    assert sim.p.yields() == []
    sim.add()
    assert sim.asked == {0} and sim.p.yields() == []  # once
    sim.verdict(0)
    (s,) = _sent(sim)
    assert s.rids == [0, 1] and [r.rid for r in s.adds] == [1] and sim.flight[0][1]  # on a lease again
    sim.abort(0)
    assert sim.asked == {0}


def test_a_verdict_for_a_batch_not_in_flight_is_refused():
    p = Pipeline(DraftBudget(2))
    with pytest.raises(RuntimeError, match="not|idle"):
        p.verdict(0, [])


EVENTS = st.one_of(
    st.just(("add",)), st.just(("step",)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("set_k"), st.integers(0, 5)),
    st.tuples(st.just("verdict"), st.integers(0, 1), st.integers(0, 2**16)),
    st.tuples(st.just("ready"), st.integers(0, 1)),
)


@settings(max_examples=150, deadline=None)
@given(events=st.lists(EVENTS, max_size=60), two=st.booleans(), merge=st.booleans(), tetris=st.booleans())
def test_random_events_lose_duplicate_or_starve_nothing(events, two, merge, tetris):
    """Any order of adds, aborts, k changes, drafts and verdicts: every message the verifier gets is consistent
    with what it holds, no row is in two batches or drafted after its abort, and draining finishes everything."""
    sim = Sim(DraftBudget(4, tetris=tetris, extra=2 if tetris else 0), two, merge)
    for ev in events:
        if ev[0] == "add":
            sim.add()
        elif ev[0] == "abort" and sim.added:
            sim.abort(ev[1] % len(sim.added))
        elif ev[0] == "set_k":
            sim.set_k(ev[1])
        elif ev[0] == "step":
            sim.step()
        elif ev[0] == "ready" and ev[1] in sim.drafting:
            sim.drafts_ready(ev[1])
        elif ev[0] == "verdict" and ev[1] in sim.flight:
            bits = ev[2]
            sim.verdict(ev[1], lambda i, rid: bits >> (i % 16) & 1)
    sim.drain()
