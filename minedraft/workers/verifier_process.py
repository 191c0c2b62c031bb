"""The verifier process: scores each drafts message's rows with the target, sends the verdict to the drafter and
the scheduler, and keeps stepping a leased batch of plain decoding on its own (docs/ARCHITECTURE.md "One step")."""

from __future__ import annotations

import time
from collections import deque

import torch
import zmq

from ..ipc import messages as M
from ..ipc.codec import decode_drafts, encode
from ..ipc.tensors import DraftSlots, FeatureSlots
from .plain_steps import widen_verifier
from .process import POLL_MS, _Worker, drain, placement


class VerifierProcess(_Worker):
    def setup(self):
        from ..runner.gguf import model_dir
        from .verifier import Verifier
        spec, a = self.spec, self.spec.addr
        self.runner = self.load(spec.cfg.target)
        self.verifier = Verifier(self.runner, spec.cfg.max_draft, spec.eos, features=spec.features,
                                 tokenizer_dir=model_dir(spec.cfg.target))  # a GGUF's: its companion folder
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(a.drafts)
        self.to_drafter = self.ctx.socket(zmq.PUSH)
        self.to_drafter.connect(a.verdict_drafter)
        self.slots = None
        self.feature_slots = None  # a feature-conditioned draft: the target's features go back with each verdict
        if spec.features:
            if spec.device.startswith("cuda"):
                self.feature_slots = FeatureSlots.allocate_cuda(2, spec.feat_nbytes, spec.device)
                self.to_drafter.send(encode(M.FeatureSlots(self.feature_slots.cuda_handles())))
            else:
                self.feature_slots = FeatureSlots.attach_shm(spec.feat_shm)
        self.report(M.Ready("verifier"))

    def attach(self, m: M.Slots | None):
        """The draft slots: CUDA handles from the drafter's first message, else the engine's shared memory."""
        if m is not None and m.cuda_handles:
            self.slots = DraftSlots.attach_cuda(m.cuda_handles)
        else:
            self.slots = DraftSlots.attach_shm(self.spec.shm)

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
            if isinstance(m, M.Slots):
                self.attach(m)
                continue
            if isinstance(m, M.Stop):
                return
            if isinstance(m, M.Probe):
                self._probe(m)
                continue
            if not isinstance(m, M.Drafts):
                continue  # a Yield that came after its lease had already ended
            if self.slots is None:
                self.attach(None)
            for rid in m.removes:
                self.verifier.remove(rid)
            for r in m.adds:
                self.verifier.add(r)
            if not m.rids:
                continue
            if self.spec.lend_cores:
                widen_verifier(self.spec, m.k == 0)
                if hasattr(self.runner, "set_threads"):  # llama.cpp keeps its own thread count
                    self.runner.set_threads(torch.get_num_threads())
            drafts, q = self.slots.read(m.desc)
            rids = self._step(m, m.rids, drafts, q, m.t0, m.t1, bool(m.adds))
            # A lease (plain decoding, one batch, nothing pending at the drafter): keep stepping this batch
            # without waiting for its next drafts message, until the drafter says anything at all.
            while rids:
                self.tick()
                t = time.monotonic()
                rids = self._step(m, rids, [[] for _ in rids], None, t, t, False)

    def _next(self):
        if self.inbox:
            return self.inbox.popleft()
        return decode_drafts(self.sub.recv()) if self.sub.poll(POLL_MS) else None

    def _probe(self, m: M.Probe) -> None:
        c = self.runner.cache
        self.report(M.ProbeReply("verifier", m.id, len(self.verifier.seqs), c.num_seqs, c.used_blocks,
                                 **placement(self.runner)))

    def _lease_holds(self) -> bool:
        """Whether a leased batch may take another step: nothing new from the drafter (probes are answered on
        the spot and do not end it; anything else is kept for the main loop) and the parent is alive."""
        if not self.sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # the common case, without drain's zmq.Again
            return not self.inbox and self.parent_alive()
        for m in drain(self.sub, decode_drafts):
            if isinstance(m, M.Probe):
                self._probe(m)
            else:
                self.inbox.append(m)
        return not self.inbox and self.parent_alive()

    def _step(self, m: M.Drafts, rids: list[int], drafts, q, draft_t0: float, draft_t1: float, prefill: bool
              ) -> list[int]:
        """Verify one step of m's batch and send the verdict; returns the rows for the lease's next step, or []
        when the batch goes back to the drafter (the verdict says so: "more" False)."""
        self._fault("verify")
        t0 = time.monotonic()
        results = self.verifier.verify(rids, drafts, q)
        t1 = time.monotonic()
        left = [r.rid for r in results if r.finish_reason is None] if m.lease else []
        more = bool(left) and self._lease_holds()
        # suffix/hybrid: each row's draft source (rows in m's order: this is the drafts message's first step)
        src = m.src if m.src is not None and any(drafts) else None
        verdict = M.Verdict(m.batch, m.step, results, t0, t1, prefill, draft_t0, draft_t1, m.k, more, src=src)
        out = encode(verdict)
        self.status.send(out)
        feats = None
        if self.feature_slots is not None:  # finished rows need none
            feats = [f if f is not None else torch.empty(0, 0) for f in self.verifier.last_features]
        # The drafter gets a lease's verdicts in one message at its end: it needs them only then, and a wake-up
        # per step would take CPU from this process (they share cores in plain decoding)
        if more:
            self.held += results
            self.held_feats += feats or []
            return left
        if self.held or feats is not None:  # a lease's earlier steps' results first; features out of band
            verdict.results = self.held + results
            if feats is not None:
                verdict.feat = self.feature_slots.write(m.batch, self.held_feats + feats)
            out = encode(verdict)
            self.held, self.held_feats = [], []
        self.to_drafter.send(out)
        return []
