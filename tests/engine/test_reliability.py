"""Reliability: worker death, back-pressure, config and request validation, and a short mixed soak.

What is promised (and checked here):
  * a worker that dies (SIGKILL, os._exit, an exception inside its loop) fails every pending request, waiting
    or running, generate or stream, with EngineDeadError within 2 s; the other worker is stopped, the shared
    memory is unlinked, later calls raise EngineDeadError at once, health() says not ok, shutdown() is clean;
  * the bounded queue answers OverloadedError at once and the admitted requests are unaffected;
  * a bad EngineConfig raises ValueError at construction, a bad request raises InvalidRequestError at
    submission and never disturbs the requests around it;
  * after a mixed load (greedy, sampled, cancelled, invalid) both workers' caches are empty again.
The full-size soak is scripts/reliability/soak.py.
"""

from __future__ import annotations

import functools

import asyncio
import contextlib
import os
import random
import signal
import time

import pytest

from minedraft.config import EngineConfig
from minedraft.engine.engine import Engine
from minedraft.errors import EngineDeadError, InvalidRequestError, OverloadedError
from minedraft.engine.local_engine import LocalEngine
from minedraft.sampling_params import SamplingParams
from minedraft.engine.diagnostics import process_alive as _alive, shm_exists as _shm_exists
from conftest import engine_config

WORDS = ("the for statement while class def return import lambda yield with try except raise global "
         "nonlocal object method function module").split()

DEATH_S = 2.0   # every pending request must have failed this long after a worker died


_cfg = functools.partial(engine_config, k=3, max_prompt_tokens=128, max_tokens_limit=512, kv_cache_tokens=16384, max_batch_size=32)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _prompt(rng: random.Random, lo: int = 1, hi: int = 16, tok=None, max_tokens: int = 0) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    while tok is not None and len(words) > 1 and len(tok.encode(" ".join(words))) > max_tokens:
        words.pop()
    return " ".join(words)


