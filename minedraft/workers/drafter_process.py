"""The drafter process: owns the two batches' rhythm, drafts batch b while the verifier works on the other,
and hands plain decoding to the verifier on a lease (docs/ARCHITECTURE.md "One step")."""

from __future__ import annotations

import time

import zmq

from ..ipc import messages as M
from ..ipc.codec import decode_cmd, decode_to_drafter, encode
from ..ipc.tensors import DraftSlots, FeatureSlots
from .plain_steps import rebalance, share_cores
from .process import POLL_MS, _Worker, drain, placement


class DrafterProcess(_Worker):
    def setup(self):
        from ..drafting.suffix_drafter import make_drafter
        spec, a = self.spec, self.spec.addr
        # draft="suffix" loads no model (spec.draft None); "suffix+<model>" loads the model as usual
        self.runner = self.load(spec.draft) if spec.k and spec.draft else None
        from ..controls.logits import Controls  # grammars see the target's tokenizer and eos ids, as the verifier's
        from ..runner.gguf import model_dir  # a GGUF target's tokenizer: its companion folder
        self.drafter = make_drafter(self.runner, spec.max_draft, spec.suffix, spec.hybrid_threshold,
                                    Controls(self.runner.vocab_size if self.runner else 0, spec.eos,
                                             model_dir(spec.target))) if spec.k else None
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
            self.pub.send(encode(M.Slots(handles)))
        # a feature-conditioned draft reads the target's features from the verifier's slots (CUDA: their handles
        # come as the verifier's first message on the verdict socket)
        self.feature_slots = None
        if spec.features and not spec.device.startswith("cuda"):
            self.feature_slots = FeatureSlots.attach_shm(spec.feat_shm)
        self.report(M.Ready("drafter"))

    def _probe_reply(self, pid: int) -> M.ProbeReply:
        cache = self.runner.cache if self.runner else None
        return M.ProbeReply("drafter", pid, len(self.batches[0]) + len(self.batches[1]),
                            cache.num_seqs if cache else 0, cache.used_blocks if cache else 0,
                            **placement(self.runner),
                            waiting=len(self.adds))

    def _budget(self, k: int, rows: int) -> tuple[int, int | None]:
        """(drafts per row, Tetris capacity or None) for a step with per-row budget k (set by dynamic
        speculation, else the configured k): Tetris drafts k + e and keeps capacity drafts, by default
        k x rows; a configured capacity scales with k / the configured k."""
        spec = self.spec
        if not spec.tetris:
            return k, None
        cap = spec.capacity
        return k + spec.max_draft - spec.k, (k * rows if cap is None else max(1, round(cap * k / spec.k)))

    # -- the loop: each pass takes commands and verdicts, applies aborts, then drafts one batch if it can ------
    def loop(self):
        self.batches: dict[int, list[int]] = {0: [], 1: []}
        self.adds: list = []              # waiting for cache room (frees may lag the scheduler by a step)
        self.aborts: set[int] = set()
        self.removed: dict[int, list[int]] = {0: [], 1: []}  # to tell the verifier with batch b's next drafts
        self.outstanding = {0: False, 1: False}
        self.leased = {0: False, 1: False}   # with the verifier on a lease (see _lease_ok); "yield" asks it back
        self.yielded = {0: False, 1: False}
        self.batch_of: dict[int, int] = {}
        self.k = self.spec.k
        self.step = 0
        self.merge = self.spec.merge_on_zero
        turn = 0
        poller = zmq.Poller()
        poller.register(self.cmd, zmq.POLLIN)
        poller.register(self.verdicts, zmq.POLLIN)
        while True:
            if not self._draftable(turn) and self._draftable(1 - turn):
                turn = 1 - turn  # the other batch can go now
            events = dict(poller.poll(0 if self._draftable(turn) else POLL_MS))
            self.tick()
            if not self.parent_alive():
                return
            if self.cmd in events and not self._commands():
                return
            if self.verdicts in events:
                self._verdicts()
            self._apply_aborts()
            for lb in (0, 1):
                if self.leased[lb] and not self.yielded[lb] and not self._lease_ok(lb):
                    self.pub.send(encode(M.Yield(lb)))
                    self.yielded[lb] = True
            if self.merge:
                rebalance(self.k, self.batches, self.batch_of, self.removed, self.outstanding)
            if self.outstanding[turn]:
                continue
            sent = self._send_drafts(turn, self._admit(turn))
            if not sent or self.spec.mode == "minedraft":
                turn = 1 - turn  # the pipeline alternates; an empty batch lets the other one go

    def _home(self, rb: int) -> int:
        """The batch an admitted request joins: the scheduler's choice, except that with no drafts (k = 0)
        everything goes to batch 0 when merging is on (see plain_steps.rebalance)."""
        return 0 if self.merge and self.k == 0 else rb

    def _draftable(self, b: int) -> bool:
        if self.outstanding[b]:
            return False
        if self.batches[b] or self.removed[b]:
            return True
        need = [r.cache_tokens(self.spec.max_draft) for r, rb in self.adds if self._home(rb) == b]
        return bool(need) and (not self.runner or self.runner.cache.can_allocate(need[0]))

    def _lease_ok(self, b: int) -> bool:
        """Plain decoding of one batch with nothing pending here: the verifier may go on stepping batch b
        without a drafts message per step (it drops the hand-over from every step, as a single-process
        loop would), until this loop has something for it and sends "yield"."""
        o = 1 - b
        return (self.k == 0 and not self.adds and not self.aborts
                and not self.batches[o] and not self.removed[o] and not self.outstanding[o])

    def _commands(self) -> bool:
        """The scheduler's messages; False on stop."""
        for m in drain(self.cmd, decode_cmd):
            if isinstance(m, M.Add):
                self.adds.append((m.req, m.batch))
            elif isinstance(m, M.Abort):
                self.aborts.update(m.rids)
            elif isinstance(m, M.SetK):
                self.k = max(0, min(self.spec.k, m.k))
                share_cores(self.spec, self.k == 0)
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
            b = m.batch
            self.outstanding[b] = self.leased[b] = self.yielded[b] = False  # a lease's steps come in one verdict
            feats = self.feature_slots.read(m.feat) if m.feat is not None else None
            for i, r in enumerate(m.results):
                if r.finish_reason:
                    self.batches[b].remove(r.rid)
                    self.batch_of.pop(r.rid, None)
                    if self.drafter:
                        self.drafter.remove(r.rid, r.new_tokens)
                elif self.drafter:
                    self.drafter.apply(r.rid, r.num_accepted, r.new_tokens, feats[i] if feats is not None else None)

    def _apply_aborts(self) -> None:
        """Cancelled requests leave a waiting list at once and a batch once it is back from the verifier (the
        verifier hears of it with that batch's next drafts)."""
        for rid in list(self.aborts):
            b = self.batch_of.get(rid)
            pending = [x for x in self.adds if x[0].rid == rid]
            if pending:
                self.adds.remove(pending[0])
                self.aborts.discard(rid)
            elif b is None:
                self.aborts.discard(rid)  # already finished
            elif not self.outstanding[b]:
                self.batches[b].remove(rid)
                del self.batch_of[rid]
                if self.drafter:
                    self.drafter.remove(rid)
                self.removed[b].append(rid)
                self.aborts.discard(rid)

    def _admit(self, b: int) -> list[M.NewRequest]:
        """Waiting requests that join batch b now, in arrival order, while the draft cache has room."""
        new_reqs = []
        for item in list(self.adds):
            req, ab = item
            if self._home(ab) != b:
                continue
            if self.runner and not self.runner.cache.can_allocate(req.cache_tokens(self.spec.max_draft)):
                break
            self.adds.remove(item)
            if self.drafter:
                self.drafter.add(req)
            self.batches[b].append(req.rid)
            self.batch_of[req.rid] = b
            new_reqs.append(req)
        return new_reqs

    def _send_drafts(self, b: int, new_reqs: list[M.NewRequest]) -> bool:
        """Draft batch b and broadcast it (a lease when plain decoding has nothing pending); False when the
        batch is empty (its removals still go out)."""
        rids = self.batches[b]
        if not rids:
            if self.removed[b]:  # tell the verifier even if the batch emptied
                self.pub.send(encode(M.Drafts(b, self.step, [], [], self.removed[b], None, 0.0, 0.0)))
                self.removed[b] = []
            return False
        self._fault("draft")
        t0 = time.monotonic()
        if self.drafter and self.k:
            drafts, q = self.drafter.draft(rids, *self._budget(self.k, len(rids)))
        else:
            drafts, q = [[] for _ in rids], None
        desc = self.slots.write(b, drafts, q)
        t1 = time.monotonic()
        self.leased[b] = self._lease_ok(b)
        src = self.drafter.sources if self.spec.suffix is not None and self.k and self.drafter else None
        self.pub.send(encode(M.Drafts(b, self.step, rids, new_reqs, self.removed[b], desc, t0, t1, self.k,
                                      self.leased[b], src)))  # src: each row's draft source (suffix drafts)
        self.removed[b] = []
        self.outstanding[b] = True
        self.step += 1
        return True


def drafter_main(spec: M.WorkerSpec) -> None:
    DrafterProcess(spec, "drafter").run()
