"""Cores for plain decoding inside minedraft mode: what dynamic speculation does when it drafts nothing (k = 0).

At k = 0 the drafter's two batches merge into one (minedraft/pipeline.py) and its cores would sit idle, so the
verifier borrows them, which is how autoregressive mode runs; with drafts again the cores go back. The drafter
and verifier loops (workers/drafter_process.py, verifier_process.py) call these functions; the controller that
picks k is engine/dynamic.py.
"""

from __future__ import annotations

import contextlib
import os


def affinity_all_threads(cores) -> None:
    """Move every thread of this process (torch's pool, ZeroMQ's I/O thread, the heartbeat) onto cores: affinity
    is per thread, and a thread left pinned to the old core would wait there behind a busy neighbour."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread may have exited meanwhile
            os.sched_setaffinity(int(tid), set(cores))


_state = {"wide": False, "shared": False}


def widen_verifier(spec, wide: bool) -> None:
    """The verifier, for a step without drafts: run on the drafter's cores too (spec.lend_cores), with one
    torch thread per core; give them back at the first step with drafts. torch's extra threads are left unused
    when narrowed."""
    if wide == _state["wide"]:
        return
    import torch

    from ..cores import threads_for
    cores = sorted(set(spec.cores) | set(spec.lend_cores)) if wide else spec.cores
    if wide:
        affinity_all_threads(cores)
        torch.set_num_threads(threads_for(cores))
    else:
        torch.set_num_threads(threads_for(cores))
        affinity_all_threads(cores)
    _state["wide"] = wide


def share_cores(spec, idle: bool) -> None:
    """The drafter, while it drafts nothing: may run on the verifier's cores too (spec.share_cores), so the
    message hand-over is never queued behind a verifier thread on its one core (as in autoregressive mode,
    where both may run everywhere)."""
    share = spec.share_cores
    if share and idle != _state["shared"]:
        affinity_all_threads(set(spec.cores) | (set(share) if idle else set()))
        _state["shared"] = idle