async def _until(pred, timeout: float, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(step)
    return True


async def _drained(engine, timeout: float = 5.0) -> dict:
    """KV usage once the workers have caught up (they apply the last verdicts/aborts a step after we see them)."""
    deadline = time.monotonic() + timeout
    while True:
        usage = await engine.kv_usage()
        if all(v == 0 for part in usage.values() for v in part.values()) or time.monotonic() > deadline:
            return usage
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """Target-alone greedy decoding, in process: the ground truth."""
    ref = LocalEngine(_cfg(tiny_pair, mode="autoregressive"))

    def run(prompts, max_tokens):
        return [r.token_ids for r in ref.generate(list(prompts), [_greedy(m) for m in max_tokens])]
    return run


# -- worker death ----------------------------------------------------------------------------------------------
DEATHS = [
    pytest.param("verifier", "kill", id="sigkill-verifier"),
    pytest.param("drafter", "kill", id="sigkill-drafter"),
    pytest.param("verifier", "raise", id="exception-in-verifier"),
    pytest.param("drafter", "raise", id="exception-in-drafter"),
    pytest.param("verifier", "exit", id="os_exit-in-verifier"),
]


@pytest.mark.parametrize("who,how", DEATHS)
async def test_worker_death_fails_every_pending_request(tiny_pair, who, how):
    fault = None
    if how != "kill":
        fault = [who, "verify" if who == "verifier" else "draft", 4, how]
    # max_batch_size 8 of 16 requests: half are running in the workers, half wait in the scheduler
    engine = await Engine.start(_cfg(tiny_pair, max_batch_size=8), fault=fault)
    pids = [p.pid for p in engine.procs]
    victim = pids[0 if who == "drafter" else 1]
    shm_names = [s.name for s in engine._shm]
    tmp = engine._tmp
    assert shm_names and all(_shm_exists(n) for n in shm_names)
    rng = random.Random(7)
    t_submit = time.monotonic()
    last_delta = [t_submit]
    failed_at: dict[int, float] = {}
    errors: dict[int, BaseException] = {}
    deltas: dict[int, int] = {}

    async def gen(i):
        try:
            await engine.generate(_prompt(rng), _greedy(500))
        except BaseException as e:  # noqa: BLE001 - recorded and checked below
            failed_at[i], errors[i] = time.monotonic(), e

    async def stream(i):
        deltas[i] = 0
        try:
            async for _ in engine.stream(_prompt(rng), _greedy(500)):
                deltas[i] += 1
                last_delta[0] = time.monotonic()
        except BaseException as e:  # noqa: BLE001
            failed_at[i], errors[i] = time.monotonic(), e

    tasks = [asyncio.ensure_future(gen(i) if i % 2 else stream(i)) for i in range(16)]
    try:
        if how == "kill":
            # every running stream has produced output, so the kill lands mid-generation
            assert await _until(lambda: all(deltas.get(i, 0) > 0 for i in range(0, 8, 2)), 20)
            s = engine.stats()
            assert s["running"] == 8 and s["waiting"] == 8, s
            t_dead = time.monotonic()
            os.kill(victim, signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        if how != "kill":
            # the fault fired after the last verdict that reached us (or, if none did, after submission)
            t_dead = max(t_submit, last_delta[0])
    finally:
        for t in tasks:
            t.cancel()

    # every pending request failed, with EngineDeadError, quickly
    assert sorted(errors) == list(range(16))
    assert all(isinstance(e, EngineDeadError) for e in errors.values()), errors
    latency = max(failed_at.values()) - t_dead
    assert latency < DEATH_S, f"pending requests failed {latency:.2f} s after the worker died"
    msg = str(errors[0])
    assert all(str(e) == msg for e in errors.values())
    assert who in msg
    if how == "raise":
        assert "Traceback (most recent call last)" in msg
        assert f"RuntimeError: injected fault in {who} at" in msg
    elif how == "exit":
        assert "exited with code 3" in msg
    else:
        assert "killed by SIGKILL" in msg

    # the other worker is stopped and the shared memory is gone
    assert await _until(lambda: not any(_alive(p) for p in pids), DEATH_S), \
        [p for p in pids if _alive(p)]
    assert await _until(lambda: not any(_shm_exists(n) for n in shm_names), DEATH_S)

    # later calls fail at once
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):
        await engine.generate("the class", _greedy(4))
    with pytest.raises(EngineDeadError):
        async for _ in engine.stream("the class", _greedy(4)):
            pass
    with pytest.raises(EngineDeadError):
        await engine.kv_usage()
    assert time.monotonic() - t0 < 0.1
    h = engine.health()
    assert h["ok"] is False and not h["drafter_alive"] and not h["verifier_alive"] and who in h["error"]
    assert engine.stats()["failed"] == 16

    # shutdown after death: no exception, nothing left behind
    await asyncio.wait_for(engine.shutdown(), 10)
    await engine.shutdown()  # idempotent
    assert not any(_alive(p) for p in pids)
    assert not os.path.exists(tmp)


async def test_shutdown_during_load_fails_pending_with_engine_dead(tiny_pair):
    """Not a crash, but the same promise: an orderly shutdown under load ends every request, none hangs."""
    engine = await Engine.start(_cfg(tiny_pair, max_batch_size=4))
    pids = [p.pid for p in engine.procs]
    rng = random.Random(3)
    tasks = [asyncio.ensure_future(engine.generate(_prompt(rng), _greedy(400))) for _ in range(10)]
    await asyncio.sleep(0.2)
    await asyncio.wait_for(engine.shutdown(), 10)
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    assert all(isinstance(r, EngineDeadError) for r in done), done
    assert not any(_alive(p) for p in pids)


# -- back-pressure and limits ----------------------------------------------------------------------------------
async def test_overload_rejects_excess_at_once_and_admitted_complete(tiny_pair, reference):
    rng = random.Random(11)
    prompts = [_prompt(rng) for _ in range(14)]
    max_tokens = 48
    async with Engine(_cfg(tiny_pair, max_queue=4, max_batch_size=2)) as engine:
        t0 = time.monotonic()
        done_at: dict[int, float] = {}

        async def one(i):
            try:
                if i == 13:  # a stream over the bound raises on its first iteration
                    async for _ in engine.stream(prompts[i], _greedy(max_tokens)):
                        pass
                    return None
                return await engine.generate(prompts[i], _greedy(max_tokens))
            finally:
                done_at[i] = time.monotonic() - t0

        peak = {"running": 0, "waiting": 0}

        async def watch():
            while True:
                s = engine.stats()
                peak["running"] = max(peak["running"], s["running"])
                peak["waiting"] = max(peak["waiting"], s["waiting"])
                await asyncio.sleep(0.005)

        w = asyncio.ensure_future(watch())
        # every submission happens in the same loop tick: 2 run, 4 wait, the other 8 are over the queue bound
        results = await asyncio.wait_for(
            asyncio.gather(*(one(i) for i in range(14)), return_exceptions=True), 60)
        w.cancel()
        over = [i for i, r in enumerate(results) if isinstance(r, OverloadedError)]
        ok = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
        assert over == list(range(6, 14)) and ok == list(range(6)), results
        assert "max_queue=4" in str(results[6])
        # rejected at once: before any admitted request has produced its output
        assert max(done_at[i] for i in over) < 0.05
        assert max(done_at[i] for i in over) < min(done_at[i] for i in ok)
        assert peak["running"] <= 2 and peak["waiting"] <= 4
        assert [results[i].token_ids for i in ok] == reference([prompts[i] for i in ok], [max_tokens] * 6)
        # once the queue has room again, new requests are accepted
        again = await engine.generate(prompts[7], _greedy(max_tokens))
        assert again.token_ids == reference([prompts[7]], [max_tokens])[0]
        assert engine.stats()["failed"] == 0 and engine.health()["ok"]


BAD_CONFIGS = [
    (dict(k=0), r"k must be in 1\.\.16, got 0"),
    (dict(k=17), r"k must be in 1\.\.16"),
    (dict(k=2.5), r"k must be an int"),
    (dict(k=True), r"k must be an int"),
    (dict(max_batch_size=0), r"max_batch_size must be >= 1, got 0"),
    (dict(max_queue=0), r"max_queue must be >= 1"),
    (dict(block_size=0), r"block_size must be >= 1"),
    (dict(max_prompt_tokens=0), r"max_prompt_tokens must be >= 1"),
    (dict(max_tokens_limit=-1), r"max_tokens_limit must be >= 1"),
    (dict(kv_cache_tokens=128, max_prompt_tokens=100, max_tokens_limit=64),
     r"kv_cache_tokens=128 \(8 blocks of 16\) cannot hold even one request of .* = 169 positions"),
    (dict(mode="turbo"), r"mode must be one of \('minedraft', 'sequential', 'autoregressive', 'auto'\), got 'turbo'"),
    (dict(dtype="int8"), r"dtype must be"),
    (dict(target_device="tpu"), r"target_device must be 'auto', 'cpu' or 'cuda:N'"),
    (dict(target="/nonexistent/model"), r"target model path '/nonexistent/model' is not a directory"),
    (dict(draft="/nonexistent/draft"), r"draft model path '/nonexistent/draft' is not a directory"),
]


@pytest.mark.parametrize("overrides,match", BAD_CONFIGS, ids=[str(c[0]) for c in BAD_CONFIGS])
def test_bad_config_raises_value_error_at_construction(tiny_pair, overrides, match):
    base = dict(target=tiny_pair.target, draft=tiny_pair.draft, max_prompt_tokens=64, max_tokens_limit=64,
                kv_cache_tokens=4096)
    base.update(overrides)
    with pytest.raises(ValueError, match=match) as info:
        EngineConfig(**base)
    assert str(info.value).startswith("invalid EngineConfig: ")
    with pytest.raises(ValueError, match=match):  # the Engine's own keyword form validates the same way
        Engine(**base)


def test_good_config_edges_are_accepted(tiny_pair):
    need = 64 + 64 + 3 + 1          # 132 positions = 9 blocks of 16: exactly 144 tokens of cache
    EngineConfig(target=tiny_pair.target, draft=tiny_pair.draft, k=3, max_prompt_tokens=64, max_tokens_limit=64,
                 kv_cache_tokens=-(-need // 16) * 16)
    with pytest.raises(ValueError, match="9 blocks"):  # one token short of the last whole block
        EngineConfig(target=tiny_pair.target, draft=tiny_pair.draft, k=3, max_prompt_tokens=64,
                     max_tokens_limit=64, kv_cache_tokens=-(-need // 16) * 16 - 1)
    EngineConfig(target=tiny_pair.target, draft=tiny_pair.draft, k=16, max_batch_size=1, max_queue=1,
                 kv_cache_tokens=4096, max_prompt_tokens=64, max_tokens_limit=64, mode="autoregressive")


# -- a bad request never takes down others ---------------------------------------------------------------------
def _invalid_requests(vocab: int, cfg: EngineConfig) -> list[tuple[object, object, str]]:
    """(prompt, params, what the error message must mention)."""
    long_ids = [5] * (cfg.max_prompt_tokens + 1)
    return [
        ("the class", {"temperature": -1.0}, "temperature"),
        ("the class", {"temperature": float("nan")}, "temperature"),
        ("the class", {"top_p": 0.0}, "top_p"),
        ("the class", {"top_k": -3}, "top_k"),
        ("the class", {"max_tokens": 0}, "max_tokens"),
        ("the class", {"max_tokens": cfg.max_tokens_limit + 1}, "exceeds the engine's limit"),
        ("the class", {"bogus": 1}, "unknown field"),
        ("the class", {"stop": [""]}, "stop strings"),
        ("the class", {"seed": -1}, "seed"),
        ("the class", {"ignore_eos": "yes"}, "ignore_eos"),
        ("the class", {"stop_token_ids": 7}, "SamplingParams"),
        ("the class", 42, "params must be"),
        ("", None, "empty"),
        ([], None, "no tokens"),
        ([vocab], None, "token ids"),
        ([1, -1], None, "token ids"),
        ([1, True], None, "token ids"),
        (12345, None, "prompt must be"),
        (long_ids, None, "max_prompt_tokens"),
        ("x" * (16 * cfg.max_prompt_tokens + 1), None, "characters"),
    ]


async def test_invalid_requests_fail_alone(tiny_pair, tiny_tokenizer, reference):
    cfg = _cfg(tiny_pair, max_prompt_tokens=64, max_tokens_limit=64, max_batch_size=8)
    rng = random.Random(5)
    bad = _invalid_requests(tiny_pair.vocab_size, cfg)
    good = [(_prompt(rng, tok=tiny_tokenizer, max_tokens=64), rng.randint(8, 40)) for _ in range(12)]
    async with Engine(cfg) as engine:
        t0 = time.monotonic()
        rejected_at: dict[int, float] = {}

        async def bad_one(i, prompt, params):
            try:
                if i % 2:
                    await engine.generate(prompt, params)
                else:
                    async for _ in engine.stream(prompt, params):
                        pass
            except InvalidRequestError as e:
                rejected_at[i] = time.monotonic() - t0
                return e
            return None

        # interleaved: good, bad, good, bad, ... all submitted in the same tick
        coros = []
        for i in range(max(len(good), len(bad))):
            if i < len(good):
                coros.append(engine.generate(good[i][0], _greedy(good[i][1])))
            if i < len(bad):
                coros.append(bad_one(i, *bad[i][:2]))
        # and a duplicate request id next to its original
        # and a duplicate request id next to its original (tasks start in creation order)
        same = asyncio.ensure_future(engine.generate(good[0][0], _greedy(good[0][1]), request_id="same"))
        dup = asyncio.ensure_future(engine.generate("the def", _greedy(4), request_id="same"))
        out = await asyncio.wait_for(asyncio.gather(*coros, same, dup, return_exceptions=True), 60)
        stats = engine.stats()
        usage = await _drained(engine)
    results = [r for r in out[:-2] if not isinstance(r, (InvalidRequestError, type(None)))]
    errs = [r for r in out[:-2] if isinstance(r, InvalidRequestError) or r is None]
    assert len(errs) == len(bad) and len(results) == len(good), out
    for (prompt, params, needle), e in zip(bad, errs):
        assert isinstance(e, InvalidRequestError), (prompt, params, e)
        assert needle in str(e), (params, str(e))
    assert max(rejected_at.values()) < 0.1  # at submission, not after some generation
    assert [r.token_ids for r in results] == reference([g[0] for g in good], [g[1] for g in good])
    assert out[-2].token_ids == results[0].token_ids  # the original "same" finished...
    assert isinstance(out[-1], InvalidRequestError) and "already in use" in str(out[-1])  # ...its twin did not
    assert stats["failed"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert all(v == 0 for part in usage.values() for v in part.values()), usage


async def test_unencodable_params_are_rejected_at_submission_and_hurt_no_one(tiny_pair, reference):
    async with Engine(_cfg(tiny_pair, max_batch_size=1)) as engine:
        # admitted at once: must be InvalidRequestError, and leave no slot or block behind
        with pytest.raises(InvalidRequestError):
            await asyncio.wait_for(engine.generate("the class", {"top_k": 2**64, "max_tokens": 4}), 10)
        s = engine.stats()
        assert s["running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"], s
        # queued behind a running request: must be refused at submission, and the others must finish
        a = asyncio.ensure_future(engine.generate("the class", _greedy(32)))
        b = asyncio.ensure_future(engine.generate("the def", {"stop_token_ids": [2**64], "max_tokens": 4}))
        c = asyncio.ensure_future(engine.generate("the for", _greedy(8)))
        ra, rb, rc = await asyncio.wait_for(asyncio.gather(a, b, c, return_exceptions=True), 30)
        assert isinstance(rb, InvalidRequestError), rb
        assert [ra.token_ids, rc.token_ids] == reference(["the class", "the for"], [32, 8])


async def test_scheduler_internal_error_fails_requests_instead_of_hanging(tiny_pair):
    async with Engine(_cfg(tiny_pair)) as engine:
        def broken_hook(m):
            raise RuntimeError("bug in a verdict hook")
        engine.scheduler.verdict_listeners.append(broken_hook)
        tasks = [asyncio.ensure_future(engine.generate(f"the class {i}", _greedy(64))) for i in range(4)]
        done, pending = await asyncio.wait(tasks, timeout=5)
        for t in pending:
            t.cancel()
        assert not pending, "requests hang after an internal scheduler error"
        assert all(isinstance(t.exception(), EngineDeadError) for t in done)
        assert "bug in a verdict hook" in str(tasks[0].exception())
        assert not engine.health()["ok"]


# -- short soak ------------------------------------------------------------------------------------------------
SOAK_N = 80


async def test_short_soak_mixed_load_leaves_cache_empty(tiny_pair, tiny_tokenizer, reference):
    cfg = _cfg(tiny_pair, max_prompt_tokens=96, max_tokens_limit=64, kv_cache_tokens=2048, max_batch_size=12)
    rng = random.Random(2024)
    bad_pool = _invalid_requests(tiny_pair.vocab_size, cfg)
    plan = []
    for i in range(SOAK_N):
        u = rng.random()
        kind = "invalid" if u < 0.1 else "cancel" if u < 0.3 else "sampled" if u < 0.5 else "greedy"
        if rng.random() < 0.3:  # token-id prompts up to the limit
            prompt = [rng.randrange(1, tiny_pair.vocab_size) for _ in range(rng.randint(1, cfg.max_prompt_tokens))]
        else:
            prompt = _prompt(rng, 1, 30, tiny_tokenizer, cfg.max_prompt_tokens)
        m = rng.randint(1, cfg.max_tokens_limit)
        if kind == "sampled":
            params = SamplingParams(temperature=rng.choice([0.7, 1.0, 1.3]), top_k=rng.choice([0, 20]),
                                    top_p=rng.choice([1.0, 0.9]), max_tokens=m, seed=i)
        else:
            params = SamplingParams(max_tokens=max(m, 24) if kind == "cancel" else m,
                                    ignore_eos=rng.random() < 0.5)
        if kind == "invalid":
            prompt, params, _ = bad_pool[i % len(bad_pool)]
        plan.append(dict(i=i, kind=kind, prompt=prompt, params=params, stream=rng.random() < 0.5,
                         delay=rng.random() * 1.5, cancel_after=rng.randint(1, 3), how=rng.choice("bat")))

    async def run(engine, p):
        await asyncio.sleep(p["delay"])
        rid = f"soak-{p['i']}"
        if p["kind"] == "cancel":
            tokens = []
            if p["how"] == "b":  # break out of the stream
                async with contextlib.aclosing(engine.stream(p["prompt"], p["params"], request_id=rid)) as it:
                    async for d in it:
                        tokens += d.token_ids
                        if d.finished or len(tokens) >= p["cancel_after"]:
                            break
                return ("cancelled", tokens, None)
            task = asyncio.ensure_future(engine.generate(p["prompt"], p["params"], request_id=rid))
            await asyncio.sleep(0.02 * p["cancel_after"])
            if p["how"] == "a":  # abort by id: generate returns what it has, finish_reason "abort"
                await engine.abort(rid)
                r = await task
                return ("cancelled", r.token_ids, r.finish_reason)
            task.cancel()  # cancel the awaiting task
            try:
                r = await task
                return ("cancelled", r.token_ids, r.finish_reason)  # finished before the cancel landed
            except asyncio.CancelledError:
                return ("cancelled", None, None)
        try:
            if p["stream"]:
                tokens, reason = [], None
                async for d in engine.stream(p["prompt"], p["params"], request_id=rid):
                    tokens += d.token_ids
                    reason = d.finish_reason
                return ("done", tokens, reason)
            r = await engine.generate(p["prompt"], p["params"], request_id=rid)
            return ("done", r.token_ids, r.finish_reason)
        except InvalidRequestError as e:
            return ("invalid", None, str(e))

    t0 = time.monotonic()
    async with Engine(cfg) as engine:
        out = await asyncio.wait_for(asyncio.gather(*(run(engine, p) for p in plan)), 60)
        usage = await _drained(engine)
        stats = engine.stats()
        healthy = engine.health()["ok"]
    wall = time.monotonic() - t0

    greedy = [p for p in plan if p["kind"] in ("greedy", "cancel")]
    ref = dict(zip((p["i"] for p in greedy), reference(
        [p["prompt"] for p in greedy],
        [p["params"].max_tokens for p in greedy]) if greedy else []))
    eos = tiny_pair.eos_token_id
    for p, (status, tokens, info) in zip(plan, out):
        kind, i = p["kind"], p["i"]
        if kind == "invalid":
            assert status == "invalid", (p, status)
            continue
        assert status == ("cancelled" if kind == "cancel" else "done"), (p, status)
        if tokens is None:
            continue  # task cancelled
        assert len(tokens) <= p["params"].max_tokens and all(0 <= t < tiny_pair.vocab_size for t in tokens)
        if kind == "sampled":
            assert info in ("length", "stop") and (info == "stop" or len(tokens) == p["params"].max_tokens)
            continue
        expect = ref[i]
        if not p["params"].ignore_eos and eos in expect:
            expect = expect[:expect.index(eos) + 1]  # the reference ran with ignore_eos; eos ends the request
        if kind == "greedy":
            assert tokens == expect, (i, p["prompt"])
            assert info == ("length" if len(expect) == p["params"].max_tokens else "stop")
        else:
            assert tokens == expect[:len(tokens)], (i, p["prompt"])  # a cancelled one is a prefix
    assert all(v == 0 for part in usage.values() for v in part.values()), usage
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["failed"] == 0
    assert healthy
    assert wall < 40, f"soak took {wall:.1f} s"


def test_a_script_without_the_main_guard_is_named_in_one_sentence(tmp_path):
    """An embedded-API script that starts an Engine at import time: every spawned worker re-runs it. It used to
    end in 159 lines of multiprocessing tracebacks and 'worker exited during start-up (code 1)' (issue 35)."""
    import os
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text("import asyncio\nfrom minedraft import Engine\n\n\nasync def main():\n"
                      "    async with Engine() as e:\n        await e.generate('The while', {'max_tokens': 2})\n\n\n"
                      "asyncio.run(main())\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode != 0
    assert 'has no `if __name__ == "__main__":` guard' in r.stderr.splitlines()[-1]
    assert "bootstrapping phase" not in r.stderr and len(r.stderr.splitlines()) < 40
