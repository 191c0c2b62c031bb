"""A worker that dies while the engine runs leaves one ERROR line in the log naming it, how it ended and what to
change (SIGKILL: the out-of-memory killer, the KV cache setting), fails the pending requests with that sentence,
and sets engine.died (what the servers wait on to exit)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from minedraft.engine.engine import Engine
from minedraft.engine.worker_exit import describe_exit
from minedraft.errors import EngineDeadError
from minedraft.sampling_params import SamplingParams
from conftest import engine_config


@pytest.mark.parametrize("who", ["drafter", "verifier"])
async def test_sigkilled_worker_logs_one_error_line(tiny_pair, who, caplog):
    cfg = engine_config(tiny_pair, k=3, max_prompt_tokens=64, max_tokens_limit=3900, kv_cache_tokens=4096,
                        max_batch_size=4)
    caplog.set_level(logging.INFO, logger="minedraft")
    async with Engine(cfg) as engine:
        victim = engine.procs[0 if who == "drafter" else 1]
        # a request far from done when the worker dies: the kill comes at its first streamed text (a fixed sleep
        # raced a fast runner, which finished 250 tokens first)
        stream = engine.stream("the class", SamplingParams(max_tokens=3900, ignore_eos=True))
        await stream.__anext__()
        assert not engine.died.is_set()
        os.kill(victim.pid, signal.SIGKILL)
        await asyncio.wait_for(engine.died.wait(), 10)
        with pytest.raises(EngineDeadError, match="SIGKILL.*out-of-memory.*--kv-cache"):
            async for _ in stream:
                pass
    lines = [r for r in caplog.records if r.name == "minedraft.engine" and r.levelno == logging.ERROR]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    msg = lines[0].getMessage()
    assert f"minedraft-{who} (pid {victim.pid})" in msg and "SIGKILL" in msg and "--kv-cache" in msg, msg
    assert "\n" not in msg


def test_describe_exit_names_code_and_signal():
    assert describe_exit("w", 7, 3) == "worker w (pid 7) exited with code 3: it crashed (its traceback, if any, is " \
                                       "logged above)"
    assert "SIGSEGV" in describe_exit("w", 7, -signal.SIGSEGV) and "native code" in describe_exit("w", 7, -11)
    assert "SIGTERM" in describe_exit("w", None, -signal.SIGTERM) and "pid" not in describe_exit("w", None, -15)


async def test_clean_shutdown_logs_no_error(tiny_pair, caplog):
    caplog.set_level(logging.INFO, logger="minedraft")
    async with Engine(engine_config(tiny_pair, kv_cache_tokens=4096, max_prompt_tokens=64, max_tokens_limit=32,
                                    max_batch_size=2)) as engine:
        await engine.generate("the class", SamplingParams(max_tokens=4))
    assert not engine.died.is_set()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
