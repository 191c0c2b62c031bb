"""Liveness and shutdown: hung workers are noticed, shutdown is quick and needs no SIGKILL, a failed spawn leaks
nothing.

  * a SIGSTOPped worker (no heartbeats) fails every pending request with EngineDeadError naming it, within
    heartbeat_timeout_s plus a little, and health() says so;
  * a worker inside one step longer than the deadline is hung too; a step shorter than it is not (the
    heartbeat thread keeps beating during a long forward);
  * an idle engine shuts down in well under a second, both workers exiting on their own (exit code 0);
  * if starting a worker process raises, the shared memory is unlinked.
"""

from __future__ import annotations

import functools

import asyncio
import multiprocessing.context
import os
import signal
import time

import pytest

from minedraft.engine import engine as engine_mod
from minedraft.engine.diagnostics import process_alive, shm_exists
from minedraft.engine.engine import Engine
from minedraft.errors import EngineDeadError
from minedraft.sampling_params import SamplingParams
from conftest import engine_config

HB = 1.5  # heartbeat_timeout_s in these tests: short, so they run fast


_cfg = functools.partial(engine_config, k=3, max_prompt_tokens=64, max_tokens_limit=256, kv_cache_tokens=8192, max_batch_size=8)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


async def _collect_failures(engine, n: int, max_tokens: int = 250):
    """Start n streams; return (tasks, per-stream delta counts, per-stream outcome futures)."""
    counts = [0] * n
    outcome: dict[int, BaseException | str] = {}

    async def one(i):
        try:
            async for _ in engine.stream(f"the class statement {i}", _greedy(max_tokens)):
                counts[i] += 1
            outcome[i] = "finished"
        except BaseException as e:  # noqa: BLE001 - recorded and checked by the caller
            outcome[i] = e
    return [asyncio.ensure_future(one(i)) for i in range(n)], counts, outcome


@pytest.mark.parametrize("who", ["verifier", "drafter"])
async def test_sigstopped_worker_fails_pending_requests(tiny_pair, who):
    engine = await Engine.start(_cfg(tiny_pair, heartbeat_timeout_s=HB))
    pids = [p.pid for p in engine.procs]
    victim = pids[0 if who == "drafter" else 1]
    try:
        tasks, counts, outcome = await _collect_failures(engine, 6)
        deadline = time.monotonic() + 20
        while not all(counts) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert all(counts), counts
        assert engine.health()["ok"]
        os.kill(victim, signal.SIGSTOP)
        t_stop = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), HB + 10)
        took = time.monotonic() - t_stop
        assert all(isinstance(e, EngineDeadError) for e in outcome.values()), outcome
        msg = str(outcome[0])
        assert f"minedraft-{who}" in msg and "hung" in msg and "no heartbeat" in msg, msg
        assert HB * 0.9 < took < HB + 3, took
        h = engine.health()
        assert h["ok"] is False and who in h["error"]
        with pytest.raises(EngineDeadError):
            await engine.generate("the def", _greedy(4))
        # the stopped worker is killed (SIGKILL ends a stopped process) and the other one stopped
        t0 = time.monotonic()
        while any(process_alive(p) for p in pids) and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.05)
        assert not any(process_alive(p) for p in pids)
    finally:
        for p in pids:
            if process_alive(p):
                os.kill(p, signal.SIGKILL)
        await asyncio.wait_for(engine.shutdown(), 10)


async def test_step_longer_than_deadline_is_hung(tiny_pair):
    """The main loop stuck in one step (here a 30 s sleep standing in for a hung forward) while the heartbeat
    thread keeps beating: still hung."""
    engine = await Engine.start(_cfg(tiny_pair, heartbeat_timeout_s=HB), fault=["verifier", "verify", 2, "sleep", 30])
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="minedraft-verifier.*stuck in one step"):
            await asyncio.wait_for(engine.generate("the class", _greedy(64)), HB + 10)
        assert time.monotonic() - t0 < HB + 4
    finally:
        await asyncio.wait_for(engine.shutdown(), 10)


async def test_long_step_within_deadline_is_not_hung(tiny_pair):
    """A 2 s step under a 4 s deadline: beats keep flowing during it, and the request completes."""
    engine = await Engine.start(_cfg(tiny_pair, heartbeat_timeout_s=4.0),
                                fault=["verifier", "verify", 2, "sleep", 2.0])
    try:
        t0 = time.monotonic()
        r = await asyncio.wait_for(engine.generate("the class", _greedy(16)), 30)
        assert time.monotonic() - t0 > 2.0  # the slow step did happen
        assert len(r.token_ids) == 16 and engine.health()["ok"]
    finally:
        await asyncio.wait_for(engine.shutdown(), 10)


async def test_idle_shutdown_is_fast_and_needs_no_kill(tiny_pair):
    engine = await Engine.start(_cfg(tiny_pair))
    await engine.generate("the for statement", _greedy(8))
    procs = list(engine.procs)
    t0 = time.monotonic()
    await asyncio.wait_for(engine.shutdown(), 10)
    took = time.monotonic() - t0
    assert [p.exitcode for p in procs] == [0, 0]  # exited on their own, not SIGKILLed (-9)
    assert took < 1.0, f"idle shutdown took {took:.2f} s"


async def test_shutdown_under_load_needs_no_kill(tiny_pair):
    # Shut down once every stream has its first text, with thousands of tokens to go: a fixed sleep raced the
    # kernel runner, which can finish a few hundred tokens of the tiny pair before the sleep is over.
    engine = await Engine.start(_cfg(tiny_pair, max_tokens_limit=3900, kv_cache_tokens=8 * 4096))
    tasks, counts, outcome = await _collect_failures(engine, 8, max_tokens=3900)
    deadline = time.monotonic() + 20
    while not all(counts) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert all(counts), counts
    procs = list(engine.procs)
    t0 = time.monotonic()
    await asyncio.wait_for(engine.shutdown(), 10)
    took = time.monotonic() - t0
    await asyncio.gather(*tasks)
    assert all(isinstance(outcome[i], EngineDeadError) for i in range(8)), outcome
    assert [p.exitcode for p in procs] == [0, 0]
    assert took < 2.0, f"shutdown under load took {took:.2f} s"


async def test_failed_worker_spawn_unlinks_shared_memory(tiny_pair, monkeypatch):
    made = []
    real_create = engine_mod.create_shm

    def create(*a, **kw):
        segs = real_create(*a, **kw)
        made.extend(s.name for s in segs)
        return segs

    def broken_start(self):
        raise OSError("cannot start process (injected)")

    monkeypatch.setattr(engine_mod, "create_shm", create)
    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", broken_start)
    engine = Engine(_cfg(tiny_pair))
    with pytest.raises(OSError, match="injected"):
        await engine._start()
    assert made and not any(shm_exists(n) for n in made)
    assert engine._tmp is None or not os.path.exists(engine._tmp)
