"""The verifier process: scores each drafts message's rows with the target, sends the verdict to the drafter and
the scheduler, and keeps stepping a leased batch of plain decoding on its own (docs/ARCHITECTURE.md "One step")."""

from __future__ import annotations

import time
from collections import deque

import torch
import zmq

from ..ipc.codec import pack, unpack
from ..ipc.tensors import DraftSlots, FeatureSlots
from .plain_steps import widen_verifier
from .process import POLL_MS, _Worker, drain, placement


class VerifierProcess(_Worker):
    def setup(self):
        from ..ipc.messages import NewRequest
        from .verifier import Verifier
        self.NewRequest = NewRequest
        spec, a = self.spec, self.spec["addr"]
        self.runner = self.load(spec["target"])
        self.verifier = Verifier(self.runner, spec["k"] + spec.get("extra", 0), spec["eos"],
                                 features=bool(spec.get("features")))
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(a["drafts"])
        self.to_drafter = self.ctx.socket(zmq.PUSH)
        self.to_drafter.connect(a["verdict_drafter"])
        self.slots = None
        self.feature_slots = None  # a feature-conditioned draft: the target's features go back with each verdict
        if spec.get("features"):
            if spec["device"].startswith("cuda"):
                self.feature_slots = FeatureSlots.allocate_cuda(2, spec["feat_nbytes"], spec["device"])
                self.to_drafter.send(pack({"t": "feature_slots", "cuda_handles": self.feature_slots.cuda_handles()}))
            else:
                self.feature_slots = FeatureSlots.attach_shm(spec["feat_shm"])
        self.report({"t": "ready", "who": "verifier"})

    def attach(self, m: dict):
        if m.get("cuda_handles"):
            self.slots = DraftSlots.attach_cuda(m["cuda_handles"])
        else:
            self.slots = DraftSlots.attach_shm(self.spec["shm"])

    def loop(self):
        self.inbox: deque = deque()  # messages read while a lease ran, handled before the socket's next ones
        self.held: list = []         # result rows of a lease's earlier steps, for the drafter at its end
        self.held_feats: list = []   # and their target features (a feature-conditioned draft)
        while True:
            m = self._next()
            self.tick()
            if m is None:
                if not self.parent_alive():
                    return
                continue
            if m["t"] == "slots":
                self.attach(m)
                continue
            if m["t"] == "stop":
                return
            if m["t"] == "probe":
                self._probe(m)
                continue
            if m["t"] != "drafts":
                continue  # a "yield" that came after its lease had already ended
            if self.slots is None:
                self.attach({})
            for rid in m["removes"]:
                self.verifier.remove(rid)
            for r in m["adds"]:
                self.verifier.add(self.NewRequest.from_msg(r))
            if not m["rids"]:
                continue
            if self.spec.get("lend_cores"):
                widen_verifier(self.spec, m.get("k", 0) == 0)
            drafts, q = self.slots.read(m["desc"])
            rids = self._step(m, m["rids"], drafts, q, m["t0"], m["t1"], bool(m["adds"]))
            # A lease (plain decoding, one batch, nothing pending at the drafter): keep stepping this batch
            # without waiting for its next drafts message, until the drafter says anything at all.
            while rids:
                self.tick()
                t = time.monotonic()
                rids = self._step(m, rids, [[] for _ in rids], None, t, t, False)

    def _next(self) -> dict | None:
        if self.inbox:
            return self.inbox.popleft()
        return unpack(self.sub.recv()) if self.sub.poll(POLL_MS) else None

    def _probe(self, m: dict) -> None:
        c = self.runner.cache
        self.report({"t": "probe", "who": "verifier", "id": m["id"], "seqs": len(self.verifier.seqs),
                     "cache_seqs": c.num_seqs, "used_blocks": c.used_blocks, **placement()})

    def _lease_holds(self) -> bool:
        """Whether a leased batch may take another step: nothing new from the drafter (probes are answered on
        the spot and do not end it; anything else is kept for the main loop) and the parent is alive."""
        if not self.sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # the common case, without drain's zmq.Again
            return not self.inbox and self.parent_alive()
        for m in drain(self.sub):
            if m["t"] == "probe":
                self._probe(m)
            else:
                self.inbox.append(m)
        return not self.inbox and self.parent_alive()

    def _step(self, m: dict, rids: list[int], drafts, q, draft_t0: float, draft_t1: float, prefill: bool
              ) -> list[int]:
        """Verify one step of m's batch and send the verdict; returns the rows for the lease's next step, or []
        when the batch goes back to the drafter (the verdict says so: "more" False)."""
        self._fault("verify")
        t0 = time.monotonic()
        results = self.verifier.verify(rids, drafts, q)
        t1 = time.monotonic()
        left = [r.rid for r in results if r.finish_reason is None] if m.get("lease") else []
        more = bool(left) and self._lease_holds()
        verdict = {"t": "verdict", "batch": m["batch"], "step": m["step"], "results": [r.to_msg() for r in results],
                   "t0": t0, "t1": t1, "prefill": prefill, "draft_t0": draft_t0, "draft_t1": draft_t1,
                   "k": m.get("k", 0), "more": more}
        out = pack(verdict)
        self.status.send(out)
        feats = None
        if self.feature_slots is not None:  # finished rows need none
            feats = [r.features if r.features is not None else torch.empty(0, 0) for r in results]
        # The drafter gets a lease's verdicts in one message at its end: it needs them only then, and a wake-up
        # per step would take CPU from this process (they share cores in plain decoding)
        if more:
            self.held += verdict["results"]
            self.held_feats += feats or []
            return left
        if self.held or feats is not None:  # a lease's earlier steps' results first; features out of band
            msg = {**verdict, "results": self.held + verdict["results"]}
            if feats is not None:
                msg["feat"] = self.feature_slots.write(m["batch"], self.held_feats + feats)
            out = pack(msg)
            self.held, self.held_feats = [], []
        self.to_drafter.send(out)
        return []


def verifier_main(spec: dict) -> None:
    VerifierProcess(spec, "verifier").run()
