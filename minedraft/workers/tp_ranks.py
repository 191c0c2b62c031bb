"""Tensor-parallel workers: rank 0 keeps the drafter's or verifier's ZeroMQ role, ranks 1..N-1 follow it.

Rank 0 runs the usual Drafter/Verifier state machine on a LeaderRunner. Every KV-cache change it makes
(allocate, free, truncate) is recorded, and each forward call sends the recorded changes plus the forward's
inputs to the other ranks as a flat int64 tensor (the step description: one broadcast, two for long
prefills); they replay it on
their own ModelRunner, so block tables, lengths and the ragged grouping of the forward are identical on every
rank and the collectives inside the forward line up. Only rank 0 samples and talks to the scheduler.

Two process groups: the step broadcast runs on a gloo group with a long timeout (a follower waiting for the next
step is normal idleness), the forward's all_reduce/gather on a gloo (CPU) or NCCL (GPU) group with tp_timeout_s, so
a rank stuck in a collective raises instead of hanging. Rank 0's side of the step broadcast is bounded by
tp_timeout_s too (an async broadcast waited on with that timeout): a follower that is stopped or frozen never
takes the step, and rank 0 then raises and reports it instead of waiting for days. The engine's watchdog watches
every rank's process.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..ipc.messages import WorkerSpec
from .drafter_process import DrafterProcess
from .process import _Worker
from .verifier_process import VerifierProcess
from ..runner.tensor_parallel import Shard, load_sharded

ALLOC, FREE, TRUNC, FORWARD, STOP = 1, 2, 3, 4, 5
HEADER = 512       # int64s in the first broadcast (4 KB): a decode step at B=32, k=4 needs 323, so one suffices
IDLE = timedelta(days=7)


# -- the step description ----------------------------------------------------------------------------------------
def encode_forward(seq_ids, token_lists, num_logits: int) -> list[int]:
    """[FORWARD, num_logits, B, rid*B, len*B, tokens...]"""
    out = [FORWARD, num_logits, len(seq_ids), *seq_ids, *(len(t) for t in token_lists)]
    for t in token_lists:
        out.extend(t)
    return out


class StepTimeout(RuntimeError):
    pass


def _bounded_broadcast(t: torch.Tensor, group, timeout: timedelta | None) -> None:
    if timeout is None:
        dist.broadcast(t, 0, group=group)
        return
    work = dist.broadcast(t, 0, group=group, async_op=True)
    try:
        work.wait(timeout)
    except RuntimeError as e:
        raise StepTimeout(f"a tensor-parallel follower did not take the next step within "
                          f"tp_timeout_s={timeout.total_seconds():g} s (stopped, frozen or dead rank): {e}") from e


def send_step(ops: list[int], group, timeout: timedelta | None = None) -> None:
    """One broadcast when the step fits HEADER (element 0 is the total length), a second for the rest.
    The sender waits at most `timeout` for the followers to take it (they wait without limit)."""
    buf = torch.zeros(HEADER, dtype=torch.long)
    n = len(ops)
    buf[0] = n
    buf[1:1 + min(n, HEADER - 1)] = torch.tensor(ops[:HEADER - 1], dtype=torch.long)
    _bounded_broadcast(buf, group, timeout)
    if n > HEADER - 1:
        _bounded_broadcast(torch.tensor(ops[HEADER - 1:], dtype=torch.long), group, timeout)


def recv_step(group) -> list[int]:
    buf = torch.empty(HEADER, dtype=torch.long)
    dist.broadcast(buf, 0, group=group)
    n = int(buf[0])
    ops = buf[1:1 + min(n, HEADER - 1)].tolist()
    if n > HEADER - 1:
        rest = torch.empty(n - (HEADER - 1), dtype=torch.long)
        dist.broadcast(rest, 0, group=group)
        ops += rest.tolist()
    return ops


def replay(runner, ops: list[int]) -> bool:
    """Apply one step description to a follower's runner; False on STOP."""
    i, cache = 0, runner.cache
    while i < len(ops):
        op = ops[i]
        if op == ALLOC:  # rid, positions, start, n, table of n blocks (n = 0: from the follower's own free list)
            n = ops[i + 4]
            cache.allocate(ops[i + 1], ops[i + 2], ops[i + 5:i + 5 + n] if n else None, start=ops[i + 3])
            i += 5 + n
        elif op == FREE:
            cache.free(ops[i + 1])
            i += 2
        elif op == TRUNC:
            cache.truncate(ops[i + 1], ops[i + 2])
            i += 3
        elif op == FORWARD:
            n, B = ops[i + 1], ops[i + 2]
            rids, lens = ops[i + 3:i + 3 + B], ops[i + 3 + B:i + 3 + 2 * B]
            i += 3 + 2 * B
            lists = []
            for m in lens:
                lists.append(ops[i:i + m])
                i += m
            runner.forward(rids, lists, n)
        elif op == STOP:
            return False
        else:
            raise ValueError(f"bad step description op {op} at {i}")
    return True


