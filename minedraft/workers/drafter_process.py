"""The drafter process: sockets around the two-batch rhythm (minedraft/pipeline.py). It drafts batch b while the
verifier works on the other, and hands plain decoding to the verifier on a lease (docs/ARCHITECTURE.md "One
step")."""

from __future__ import annotations

import time

import zmq

from ..pipeline import Pipeline, Step
from ..ipc import messages as M
from ..ipc.codec import decode_cmd, decode_to_drafter, encode
from ..ipc.tensors import DraftSlots, FeatureSlots
from .plain_steps import share_cores
from .process import POLL_MS, _Worker, drain, placement


class DrafterProcess(_Worker):
    def setup(self):
        from ..drafting.suffix_drafter import make_drafter
        spec, cfg, a = self.spec, self.spec.cfg, self.spec.addr
        # draft="suffix" loads no model (cfg.draft None); "suffix+<model>" loads the model as usual
        self.runner = self.load(cfg.draft) if cfg.k and cfg.draft else None
        from ..controls.logits import Controls  # grammars see the target's tokenizer and eos ids, as the verifier's
        from ..runner.gguf import model_dir  # a GGUF target's tokenizer: its companion folder
        self.drafter = make_drafter(self.runner, cfg.max_draft, cfg.suffix, cfg.hybrid_threshold,
                                    Controls(self.runner.vocab_size if self.runner else 0, spec.eos,
                                             model_dir(cfg.target))) if cfg.k else None
        self.pipe = Pipeline(cfg.budget, cfg.mode == "minedraft", cfg.merge_on_zero)
        self.cmd = self.ctx.socket(zmq.PULL)
        self.cmd.connect(a.cmd)
        self.verdicts = self.ctx.socket(zmq.PULL)
        self.verdicts.bind(a.verdict_drafter)
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # count every subscriber, even with the same topic
        self.pub.bind(a.drafts)
        if spec.device.startswith("cuda"):
            self.slots = DraftSlots.allocate_cuda(2, spec.slot_nbytes, spec.device)
            handles = self.slots.cuda_handles()
        else:
            self.slots = DraftSlots.attach_shm(spec.shm)
            handles = None
        # wait for the verifier to subscribe: a broadcast without a subscriber would be dropped
        deadline = time.monotonic() + 60
        while not (self.pub.poll(POLL_MS) and self.pub.recv()[:1] == b"\x01"):
            if not self.parent_alive() or time.monotonic() > deadline:
                raise RuntimeError("the verifier never subscribed to the drafts")
        if handles:
            self.pub.send(encode(M.Slots(handles)))
        # a feature-conditioned draft reads the target's features from the verifier's slots (CUDA: their handles
        # come as the verifier's first message on the verdict socket)
        self.feature_slots = None
        if spec.features and not spec.device.startswith("cuda"):
            self.feature_slots = FeatureSlots.attach_shm(spec.feat_shm)
        self.report(M.Ready("drafter"))

    def _probe_reply(self, pid: int) -> M.ProbeReply:
        cache = self.runner.cache if self.runner else None
        return M.ProbeReply("drafter", pid, self.pipe.rows, cache.num_seqs if cache else 0,
                            cache.used_blocks if cache else 0, **placement(self.runner), waiting=len(self.pipe.pending))

    # -- the loop: each pass takes commands and verdicts, then sends what the pipeline says is next -----------
    def loop(self):
        poller = zmq.Poller()
        poller.register(self.cmd, zmq.POLLIN)
        poller.register(self.verdicts, zmq.POLLIN)
        while True:
            events = dict(poller.poll(0 if self.pipe.ready() else POLL_MS))
            self.tick()
            if not self.parent_alive():
                return
            if self.cmd in events and not self._commands():
                return
            if self.verdicts in events:
                self._verdicts()
            for b in self.pipe.yields():
                self.pub.send(encode(M.Yield(b)))
            step = self.pipe.next_step()
            if step is not None:
                self._send(step)

    def _forget(self, rids) -> None:
        for rid in rids:
            if self.drafter:
                self.drafter.remove(rid)

    def _commands(self) -> bool:
        """The scheduler's messages; False on stop."""
        for m in drain(self.cmd, decode_cmd):
            if isinstance(m, M.Add):
                self.pipe.add(m.req)
            elif isinstance(m, M.Abort):
                self._forget(self.pipe.abort(m.rids))
            elif isinstance(m, M.SetK):
                self.pipe.set_k(m.k)
                share_cores(self.spec, self.pipe.k == 0)
            elif isinstance(m, M.Probe):
                self.report(self._probe_reply(m.id))
                self.pub.send(encode(m))  # the verifier answers it too
            elif isinstance(m, M.Stop):
                self.pub.send(encode(m))
                return False
        return True

    def _verdicts(self) -> None:
        """The verifier's verdicts: finished rows leave their batch, the others take their accepted tokens."""
        for m in drain(self.verdicts, decode_to_drafter):
            if isinstance(m, M.FeatureSlots):
                self.feature_slots = FeatureSlots.attach_cuda(m.cuda_handles)
                continue
            feats = self.feature_slots.read(m.feat) if m.feat is not None else None
            for i, r in enumerate(m.results if self.drafter else ()):
                if r.finish_reason:
                    self.drafter.remove(r.rid, r.new_tokens)
                else:
                    self.drafter.apply(r.rid, r.num_accepted, r.new_tokens, feats[i] if feats is not None else None)
            self._forget(self.pipe.verdict(m.batch, [r.rid for r in m.results if r.finish_reason]))

    def _send(self, s: Step) -> None:
        """Draft one step and broadcast it; a step without rows only carries its removals."""
        if not s.rids:
            self.pub.send(encode(M.Drafts(s.batch, s.step, [], [], s.removes, None, 0.0, 0.0)))
            return
        for req in s.adds:
            if self.drafter:
                self.drafter.add(req)
        self._fault("draft")
        t0 = time.monotonic()
        if self.drafter and s.per_row:
            drafts, q = self.drafter.draft(s.rids, s.per_row, s.capacity)
        else:
            drafts, q = [[] for _ in s.rids], None
        desc = self.slots.write(s.batch, drafts, q)
        t1 = time.monotonic()
        lease = self.pipe.drafts_ready(s.batch)
        src = self.drafter.sources if self.spec.cfg.suffix is not None and s.per_row else None
        self.pub.send(encode(M.Drafts(s.batch, s.step, s.rids, s.adds, s.removes, desc, t0, t1, s.k, lease,
                                      src)))  # src: each row's draft source (suffix drafts)
        if self.drafter and s.adds:  # their draft prefill, while the verifier prefills the target (Drafter.draft)
            self.drafter.prefill([r.rid for r in s.adds])
