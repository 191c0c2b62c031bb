"""Entry points of the drafter and verifier processes: sockets around the Drafter/Verifier state machines.

Message flow (see docs/ARCHITECTURE.md):
  scheduler --PUSH cmd--> drafter            add / abort / stop
  drafter   --XPUB drafts--> verifier, scheduler   batch b's drafts (descriptor; tensors in slot b)
  verifier  --PUSH verdict--> drafter        point-to-point sampler output for batch b
  verifier  --PUSH verdict--> scheduler      the same, so the scheduler can stream tokens
  both      --PUSH status--> scheduler       ready / error
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque

import zmq

from ..ipc.codec import pack, unpack
from ..ipc.tensors import DraftSlots
from .plain_steps import rebalance, share_cores, widen_verifier

POLL_MS = 100


def _quiet():
    """Best-effort clean-up step on the way out: errors are ignored, the process exits next anyway."""
    return contextlib.suppress(Exception)


def _guard_parent() -> int:
    """Die with the parent: PR_SET_PDEATHSIG on Linux, plus a ppid check in the loops elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except OSError:
            pass
    return os.getppid()


def _pin(device: str, cores: list[int] | None):
    """Run on the given cores with one torch thread per core (see minedraft/cores.py for the split)."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))  # before torch starts its thread pool
    import torch

    from ..cores import threads_for
    torch.set_num_threads(threads_for(cores))
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


def placement() -> dict:
    """Where this worker runs: its allowed cores and torch's intra-op thread count (for probes and tests)."""
    import torch
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return {"cores": cores, "threads": torch.get_num_threads()}


class _Worker:
    """Shared plumbing: context, status socket, parent watch, heartbeats, error reporting."""

    def __init__(self, spec: dict, name: str):
        # Ctrl-C reaches the whole foreground process group; the parent alone decides when workers stop (the
        # engine also spawns them with SIGINT blocked, this covers a worker started some other way).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.spec, self.name = spec, name
        self.parent = _guard_parent()
        _pin(spec["device"], spec.get("cores"))
        self.ctx = zmq.Context()
        self.status = self.ctx.socket(zmq.PUSH)
        self.status.setsockopt(zmq.LINGER, 1000)
        self.status.connect(spec["addr"]["status"])
        self.slots = None
        self.last_tick: float | None = None  # None during setup (loading), which worker_start_timeout_s bounds
        self._hb_stop = threading.Event()
        self._hb = None
        if spec.get("heartbeat_s"):
            self._hb = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
            self._hb.start()

    def tick(self) -> None:
        """The main loop made progress (called once per iteration; a poll waits at most POLL_MS)."""
        self.last_tick = time.monotonic()

    def _heartbeat(self) -> None:
        """Beat every heartbeat_s from a thread, so beats flow while a forward runs (torch releases the GIL).
        Each beat says how long the main loop has been in its current iteration: the parent calls a worker
        hung when either the beats stop (stopped or frozen process) or that figure passes its deadline (stuck
        inside one step). A ZeroMQ socket belongs to one thread, hence a socket of its own."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)  # beats are only useful fresh; never queue many
        sock.connect(self.spec["addr"]["status"])
        try:
            while not self._hb_stop.wait(self.spec["heartbeat_s"]):
                try:
                    last = self.last_tick
                    busy = 0.0 if last is None else time.monotonic() - last
                    sock.send(pack({"t": "hb", "who": self.name, "busy_s": busy}), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        finally:
            sock.close(linger=0)

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent

    def load(self, path: str):
        """The model runner for path (tensor-parallel workers override this)."""
        return _load(self.spec, path)

    def report(self, msg: dict) -> None:
        self.status.send(pack(msg))

    def run(self) -> None:
        """Set up, loop, then exit with os._exit: sockets and shared memory are released here explicitly, and
        skipping the interpreter's teardown (seconds with torch loaded) is what makes shutdown fast."""
        code = 0
        try:
            self.setup()
            self.tick()
            self.loop()
        except Exception:
            code = 1
            with _quiet():
                self.report({"t": "error", "who": self.name, "msg": traceback.format_exc()})
        finally:
            self._hb_stop.set()
            if self._hb is not None:
                self._hb.join(2)
            if self.slots is not None:
                with _quiet():
                    self.slots.close()
            with _quiet():
                if self.spec["device"].startswith("cuda"):
                    import torch
                    torch.cuda.synchronize()
            with _quiet():
                self.ctx.destroy(linger=500)  # linger: the last status message (error) still goes out
            with _quiet():
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _fault(self, point: str) -> None:
        """Fault injection for the reliability tests: MINEDRAFT_FAULT=<who>:<point>:<n>."""
        f = self.spec.get("fault")
        if f and f[0] == self.name and f[1] == point:
            f[2] -= 1
            if f[2] <= 0:
                if f[3] == "exit":
                    os._exit(3)
                if f[3] == "sleep":  # a step that takes f[4] seconds (a slow or hung forward)
                    time.sleep(float(f[4]))
                    return
                raise RuntimeError(f"injected fault in {self.name} at {point}")


def _drain(sock):
    """Every message already waiting on sock, without blocking."""
    while True:
        try:
            yield unpack(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return


def _load(spec: dict, path: str):
    from .model_runner import ModelRunner
    return ModelRunner.from_pretrained(path, spec["kv_cache_tokens"], spec["block_size"], spec["device"],
                                       spec["dtype"])


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
            for m in (_drain(self.cmd) if self.cmd in events else ()):
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
            for m in (_drain(self.verdicts) if self.verdicts in events else ()):
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


class VerifierProcess(_Worker):
    def setup(self):
        from .requests import NewRequest
        from .verifier import Verifier
        self.NewRequest = NewRequest
        spec, a = self.spec, self.spec["addr"]
        self.runner = self.load(spec["target"])
        self.verifier = Verifier(self.runner, spec["k"] + spec.get("extra", 0), spec["eos"])
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(a["drafts"])
        self.to_drafter = self.ctx.socket(zmq.PUSH)
        self.to_drafter.connect(a["verdict_drafter"])
        self.slots = None
        self.report({"t": "ready", "who": "verifier"})

    def attach(self, m: dict):
        if m.get("cuda_handles"):
            self.slots = DraftSlots.attach_cuda(m["cuda_handles"])
        else:
            self.slots = DraftSlots.attach_shm(self.spec["shm"])

    def loop(self):
        self.inbox: deque = deque()  # messages read while a lease ran, handled before the socket's next ones
        self.held: list = []         # results of a lease's steps, for the drafter at the lease's end
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
        if not self.sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # the common case, without _drain's zmq.Again
            return not self.inbox and self.parent_alive()
        for m in _drain(self.sub):
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
        self.status.send(pack(verdict))
        # The drafter gets a lease's verdicts in one message at its end: it needs them only then, and a wake-up
        # per step would take CPU from this process (they share cores in plain decoding)
        self.held.append(verdict["results"])
        if not more:
            self.to_drafter.send(pack({**verdict, "results": [r for res in self.held for r in res]}))
            self.held = []
        return left if more else []


def drafter_main(spec: dict) -> None:
    DrafterProcess(spec, "drafter").run()


def verifier_main(spec: dict) -> None:
    VerifierProcess(spec, "verifier").run()
