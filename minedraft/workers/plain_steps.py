"""Plain decoding inside minedraft mode: what dynamic speculation does when it drafts nothing (k = 0).

Two half batches with nothing to overlap cost two weight passes where one full batch costs one, and the drafter's
cores would sit idle. So at k = 0 the drafter merges its two batches into one and the verifier borrows the
drafter's cores, which is how autoregressive mode runs; with drafts again the batch splits and the cores go back.
The drafter and verifier loops (workers/drafter_process.py, verifier_process.py) call these three functions;
the controller that picks k is minedraft/engine/dynamic.py.
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


def rebalance(k: int, batches: dict, batch_of: dict, removed: dict, outstanding: dict) -> None:
    """The drafter's batches for budget k. With no drafts batch 1's rows join batch 0 as soon as batch 1 is back
    from the verifier: one full batch per verify step. With drafts again, half of batch 0 moves back to batch 1
    once neither is in flight. Rows keep their drafter and verifier state (both are keyed by request, not by
    batch); only the drafter's bookkeeping moves."""
    if k == 0:
        if not outstanding[1] and (batches[1] or removed[1]):
            for rid in batches[1]:
                batch_of[rid] = 0
            batches[0].extend(batches[1])
            removed[0].extend(removed[1])
            batches[1], removed[1] = [], []
    elif not batches[1] and not outstanding[0] and not outstanding[1] and len(batches[0]) >= 2:
        half = len(batches[0]) // 2
        batches[1] = batches[0][half:]
        del batches[0][half:]
        for rid in batches[1]:
            batch_of[rid] = 1


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
