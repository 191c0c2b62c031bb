#!/usr/bin/env python
"""Dynamic speculation against the engine's own autoregressive mode and the best fixed k, in alternation.

`minedraft bench` runs each setting's repeats back to back, one engine after another; on a shared host whose
speed drifts by 20-30% over minutes (this project's 2-core box), settings run minutes apart are not comparable
to the 10% the claim "dynamic >= max(autoregressive, best fixed k)" needs. Here every round starts a fresh engine
per setting, in a rotated order, and runs the same workload on each (warm-up, then --reps runs, all requests at
once, greedy, ignore_eos); the figures are medians over rounds of each round's median, and every output is
checked against the autoregressive one. Ratios are printed last.

    python scripts/dynamic_ab.py --batch 4 16 32 --k 1 2 3 --rounds 3
    python scripts/dynamic_ab.py --target DIR --draft DIR --chat --batch 4 16 --k 2 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from minedraft.bench.runner import chat_prompts, corpus_prompts, run_workload
from minedraft.config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig
from minedraft.engine.engine import Engine
from minedraft.sampling_params import SamplingParams


async def one(cfg: EngineConfig, prompts, params, reps: int, k: int | None):
    async with Engine(cfg) as engine:
        await run_workload(engine, prompts[:2], params, None)  # warm-up (and the controller's first steps)
        if k is not None:
            engine.scheduler.set_k(k)
        rates, outs = [], None
        for _ in range(reps):
            metrics, outs = await run_workload(engine, prompts, params, None)
            rates.append(metrics["tok_s"])
        return statistics.median(rates), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 16, 32])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chat", action="store_true", help="held-out chat prompts (the real pair's chat template)")
    ap.add_argument("--kv-cache-tokens", type=int, default=65536)
    args = ap.parse_args()
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
                rate, outs[name] = asyncio.run(one(cfg, prompts, params, args.reps, k))
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


if __name__ == "__main__":
    main()
