"""What the drafter and verifier processes share: pinning, liveness, status reports, fault injection, sockets.

The processes themselves: workers/drafter_process.py and workers/verifier_process.py.

Sockets (the messages on each: ipc/messages.py; who sends and reads what: docs/ARCHITECTURE.md "Messages
between processes"):
  scheduler --PUSH cmd--> drafter                      Add / Abort / SetK / Probe / Stop
  drafter   --XPUB drafts--> verifier, scheduler       Slots / Drafts (descriptor; tensors in slot b) / Yield /
                                                       Probe / Stop
  verifier  --PUSH verdict_drafter--> drafter          FeatureSlots / Verdict (one per step, or per lease)
  workers   --PUSH status--> scheduler                 Ready / Heartbeat / Error / ProbeReply / Verdict
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

import zmq

from ..ipc.codec import encode
from ..ipc.messages import Error, Heartbeat, WorkerSpec

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


def placement(runner=None) -> dict:
    """Where this worker runs: its allowed cores and torch's intra-op thread count (for probes and tests), and
    what its model takes (weight bytes; a self-draft's scheme and build time)."""
    import torch
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    out = {"cores": cores, "threads": torch.get_num_threads()}
    if runner is not None:
        from ..drafting.load import model_info
        out["model"] = model_info(runner)
    return out


class _Worker:
    """Shared plumbing: context, status socket, parent watch, heartbeats, error reporting."""

    def __init__(self, spec: WorkerSpec, name: str):
        # Ctrl-C reaches the whole foreground process group; the parent alone decides when workers stop (the
        # engine also spawns them with SIGINT blocked, this covers a worker started some other way).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.spec, self.name = spec, name
        self.parent = _guard_parent()
        _pin(spec.device, spec.cores)
        self.ctx = zmq.Context()
        self.status = self.ctx.socket(zmq.PUSH)
        self.status.setsockopt(zmq.LINGER, 1000)
        self.status.connect(spec.addr.status)
        self.slots = None
        self.last_tick: float | None = None  # None during setup (loading), which worker_start_timeout_s bounds
        self._hb_stop = threading.Event()
        self._hb = None
        if spec.cfg.heartbeat_s:
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
        sock.connect(self.spec.addr.status)
        try:
            while not self._hb_stop.wait(self.spec.cfg.heartbeat_s):
                try:
                    last = self.last_tick
                    busy = 0.0 if last is None else time.monotonic() - last
                    sock.send(encode(Heartbeat(self.name, busy)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        finally:
            sock.close(linger=0)

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent

    def load(self, path: str):
        """The model runner for path (tensor-parallel workers override this)."""
        return _load(self.spec, path)

    def report(self, msg) -> None:
        self.status.send(encode(msg))

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
                self.report(Error(self.name, traceback.format_exc()))
        finally:
            self._hb_stop.set()
            if self._hb is not None:
                self._hb.join(2)
            if self.slots is not None:
                with _quiet():
                    self.slots.close()
            with _quiet():
                if self.spec.device.startswith("cuda"):
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
        f = self.spec.fault
        if f and f[0] == self.name and f[1] == point:
            f[2] -= 1
            if f[2] <= 0:
                if f[3] == "exit":
                    os._exit(3)
                if f[3] == "sleep":  # a step that takes f[4] seconds (a slow or hung forward)
                    time.sleep(float(f[4]))
                    return
                raise RuntimeError(f"injected fault in {self.name} at {point}")


def drain(sock, decode):
    """Every message already waiting on sock, decoded, without blocking."""
    while True:
        try:
            yield decode(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return


def _load(spec: WorkerSpec, path: str):
    from ..drafting.load import load_draft  # a model folder, or a self-draft built from spec.cfg.target
    runner = load_draft(path, spec.cfg.target, spec.cfg.kv_cache_tokens, spec.cfg.block_size, spec.device,
                        spec.cfg.dtype)
    if hasattr(runner, "keep_one_weight_copy"):  # the torch runner; llama.cpp holds one copy already
        runner.keep_one_weight_copy()
    return runner
