"""Worker cores: the default split, explicit sets and their validation, and that the worker processes really run
pinned to their sets with that many torch threads."""

from __future__ import annotations

import functools

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minedraft.cli import main as cli
from minedraft.config import EngineConfig
from minedraft.cores import available_cores, default_split, format_cores, parse_cores, resolve, threads_for
from minedraft.engine.engine import Engine
from conftest import engine_config

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity (Linux)")


def test_parse_cores():
    assert parse_cores("0") == [0]
    assert parse_cores("1-3") == [1, 2, 3]
    assert parse_cores("4, 0-1,1") == [0, 1, 4]
    for bad in ("", "a", "3-1", "-1", "1-", "1,,2"):
        with pytest.raises(ValueError):
            parse_cores(bad)


@given(st.sets(st.integers(0, 300), min_size=1))
def test_format_cores_round_trips(cores):
    assert parse_cores(format_cores(sorted(cores))) == sorted(cores)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 16, 17])
def test_default_split(n):
    cores = list(range(10, 10 + n))
    d, t = default_split(cores, "minedraft")
    if n == 1:
        assert d == t == cores  # nothing to split: both share the one core
    else:
        assert set(d).isdisjoint(t) and sorted(d + t) == cores  # disjoint, every core used
        assert len(t) - len(d) == n % 2  # verifier takes the odd core
    for mode in ("sequential", "autoregressive"):  # they take turns: each gets every core
        assert default_split(cores, mode) == (cores, cores)


def test_resolve_explicit_and_errors():
    allowed = [0, 1, 2, 3]
    assert resolve([0], [1, 2, 3], "minedraft", allowed) == ([0], [1, 2, 3])
    assert resolve([3], None, "minedraft", allowed) == ([3], [0, 1, 2])  # the other worker gets the rest
    assert resolve(None, [0, 1], "sequential", allowed) == ([0, 1], [0, 1])  # the other shares the given set
    assert resolve(None, [2], "autoregressive", allowed) == ([2], [2])
    with pytest.raises(ValueError, match="draft_cores and target_cores share cores \\[1\\]"):
        resolve([0, 1], [1, 2], "minedraft", allowed)
    assert resolve([0, 1], [1, 2], "sequential", allowed) == ([0, 1], [1, 2])  # turns: overlap is fine
    with pytest.raises(ValueError, match="target_cores has cores \\[9\\]"):
        resolve(None, [2, 9], "minedraft", allowed)
    with pytest.raises(ValueError, match="draft_cores must be a non-empty list"):
        resolve([], None, "minedraft", allowed)
    with pytest.raises(ValueError, match="target_cores must hold integer"):
        resolve(None, [1.5], "minedraft", allowed)
    with pytest.raises(ValueError, match="target_cores: no allowed core is left"):
        resolve([0, 1, 2, 3], None, "minedraft", allowed)


def test_engine_config_validates_cores(tiny_pair):
    allowed = available_cores()
    outside = max(allowed) + 1
    with pytest.raises(ValueError, match=f"invalid EngineConfig: draft_cores has cores \\[{outside}\\]"):
        EngineConfig(target=tiny_pair.target, draft=tiny_pair.draft, draft_cores=[outside])
    with pytest.raises(ValueError, match="invalid EngineConfig: bad core list"):
        EngineConfig(target=tiny_pair.target, draft=tiny_pair.draft, target_cores="x")
    cfg = EngineConfig(target=tiny_pair.target, draft=tiny_pair.draft, target_cores=f"{allowed[0]}-{allowed[0]}",
                       mode="sequential")
    assert cfg.target_cores == [allowed[0]]


def test_cli_core_flags():
    a = cli.build_parser().parse_args(["generate", "x", "--draft-cores", "0", "--target-cores", "1-3"])
    assert a.draft_cores == [0] and a.target_cores == [1, 2, 3]
    kw = cli._engine_kw(a)
    assert kw["draft_cores"] == [0] and kw["target_cores"] == [1, 2, 3]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "x", "--target-cores", "2-1"])


async def _placement(cfg: EngineConfig) -> dict:
    async with Engine(cfg) as engine:
        seen = await engine.placement()
        pids = {"drafter": engine.procs[0].pid, "verifier": engine.procs[1].pid}
        for who, pid in pids.items():  # from outside the workers too: what the kernel says
            assert sorted(os.sched_getaffinity(pid)) == seen[who]["cores"]
        r = await engine.generate("for while", {"max_tokens": 4, "ignore_eos": True})
        assert len(r.token_ids) == 4
    return seen


_cfg = functools.partial(engine_config, k=2, max_prompt_tokens=64, max_tokens_limit=16, kv_cache_tokens=2048)


def test_threads_for_caps_by_env(monkeypatch):
    monkeypatch.delenv("MINEDRAFT_WORKER_THREADS", raising=False)
    assert threads_for([0, 1, 2]) == 3 and threads_for(None) == 1
    monkeypatch.setenv("MINEDRAFT_WORKER_THREADS", "2")
    assert threads_for([0, 1, 2]) == 2 and threads_for([5]) == 1


def _pin(worker: dict) -> dict:
    """A worker's placement without its model's figures (weights, self-draft scheme)."""
    return {k: worker[k] for k in ("cores", "threads")}


@pytest.fixture
def uncapped(monkeypatch):
    """Workers spawned in the test see no thread cap (conftest sets one for the rest of the suite)."""
    monkeypatch.delenv("MINEDRAFT_WORKER_THREADS", raising=False)


async def test_workers_pinned_by_default_split(tiny_pair, uncapped):
    allowed = available_cores()
    d, t = default_split(allowed, "minedraft")
    seen = await _placement(_cfg(tiny_pair, mode="minedraft"))
    assert _pin(seen["drafter"]) == {"cores": d, "threads": len(d)}
    assert _pin(seen["verifier"]) == {"cores": t, "threads": len(t)}
    seen = await _placement(_cfg(tiny_pair, mode="autoregressive"))
    assert _pin(seen["verifier"]) == {"cores": allowed, "threads": len(allowed)}  # target alone gets every core
    assert seen["drafter"]["cores"] == allowed  # the relay shares them (short hand-over between steps)


@pytest.mark.skipif(len(available_cores()) < 2, reason="needs two allowed cores")
async def test_workers_pinned_to_explicit_cores(tiny_pair, uncapped):
    allowed = available_cores()
    seen = await _placement(_cfg(tiny_pair, mode="minedraft", draft_cores=[allowed[-1]], target_cores=allowed[:-1]))
    assert _pin(seen["drafter"]) == {"cores": [allowed[-1]], "threads": 1}
    assert _pin(seen["verifier"]) == {"cores": allowed[:-1], "threads": len(allowed) - 1}


def _environ(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="needs /proc")
async def test_workers_wait_passively_unless_the_user_chose(tiny_pair, monkeypatch):
    """Workers start with OMP_WAIT_POLICY=PASSIVE (spinning OpenMP threads collapse on a loaded host), the caller's
    environment is left as it was, and a policy the user set is kept."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cfg = engine_config(tiny_pair, kv_cache_tokens=2048, max_prompt_tokens=64, max_tokens_limit=16, max_batch_size=2)
    async with Engine(cfg) as engine:
        assert all(_environ(p.pid).get(b"OMP_WAIT_POLICY") == b"PASSIVE" for p in engine.procs)
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    async with Engine(cfg) as engine:
        assert all(_environ(p.pid).get(b"OMP_WAIT_POLICY") == b"ACTIVE" for p in engine.procs)
