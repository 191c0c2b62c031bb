#!/usr/bin/env python
"""Where the steps of one engine go: budgets chosen, rows per step, verifier busy share, leases, per-step time.

`scripts/dynamic_ab.py` says whether dynamic speculation keeps up with the engine's autoregressive mode;
this says why not when it does not. It runs one engine (a warm-up, then --reps runs of B requests at once,
greedy, ignore_eos), records every verdict the scheduler sees, and prints per run: tok/s, the steps at each
budget k, mean rows per step, the verifier's busy share of the run, the median gap between two verify calls,
how many verdicts ended a lease or a step (`more` false), the median verify time and verdict-to-verdict time
of full plain steps; with --dynamic also the controller's measured goodput per (bucket, k) and the first
steps as k/rows:ms (p = a step that also scored prompts).

    python scripts/dynamic_trace.py --batch 16                # autoregressive mode
    python scripts/dynamic_trace.py --batch 16 --dynamic      # minedraft mode, dynamic speculation
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections import Counter

from minedraft.bench.runner import corpus_prompts, run_workload
from minedraft.config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig
from minedraft.engine.engine import Engine
from minedraft.sampling_params import SamplingParams


def summary(log: list[tuple], B: int) -> str:
    """log rows: (k, rows, t0, t1, more, prefill) per verdict."""
    busy = sum(t1 - t0 for _, _, t0, t1, _, _ in log)
    span = log[-1][3] - log[0][2]
    gaps = [b[2] - a[3] for a, b in zip(log, log[1:])]
    full = [(a, b) for a, b in zip(log, log[1:]) if b[0] == 0 and b[1] == B and not b[5]]
    tv = statistics.median([b[3] - b[2] for _, b in full]) if full else float("nan")
    step = statistics.median([b[3] - a[3] for a, b in full]) if full else float("nan")
    ks = dict(sorted(Counter(k for k, *_ in log).items()))
    return (f"steps {len(log)} at k {ks}, rows/step {statistics.mean(x[1] for x in log):.1f}, busy {busy / span:.3f}, "
            f"gap median {statistics.median(gaps) * 1e3:.2f} ms, hand-backs {sum(1 for x in log if not x[4])}, "
            f"full plain steps: verify {tv * 1e3:.1f} ms, verdict to verdict {step * 1e3:.1f} ms")


async def run(args) -> None:
    kw = dict(mode="minedraft", k=args.k, adaptive_k=True) if args.dynamic else dict(mode="autoregressive")
    cfg = EngineConfig(target=args.target, draft=args.draft, max_batch_size=args.batch,
                       max_tokens_limit=args.max_tokens, **kw)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    prompts = corpus_prompts(args.batch, 0)
    async with Engine(cfg) as engine:
        log: list[tuple] = []
        engine.scheduler.verdict_listeners.append(lambda m: log.append(
            (m.k, len(m.results), m.t0, m.t1, m.more, m.prefill)))
        await run_workload(engine, prompts[:2], params, None)  # warm-up, as dynamic_ab.py does
        for rep in range(args.reps):
            log.clear()
            metrics, _ = await run_workload(engine, prompts, params, None)
            print(f"run {rep}: {metrics['tok_s']:.1f} tok/s; {summary(log, args.batch)}", flush=True)
            if args.dynamic:
                ctl = engine.adaptive
                print("  goodput (bucket: {k: tok/s}):",
                      {b: {k: round(v) for k, v in t.items()} for b, t in sorted(ctl.goodput.items())})
                prev = None
                first = []
                for k, n, t0, t1, _, pf in log[:args.show]:
                    first.append(f"{k}/{n}{'p' if pf else ''}:{(t1 - (prev if prev else t0)) * 1e3:.0f}")
                    prev = t1
                print("  first steps (k/rows:ms):", " ".join(first))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=3, help="largest budget of the dynamic controller")
    ap.add_argument("--dynamic", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--show", type=int, default=30, help="first steps to print per run (--dynamic)")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
