#!/usr/bin/env python
"""Dynamic speculation (the engine picks k per step from measured goodput): does it keep up with the engine's
autoregressive mode and the best fixed k, and where its steps go when it does not.

    python scripts/bench/dynamic.py ab --batch 4 16 32 --k 1 2 3 --rounds 3   # fresh engines, alternating
    python scripts/bench/dynamic.py trace --batch 16 --dynamic --reps 2       # one engine, every verdict
    (each with --target DIR --draft DIR for another pair; ab also takes --chat for held-out chat prompts)

`python scripts/bench/dynamic.py COMMAND --help` gives each command's flags and what it prints.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections import Counter

from minedraft.bench.runner import chat_prompts, corpus_prompts, run_workload
from minedraft.config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig
from minedraft.engine.engine import Engine
from minedraft.sampling_params import SamplingParams


def parser(name: str, fn) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"dynamic.py {name}", description=fn.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


# -- ab --------------------------------------------------------------------------------------------------------
async def run_setting(cfg: EngineConfig, prompts, params, reps: int, k: int | None):
    async with Engine(cfg) as engine:
        await run_workload(engine, prompts[:2], params, None)  # warm-up (and the controller's first steps)
        if k is not None:
            engine.scheduler.set_k(k)
        rates, outs = [], None
        for _ in range(reps):
            metrics, outs = await run_workload(engine, prompts, params, None)
            rates.append(metrics["tok_s"])
        return statistics.median(rates), outs


def ab(argv) -> int:
    """Dynamic speculation against the engine's own autoregressive mode and the best fixed k, in alternation.

`minedraft bench` runs each setting's repeats back to back, one engine after another; on a shared host whose
speed drifts by 20-30% over minutes (this project's 2-core box), settings run minutes apart are not comparable
to the 10% the claim "dynamic >= max(autoregressive, best fixed k)" needs. Here every round starts a fresh engine
per setting, in a rotated order, and runs the same workload on each (warm-up, then --reps runs, all requests at
once, greedy, ignore_eos); the figures are medians over rounds of each round's median, and every output is
checked against the autoregressive one. Ratios are printed last."""
    ap = parser("ab", ab)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 16, 32])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chat", action="store_true", help="held-out chat prompts (the real pair's chat template)")
    ap.add_argument("--kv-cache-tokens", type=int, default=65536)
    args = ap.parse_args(argv)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    base = dict(target=args.target, draft=args.draft, max_tokens_limit=args.max_tokens,
                kv_cache_tokens=args.kv_cache_tokens)
    settings = [("autoregressive", dict(mode="autoregressive"), None),
                ("dynamic", dict(mode="minedraft", k=max(args.k), adaptive_k=True), None)]
    settings += [(f"minedraft k={k}", dict(mode="minedraft", k=max(args.k)), k) for k in args.k]
    for B in args.batch:
        if args.chat:
            from transformers import AutoTokenizer
            prompts = chat_prompts(AutoTokenizer.from_pretrained(args.target, local_files_only=True), B)
        else:
            prompts = corpus_prompts(B, 0)
        got: dict[str, list[float]] = {name: [] for name, _, _ in settings}
        same = True
        for r in range(args.rounds):
            order = settings[r % len(settings):] + settings[:r % len(settings)]
            outs = {}
            for name, kw, k in order:
                cfg = EngineConfig(**base, **kw, max_batch_size=B)
                rate, outs[name] = asyncio.run(run_setting(cfg, prompts, params, args.reps, k))
                got[name].append(rate)
                print(f"B={B} round {r}: {name:18s} {rate:8.1f} tok/s", flush=True)
            same &= all(o == outs["autoregressive"] for o in outs.values())
        med = {name: statistics.median(v) for name, v in got.items()}
        fixed = max((n for n in med if n.startswith("minedraft k=")), key=med.get)
        best_other = max(med["autoregressive"], med[fixed])
        print(f"B={B}: " + ", ".join(f"{n} {v:.1f}" for n, v in med.items()) + f"; outputs identical: {same}")
        print(f"RATIO B={B}: dynamic / max(autoregressive, best fixed k ({fixed})) = "
              f"{med['dynamic'] / best_other:.2f}  (dynamic / autoregressive {med['dynamic'] / med['autoregressive']:.2f},"
              f" dynamic / {fixed} {med['dynamic'] / med[fixed]:.2f})", flush=True)
    return 0


# -- trace -----------------------------------------------------------------------------------------------------
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


async def run_trace(args) -> None:
    kw = dict(mode="minedraft", k=args.k, adaptive_k=True) if args.dynamic else dict(mode="autoregressive")
    cfg = EngineConfig(target=args.target, draft=args.draft, max_batch_size=args.batch,
                       max_tokens_limit=args.max_tokens, **kw)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    prompts = corpus_prompts(args.batch, 0)
    async with Engine(cfg) as engine:
        log: list[tuple] = []
        engine.scheduler.verdict_listeners.append(lambda m: log.append(
            (m.k, len(m.results), m.t0, m.t1, m.more, m.prefill)))
        await run_workload(engine, prompts[:2], params, None)  # warm-up, as `dynamic.py ab` does
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


def trace(argv) -> int:
    """Where the steps of one engine go: budgets chosen, rows per step, verifier busy share, leases, per-step time.

`dynamic.py ab` says whether dynamic speculation keeps up with the engine's autoregressive mode;
this says why not when it does not. It runs one engine (a warm-up, then --reps runs of B requests at once,
greedy, ignore_eos), records every verdict the scheduler sees, and prints per run: tok/s, the steps at each
budget k, mean rows per step, the verifier's busy share of the run, the median gap between two verify calls,
how many verdicts ended a lease or a step (`more` false), the median verify time and verdict-to-verdict time
of full plain steps; with --dynamic also the controller's measured goodput per (bucket, k) and the first
steps as k/rows:ms (p = a step that also scored prompts)."""
    ap = parser("trace", trace)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=3, help="largest budget of the dynamic controller")
    ap.add_argument("--dynamic", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--show", type=int, default=30, help="first steps to print per run (--dynamic)")
    asyncio.run(run_trace(ap.parse_args(argv)))
    return 0


COMMANDS = {"ab": ab, "trace": trace}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=COMMANDS)
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the command's flags (COMMAND --help lists them)")
    a = ap.parse_args(argv)
    return COMMANDS[a.command](a.args)


if __name__ == "__main__":
    raise SystemExit(main())
