"""The two-batch rhythm, free of I/O: which request is in which batch, which batch is drafted next, when plain
decoding runs on a lease, and each step's draft budget (docs/ARCHITECTURE.md "One step").

The drafter process (workers/drafter_process.py) is sockets around this object, and the in-process baselines
(engine/local_engine.py) drive the same object with one batch, so both share one rhythm. The protocol:

  events in   add(req)             a request admitted by the scheduler (its KV blocks already assigned)
              abort(rids)          requests cancelled; returns the rows dropped now
              set_k(k)             dynamic speculation's per-row budget for the next steps
              drafts_ready(b)      batch b's drafts are written; returns whether it goes out on a lease
              verdict(b, done)     batch b is back from the verifier; returns the aborted rows dropped now
  out         next_step()          the next drafts message to build (a Step), or None
              yields()             leased batches to ask back from the verifier

A batch is idle, drafting (between next_step and drafts_ready) or in flight (until its verdict). Requests wait
in `pending` until their batch is next drafted; an abort of a row whose batch is busy waits for its verdict. Rows
are keyed by request id in both workers, so moving one between batches (the merge at k = 0, the split when
drafts resume) moves only this bookkeeping. The caller frees per-request state for the rows the events return
as dropped (and for finished rows, which it reads from the verdict itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import DraftBudget

IDLE, DRAFTING, IN_FLIGHT = "idle", "drafting", "in flight"


@dataclass
class Step:
    """One drafts message to build: add `adds` (new requests, arrival order) to the drafter, draft `rids` of
    `batch` with `per_row` drafts each (Tetris keeps the `capacity` best; None: no Tetris), and tell the verifier
    to drop `removes` and take `adds` first. No rids: a message that only carries removals (nothing to draft)."""
    batch: int
    step: int
    rids: list[int]
    adds: list
    removes: list[int]
    k: int
    per_row: int
    capacity: int | None


class Pipeline:
    """The drafter's side of the two-batch rhythm (module docstring): feed it events, build what it returns."""

    def __init__(self, budget: DraftBudget, two_batches: bool = True, merge_on_zero: bool = False):
        self.budget = budget
        self.two = two_batches              # False: sequential SD / target alone, everything in batch 0
        self.merge = merge_on_zero and two_batches  # k = 0 runs one merged batch (_rebalance)
        self.k = budget.k
        self.batches: tuple[list[int], list[int]] = ([], [])
        self.state = [IDLE, IDLE]
        self.leased = [False, False]        # with the verifier on a lease (see _lease_ok)
        self.yielded = [False, False]       # asked back, verdict not yet in
        self.removed: tuple[list[int], list[int]] = ([], [])  # for the verifier, with the batch's next drafts
        self.pending: list[tuple[object, int]] = []  # (request, preferred batch) not yet in a batch
        self.aborting: set[int] = set()     # rows of a busy batch, dropped at its verdict
        self.batch_of: dict[int, int] = {}
        self.turn = 0
        self.steps = 0

    # -- events in -------------------------------------------------------------------------------------------
    def add(self, req) -> None:
        """A request joins the smaller batch (counting those waiting for it) when its batch is next drafted.
        The drafter does not admit it a second time: the scheduler's BlockManager gave it its block table in
        both workers' caches (cache/admission.py), so no cache here can refuse it."""
        if self.two:
            size = [len(self.batches[b]) + sum(p == b for _, p in self.pending) for b in (0, 1)]
            self.pending.append((req, int(size[1] < size[0])))
        else:
            self.pending.append((req, 0))

    def abort(self, rids) -> list[int]:
        """Cancelled requests: a waiting one is forgotten (no worker holds it), a row of an idle batch leaves it
        now, a row of a busy batch at its verdict. Returns the rows dropped now."""
        dropped = []
        for rid in rids:
            i = next((i for i, (r, _) in enumerate(self.pending) if r.rid == rid), None)
            if i is not None:
                del self.pending[i]
            elif rid in self.batch_of:  # else it finished already
                b = self.batch_of[rid]
                if self.state[b] == IDLE:
                    self._drop(rid, b)
                    dropped.append(rid)
                else:
                    self.aborting.add(rid)
        return dropped

    def set_k(self, k: int) -> None:
        self.k = max(0, min(self.budget.k, int(k)))

    def drafts_ready(self, b: int) -> bool:
        """Batch b's drafts are written and go to the verifier now; True when they go on a lease."""
        if self.state[b] != DRAFTING:
            raise RuntimeError(f"drafts_ready for batch {b}, which is {self.state[b]}")
        self.state[b] = IN_FLIGHT
        self.leased[b] = self._lease_ok(b)
        return self.leased[b]

    def verdict(self, b: int, finished) -> list[int]:
        """Batch b is back (a lease's steps come in one verdict): finished rows leave it, and the aborts that
        waited for it apply. Returns those aborted rows."""
        if self.state[b] != IN_FLIGHT:
            raise RuntimeError(f"verdict for batch {b}, which is {self.state[b]}")
        self.state[b] = IDLE
        self.leased[b] = self.yielded[b] = False
        for rid in finished:
            if self.batch_of.get(rid) == b:
                self.batches[b].remove(rid)
                del self.batch_of[rid]
            self.aborting.discard(rid)  # it ended on its own: the verifier has dropped it already
        dropped = [rid for rid in self.batches[b] if rid in self.aborting]
        for rid in dropped:
            self._drop(rid, b)
            self.aborting.discard(rid)
        return dropped

    # -- out -------------------------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether next_step would build a step now (the caller then polls without waiting); turns to the
        other batch when this one cannot go and that one can."""
        if not self._draftable(self.turn) and self._draftable(1 - self.turn):
            self.turn = 1 - self.turn
        return self._draftable(self.turn)

    def next_step(self) -> Step | None:
        """The drafts message to build next, for the batch whose turn it is; None when that batch is busy or
        there is nothing to send. With two batches the turn passes to the other batch after each step."""
        if self.merge:
            self._rebalance()
        b = self.turn
        if self.state[b] != IDLE:
            return None
        adds = []
        for item in list(self.pending):
            if self._home(item[1]) == b:
                self.pending.remove(item)
                self.batches[b].append(item[0].rid)
                self.batch_of[item[0].rid] = b
                adds.append(item[0])
        removes = list(self.removed[b])
        self.removed[b].clear()
        if not self.batches[b]:
            self.turn = 1 - b if self.two else 0
            return Step(b, self.steps, [], [], removes, self.k, 0, None) if removes else None
        self.state[b] = DRAFTING
        per_row, capacity = self.budget.at(self.k, len(self.batches[b]))
        step = Step(b, self.steps, list(self.batches[b]), adds, removes, self.k, per_row, capacity)
        self.steps += 1
        if self.two:
            self.turn = 1 - b  # the pipeline alternates
        return step

    def yields(self) -> list[int]:
        """Leased batches whose lease no longer holds (something is pending here): ask each back once."""
        out = []
        for b in (0, 1):
            if self.leased[b] and not self.yielded[b] and not self._lease_ok(b):
                self.yielded[b] = True
                out.append(b)
        return out

    @property
    def rows(self) -> int:
        return len(self.batches[0]) + len(self.batches[1])

    # -- rules -----------------------------------------------------------------------------------------------
    def _home(self, preferred: int) -> int:
        """With no drafts (k = 0) and merging on, everything joins batch 0."""
        return 0 if self.merge and self.k == 0 else preferred

    def _draftable(self, b: int) -> bool:
        if self.state[b] != IDLE:
            return False
        return bool(self.batches[b] or self.removed[b] or any(self._home(p) == b for _, p in self.pending))

    def _lease_ok(self, b: int) -> bool:
        """Plain decoding of one batch with nothing pending here: the verifier may go on stepping batch b
        without a drafts message per step (as a single-process loop would), until yields() asks it back."""
        o = 1 - b
        return (self.k == 0 and not self.pending and not self.aborting
                and not self.batches[o] and not self.removed[o] and self.state[o] == IDLE)

    def _rebalance(self) -> None:
        """Plain decoding inside minedraft mode: two half batches with nothing to overlap cost two weight passes
        where one full batch costs one. So with k = 0 batch 1's rows join batch 0 as soon as batch 1 is back
        (drafted with batch 0's next step); with drafts again half of batch 0 moves back to batch 1 once
        neither is busy."""
        b0, b1 = self.batches
        if self.k == 0:
            if self.state[1] == IDLE and (b1 or self.removed[1]):
                for rid in b1:
                    self.batch_of[rid] = 0
                b0.extend(b1)
                self.removed[0].extend(self.removed[1])
                b1.clear()
                self.removed[1].clear()
        elif not b1 and self.state == [IDLE, IDLE] and len(b0) >= 2:
            half = len(b0) // 2
            b1.extend(b0[half:])
            del b0[half:]
            for rid in b1:
                self.batch_of[rid] = 1

    def _drop(self, rid: int, b: int) -> None:
        self.batches[b].remove(rid)
        del self.batch_of[rid]
        self.removed[b].append(rid)