class _RecordingCache:
    """The leader's cache: reads pass through, changes are applied and recorded for the followers."""

    def __init__(self, cache, ops: list[int]):
        self._cache, self._ops = cache, ops

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def allocate(self, seq_id, num_tokens: int, blocks=None, prompt=None, cached: int = 0) -> int:
        start = self._cache.allocate(seq_id, num_tokens, blocks, prompt, cached)  # raises before recording
        self._ops += (ALLOC, seq_id, num_tokens, start, len(blocks or ()), *(blocks or ()))
        return start

    def free(self, seq_id) -> None:
        self._cache.free(seq_id)
        self._ops += (FREE, seq_id)

    def truncate(self, seq_id, new_length: int) -> None:
        self._cache.truncate(seq_id, new_length)
        self._ops += (TRUNC, seq_id, new_length)


class LeaderRunner:
    """Rank 0's ModelRunner: the same interface; each forward first tells the followers what to do."""

    def __init__(self, runner, step_group, timeout: timedelta | None = None):
        self._runner, self._group, self._timeout = runner, step_group, timeout
        self._ops: list[int] = []
        self.cache = _RecordingCache(runner.cache, self._ops)

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def _flush(self, tail: list[int]) -> None:
        ops = self._ops + tail
        self._ops.clear()
        send_step(ops, self._group, self._timeout)

    def forward(self, seq_ids, token_lists, num_logits: int = 1, packed: bool = False):
        self._flush(encode_forward(seq_ids, token_lists, num_logits))  # followers run the same rows
        return self._runner.forward(seq_ids, token_lists, num_logits, packed=packed)

    def stop_followers(self) -> None:
        self._flush([STOP])


# -- processes ---------------------------------------------------------------------------------------------------
def _init_group(spec: WorkerSpec) -> tuple[Shard, object]:
    tp = spec.tp
    if tp.init.startswith("file://") and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host: never route via the LAN
    dist.init_process_group("gloo", init_method=tp.init, rank=tp.rank, world_size=tp.world, timeout=IDLE)
    backend = "nccl" if spec.device.startswith("cuda") else "gloo"
    compute = dist.new_group(backend=backend, timeout=timedelta(seconds=tp.timeout_s))
    return Shard(tp.rank, tp.world, compute), dist.group.WORLD


def _load_shard(spec: WorkerSpec, path: str, shard: Shard):
    from ..runner.model_files import load_vocab_map
    from ..runner.model_runner import DTYPES, ModelRunner
    model = load_sharded(path, shard, spec.device, DTYPES[spec.cfg.dtype])
    return ModelRunner(model, spec.cfg.kv_cache_tokens, spec.cfg.block_size, load_vocab_map(path))


class _Leader:
    """Mixed into DrafterProcess/VerifierProcess: load a shard, and release the followers on a clean stop."""

    def load(self, path: str):
        shard, group = _init_group(self.spec)
        runner = _load_shard(self.spec, path, shard)
        dist.barrier(group=group)      # 'ready' then means every rank holds its shard
        return LeaderRunner(runner, group, timedelta(seconds=self.spec.tp.timeout_s))

    def loop(self):
        super().loop()
        if self.runner is not None:
            self.runner.stop_followers()
            dist.destroy_process_group()


class TPVerifierProcess(_Leader, VerifierProcess):
    pass


class TPDrafterProcess(_Leader, DrafterProcess):
    pass


class FollowerProcess(_Worker):
    def setup(self):
        shard, self.group = _init_group(self.spec)
        self.runner = _load_shard(self.spec, getattr(self.spec.cfg, self.spec.tp.model), shard)
        dist.barrier(group=self.group)

    def loop(self):
        while replay(self.runner, recv_step(self.group)):
            pass
        dist.destroy_process_group()


def leader_main(spec: WorkerSpec) -> None:
    role = spec.tp.role
    (TPVerifierProcess if role == "verifier" else TPDrafterProcess)(spec, role).run()


def follower_main(spec: WorkerSpec) -> None:
    FollowerProcess(spec, f"{spec.tp.role}-rank{spec.tp.rank}").run()
