"""The drafter process: owns the two batches' rhythm, drafts batch b while the verifier works on the other,
and hands plain decoding to the verifier on a lease (docs/ARCHITECTURE.md "One step")."""

from __future__ import annotations

import time

import zmq

from ..ipc.codec import pack
from ..ipc.tensors import DraftSlots
from .plain_steps import rebalance, share_cores
from .process import POLL_MS, _Worker, drain, placement


class DrafterProcess(_Worker):
    def setup(self):
        from .drafter import Drafter
        from .requests import NewRequest
        self.NewRequest = NewRequest
        spec, a = self.spec, self.spec["addr"]
        self.k_max = spec["k"]
        self.max_draft = self.k_max + spec.get("extra", 0)  # Tetris drafts k + e per row, keeps a budget
        self.runner = self.load(spec["draft"]) if self.k_max else None
        self.drafter = Drafter(self.runner, self.max_draft) if self.runner else None
        self.cmd = self.ctx.socket(zmq.PULL)
        self.cmd.connect(a["cmd"])
        self.verdicts = self.ctx.socket(zmq.PULL)
        self.verdicts.bind(a["verdict_drafter"])
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # count every subscriber, even with the same topic
        self.pub.bind(a["drafts"])
        if spec["device"].startswith("cuda"):
            self.slots = DraftSlots.allocate_cuda(2, spec["slot_nbytes"], spec["device"])
            handles = self.slots.cuda_handles()
        else:
            self.slots = DraftSlots.attach_shm(spec["shm"])
            handles = None
        # wait for both subscribers (verifier, scheduler) so no broadcast is ever dropped
        subs = 0
        deadline = time.monotonic() + 60
        while subs < 2:
            if not self.pub.poll(POLL_MS):
                if not self.parent_alive() or time.monotonic() > deadline:
                    raise RuntimeError("subscribers never connected")
                continue
            if self.pub.recv()[:1] == b"\x01":
                subs += 1
        if handles:
            self.pub.send(pack({"t": "slots", "cuda_handles": handles}))
        self.report({"t": "ready", "who": "drafter"})

    def _usage(self, batches, adds) -> dict:
        cache = self.runner.cache if self.runner else None
        return {"seqs": len(batches[0]) + len(batches[1]), "waiting": len(adds),
                "cache_seqs": cache.num_seqs if cache else 0, "used_blocks": cache.used_blocks if cache else 0}

    def _budget(self, k: int, rows: int) -> tuple[int, int | None]:
        """(drafts per row, Tetris capacity or None) for a step with per-row budget k (set by dynamic
        speculation, else the configured k): Tetris drafts k + e and keeps capacity drafts, by default
        k x rows; a configured capacity scales with k / k_max."""
        if not self.spec.get("tetris"):
            return k, None
        cap = self.spec.get("capacity")
        return k + self.spec["extra"], (k * rows if cap is None else max(1, round(cap * k / self.k_max)))

    def loop(self):
        batches: dict[int, list[int]] = {0: [], 1: []}
        adds: list = []                   # waiting for cache room (frees may lag the scheduler by a step)
        aborts: set[int] = set()
        removed: dict[int, list[int]] = {0: [], 1: []}  # to tell the verifier with batch b's next drafts
        outstanding = {0: False, 1: False}
        leased = {0: False, 1: False}     # with the verifier on a lease (see lease_ok); "yield" asks it back
        yielded = {0: False, 1: False}
        batch_of: dict[int, int] = {}
        k = self.k_max
        step = 0
        turn = 0
        poller = zmq.Poller()
        poller.register(self.cmd, zmq.POLLIN)
        poller.register(self.verdicts, zmq.POLLIN)
        merge = bool(self.spec.get("merge_on_zero"))

        def home(rb: int) -> int:
            """The batch an admitted request joins: the scheduler's choice, except that with no drafts (k = 0)
            everything goes to batch 0 when merging is on (see plain_steps.rebalance)."""
            return 0 if merge and k == 0 else rb

        def draftable(b: int) -> bool:
            if outstanding[b]:
                return False
            if batches[b] or removed[b]:
                return True
            need = [r.cache_tokens(self.max_draft) for r, rb in adds if home(rb) == b]
            return bool(need) and (not self.drafter or self.runner.cache.can_allocate(need[0]))

        def lease_ok(b: int) -> bool:
            """Plain decoding of one batch with nothing pending here: the verifier may go on stepping batch b
            without a drafts message per step (it drops the hand-over from every step, as a single-process
            loop would), until this loop has something for it and sends "yield"."""
            return (k == 0 and not self.spec.get("no_lease") and not adds and not aborts
                    and not batches[1 - b] and not removed[1 - b] and not outstanding[1 - b])

        while True:
            if not draftable(turn) and draftable(1 - turn):
                turn = 1 - turn  # the other batch can go now
            events = dict(poller.poll(0 if draftable(turn) else POLL_MS))
            self.tick()
            if not self.parent_alive():
                return
            for m in (drain(self.cmd) if self.cmd in events else ()):
                if m["t"] == "add":
                    adds.append((self.NewRequest.from_msg(m["req"]), m["batch"]))
                elif m["t"] == "abort":
                    aborts.update(m["rids"])
                elif m["t"] == "set_k":
                    k = max(0, min(self.k_max, int(m["k"]))) if self.k_max else 0
                    share_cores(self.spec, k == 0)
                elif m["t"] == "probe":
                    self.report({"t": "probe", "who": "drafter", "id": m["id"], **self._usage(batches, adds),
                                 **placement()})
                    self.pub.send(pack({"t": "probe", "id": m["id"]}))
                elif m["t"] == "stop":
                    self.pub.send(pack({"t": "stop"}))
                    return
            for m in (drain(self.verdicts) if self.verdicts in events else ()):
                b = m["batch"]
                outstanding[b] = leased[b] = yielded[b] = False  # a lease's steps come back in one verdict
                for r in m["results"]:
                    rid, new, _, n_acc, reason = r
                    if reason:
                        batches[b].remove(rid)
                        batch_of.pop(rid, None)
                        if self.drafter:
                            self.drafter.remove(rid)
                    elif self.drafter:
                        self.drafter.apply(rid, n_acc, new)
            # aborts: applied to batches that are not in flight
            for rid in list(aborts):
                b = batch_of.get(rid)
                pending = [x for x in adds if x[0].rid == rid]
                if pending:
                    adds.remove(pending[0])
                    aborts.discard(rid)
                elif b is None:
                    aborts.discard(rid)  # already finished
                elif not outstanding[b]:
                    batches[b].remove(rid)
                    del batch_of[rid]
                    if self.drafter:
                        self.drafter.remove(rid)
                    removed[b].append(rid)
                    aborts.discard(rid)
            for lb in (0, 1):
                if leased[lb] and not yielded[lb] and not lease_ok(lb):
                    self.pub.send(pack({"t": "yield", "batch": lb}))
                    yielded[lb] = True
            if merge:
                rebalance(k, batches, batch_of, removed, outstanding)
            b = turn
            if outstanding[b]:
                continue
            new_reqs = []
            for item in list(adds):
                req, ab = item
                if home(ab) != b:
                    continue
                if self.drafter and not self.runner.cache.can_allocate(req.cache_tokens(self.max_draft)):
                    break
                adds.remove(item)
                if self.drafter:
                    self.drafter.add(req)
                batches[b].append(req.rid)
                batch_of[req.rid] = b
                new_reqs.append(req.to_msg())
            rids = batches[b]
            if not rids:
                if removed[b]:  # tell the verifier even if the batch emptied
                    self.pub.send(pack({"t": "drafts", "batch": b, "step": step, "rids": [], "adds": [],
                                        "removes": removed[b], "desc": None, "t0": 0, "t1": 0}))
                    removed[b] = []
                turn = 1 - b
                continue
            self._fault("draft")
            t0 = time.monotonic()
            if self.drafter and k:
                drafts, q = self.drafter.draft(rids, *self._budget(k, len(rids)))
            else:
                drafts, q = [[] for _ in rids], None
            desc = self.slots.write(b, drafts, q)
            t1 = time.monotonic()
            leased[b] = lease_ok(b)
            self.pub.send(pack({"t": "drafts", "batch": b, "step": step, "rids": list(rids), "adds": new_reqs,
                                "removes": removed[b], "desc": desc, "t0": t0, "t1": t1, "k": k,
                                "lease": leased[b]}))
            removed[b] = []
            outstanding[b] = True
            step += 1
            if self.spec["mode"] == "minedraft":
                turn = 1 - b


def drafter_main(spec: dict) -> None:
    DrafterProcess(spec, "drafter").run()
