#!/usr/bin/env python
"""Per-step overhead of the engine: `Engine` in autoregressive mode (verifier pinned to one core) against two
single-thread target-alone loops on that same core that run in one process, with no IPC at all:

  * loop:  the bare verifier loop (Verifier.verify over the batch until every request is done: the model forward,
           argmax and stop checks, nothing else) -- what the verifier would do with zero per-step overhead;
  * local: LocalEngine.generate (the same plus tokenization, request state and detokenization on that core).

The two loops run in a helper process started and pinned exactly like an engine worker (same _pin, spawned,
torch imported after pinning), so the process set-up is the same on both sides and only the engine's plumbing
differs. All three decode the same prompts (greedy, ignore_eos, all submitted at once) and must agree token for
token. Rounds rotate which goes first, so drift and other load on the box hit all alike; the figures are medians
over --rounds. The engine's scheduler (this process) runs on the other cores, its idle drafter shares the
verifier's core (the default split for autoregressive mode). "verifier busy" is the share of the engine's wall
time the verifier spent in verify(); "idle between steps" is the median time from the end of one verify call to
the start of the next (the engine's hand-over: verdict to the drafter, next drafts back), from the engine's trace.

Wall-clock tok/s on a loaded box mostly measures the kernel's CPU sharing: a process that sleeps between steps
(the verifier waiting for its next message) is favoured over one that never sleeps (the bare loop), so the
engine can look faster than the loop. So the script also reports CPU cost: output tokens per second of CPU time
on the measured core (/proc/<pid>/schedstat: the loop's process; the verifier plus the drafter for the engine),
which other load barely moves; it leaves out the engine's idle hand-over time between steps, which "verifier
busy" shows. The last line is the wall-clock ratio Engine / bare loop (1.0 = no per-step overhead), the issue's
yardstick, meaningful on a quiet core.

    python scripts/bench/step_overhead.py --batch 16 --max-tokens 64 --rounds 9
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

from minedraft.bench.runner import corpus_prompts
from minedraft.config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig
try:
    from minedraft.cores import available_cores
except ImportError:  # an older minedraft (before per-worker cores), for before/after runs
    def available_cores():
        return sorted(os.sched_getaffinity(0))
from minedraft.engine.engine import Engine
from minedraft.sampling_params import SamplingParams


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--batch", type=int, default=16, help="concurrent requests (default: 16)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: 64)")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds of each (default: 9)")
    p.add_argument("--core", type=int, default=None, help="the core all run on (default: the last allowed one)")
    return p.parse_args(argv)


def loops_main(conn, core: int, kw: dict, max_tokens: int) -> None:
    """Helper process: answers (kind, prompts) with (tok/s, output ids) for kind "loop" or "local"."""
    os.sched_setaffinity(0, {core})  # as a worker pins itself (minedraft/workers/process.py _pin)
    import torch
    torch.set_num_threads(1)
    from minedraft.engine.local_engine import LocalEngine
    from minedraft.engine.request_state import make_request

    local = LocalEngine(EngineConfig(**kw))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rid = 10**6

    def run_local(prompts):
        t0 = time.perf_counter()
        res = local.generate(prompts, params)
        return sum(len(r.token_ids) for r in res) / (time.perf_counter() - t0), [r.token_ids for r in res]

    def run_loop(prompts):
        nonlocal rid
        reqs = []
        for p in prompts:  # tokenized before the clock starts: the loop is the model steps only
            rid += 1
            reqs.append(make_request(rid, p, params, local.tokenizer, local.config, local.target.vocab_size))
        v = local.verifier
        t0 = time.perf_counter()
        for r in reqs:
            v.add(r)
        out = {r.rid: [] for r in reqs}
        running = [r.rid for r in reqs]
        while running:
            res = v.verify(running, [[] for _ in running], None)
            for r in res:
                out[r.rid] += r.new_tokens
            running = [r.rid for r in res if not r.finish_reason]
        return sum(len(t) for t in out.values()) / (time.perf_counter() - t0), [out[r.rid] for r in reqs]

    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, prompts = msg
        conn.send((run_loop if kind == "loop" else run_local)(prompts))


async def main(argv=None) -> None:
    a = parse_args(argv)
    allowed = available_cores()
    core = allowed[-1] if a.core is None else a.core
    others = [c for c in allowed if c != core] or [core]
    kw = dict(target=a.target, draft=DEFAULT_DRAFT, mode="autoregressive", max_batch_size=a.batch,
              max_tokens_limit=a.max_tokens, kv_cache_tokens=16384)
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    parent, child = mp.get_context("spawn").Pipe()
    helper = mp.get_context("spawn").Process(target=loops_main, args=(child, core, kw, a.max_tokens), daemon=True)
    helper.start()

    def oncpu(pids) -> float:
        """Seconds these processes have run on a CPU (all their threads)."""
        total = 0
        for pid in pids:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
        return total / 1e9

    cpu_tok_s: dict[str, list[float]] = {"loop": [], "local": [], "engine": []}

    def run_in_helper(kind, prompts):
        c = oncpu([helper.pid])
        parent.send((kind, prompts))
        t, out = parent.recv()
        cpu_tok_s[kind].append(sum(map(len, out)) / (oncpu([helper.pid]) - c))
        return t, out

    busy: list[float] = []

    gaps: list[float] = []

    async def run_engine(engine, prompts):
        engine.scheduler.stats.trace.clear()
        before = engine.stats()["verify_time_s"]
        workers = [p.pid for p in engine.procs]
        c = oncpu(workers)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        wall = time.perf_counter() - t0
        n = sum(len(r.token_ids) for r in res)
        cpu_tok_s["engine"].append(n / (oncpu(workers) - c))
        busy.append((engine.stats()["verify_time_s"] - before) / wall)
        v = sorted((e.t0, e.t1) for e in engine.scheduler.stats.trace if e.name == "verify")
        gaps.append(statistics.median(b[0] - a[1] for a, b in zip(v, v[1:])))  # verifier idle between steps
        return n / wall, [r.token_ids for r in res]

    try:
        try:
            cfg = EngineConfig(**kw, target_cores=[core])  # the idle drafter shares it
        except TypeError:  # an older minedraft: it pins the verifier to the last allowed core, the drafter to the first
            assert core == allowed[-1], "older minedraft: only the default --core is comparable"
            cfg = EngineConfig(**kw)
        async with Engine(cfg, trace=True) as engine:
            os.sched_setaffinity(0, set(others))  # the scheduler stays off the verifier's core
            warm = corpus_prompts(4, 99)
            for kind in ("loop", "local"):
                run_in_helper(kind, warm)
            await run_engine(engine, warm)
            busy.clear()
            gaps.clear()
            for v in cpu_tok_s.values():
                v.clear()
            names = ["loop", "local", "engine"]
            tok_s: dict[str, list[float]] = {n: [] for n in names}
            for i in range(a.rounds):
                prompts = corpus_prompts(a.batch, seed=i)
                out = {}
                for who in names[i % 3:] + names[:i % 3]:
                    if who == "engine":
                        t, out[who] = await run_engine(engine, prompts)
                    else:
                        t, out[who] = run_in_helper(who, prompts)
                    tok_s[who].append(t)
                assert out["loop"] == out["local"] == out["engine"], "outputs differ: the comparison would be void"
                print(f"round {i}: " + "   ".join(f"{n} {tok_s[n][-1]:7.1f} tok/s ({cpu_tok_s[n][-1]:7.1f}/cpu-s)"
                                                    for n in names)
                      + f"   verifier busy {busy[-1]:.3f}, idle between steps {1e3 * gaps[-1]:.3f} ms", flush=True)
    finally:
        parent.send(None)
        helper.join(10)
    med = {n: statistics.median(v) for n, v in tok_s.items()}
    cpu = {n: statistics.median(v) for n, v in cpu_tok_s.items()}
    print(f"B={a.batch} max_tokens={a.max_tokens} core={core} rounds={a.rounds}, medians:")
    for n, label in (("loop", "bare loop"), ("local", "LocalEngine"), ("engine", "Engine autoregressive")):
        print(f"  {label:22s} {med[n]:8.1f} tok/s wall   {cpu[n]:8.1f} tok per cpu-s")
    print(f"  verifier busy {statistics.median(busy):.3f}; verifier idle between steps "
          f"{1e3 * statistics.median(gaps):.3f} ms (median); CPU-cost ratio Engine / bare loop = "
          f"{cpu['engine'] / cpu['loop']:.3f}, Engine / LocalEngine = {cpu['engine'] / cpu['local']:.3f}")
    print(f"ratio Engine / bare loop (wall clock; on a loaded box see the note above) = "
          f"{med['engine'] / med['loop']:.3f}")


if __name__ == "__main__":
    try:
        import uvloop
        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
