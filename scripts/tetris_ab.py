#!/usr/bin/env python
"""Tetris against plain minedraft at equal capacity, in alternation (fresh engines, rotated order).

Plain keeps k drafts for every row; Tetris drafts k + e per row and keeps the batch's k x B best-ranked
prefixes (the default capacity), so both score the same number of draft tokens per step. On this project's
2-core box a host's speed drifts by 20-30% over minutes, so the two settings run in alternating rounds with
the same workload (warm-up, then --reps runs, all requests at once, ignore_eos; greedy unless --temperature);
figures are medians over rounds of each round's median, greedy outputs are checked against plain's, and
ratios are printed last.

With --requests above B the batches stay full until the queue drains (serving). With B requests (one closed
batch) Tetris also pays a longer ragged tail: it gives drafts to the rows it is sure of, they finish first,
and the last steps run with fewer rows.

    python scripts/tetris_ab.py --batch 16 32 --k 1 2 --rounds 3
    python scripts/tetris_ab.py --target DIR --draft DIR --chat --batch 16 32 --k 1 --max-tokens 32
    python scripts/tetris_ab.py --target DIR --draft DIR --chat --batch 16 --requests 64 --k 1 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from minedraft.bench.runner import chat_prompts, corpus_prompts, run_workload
from minedraft.config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig
from minedraft.engine.engine import Engine
from minedraft.sampling_params import SamplingParams

KEYS = ("tok_s", "out_ver", "ver_step", "td_ms", "tv_ms", "step_ms")


async def one(cfg: EngineConfig, prompts, params, reps: int):
    async with Engine(cfg) as engine:
        await run_workload(engine, prompts[:2], params, None)  # warm-up
        rows, outs = [], None
        for _ in range(reps):
            metrics, outs = await run_workload(engine, prompts, params, None)
            rows.append(metrics)
        return {key: statistics.median(r[key] for r in rows) for key in KEYS}, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--extra", type=int, default=2, help="Tetris's extra drafts per row (e)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per run (default B): more than B keeps the batches full until the queue drains, "
                         "so the run measures serving rather than the ragged tail of one closed batch")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 = greedy (outputs checked identical); above 0, unseeded sampling (not compared)")
    ap.add_argument("--chat", action="store_true", help="held-out chat prompts (the real pair's chat template)")
    ap.add_argument("--kv-cache-tokens", type=int, default=65536)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=args.temperature)
    base = dict(target=args.target, draft=args.draft, max_tokens_limit=args.max_tokens,
                kv_cache_tokens=args.kv_cache_tokens, mode="minedraft")
    ratios = []
    for B in args.batch:
        if args.chat:
            from transformers import AutoTokenizer
            prompts = chat_prompts(AutoTokenizer.from_pretrained(args.target, local_files_only=True),
                                   args.requests or B)
        else:
            prompts = corpus_prompts(args.requests or B, 0)
        for k in args.k:
            settings = [("plain", dict(k=k)), ("tetris", dict(k=k, tetris=True, tetris_extra=args.extra))]
            got: dict[str, list[dict]] = {name: [] for name, _ in settings}
            same = True  # stays True unchecked when sampling
            for r in range(args.rounds):
                outs = {}
                for name, kw in (settings if r % 2 == 0 else settings[::-1]):
                    cfg = EngineConfig(**base, **kw, max_batch_size=B)
                    m, outs[name] = asyncio.run(one(cfg, prompts, params, args.reps))
                    got[name].append(m)
                    print(f"B={B} k={k} round {r}: {name:6s} " + " ".join(f"{key} {m[key]:.3g}" for key in KEYS),
                          flush=True)
                same &= args.temperature > 0 or outs["tetris"] == outs["plain"]
            med = {name: {key: statistics.median(m[key] for m in rows) for key in KEYS} for name, rows in got.items()}
            for name, m in med.items():
                print(f"B={B} k={k} {name:6s} median: " + " ".join(f"{key} {m[key]:.3g}" for key in KEYS))
            ratios.append((B, k, med["tetris"]["tok_s"] / med["plain"]["tok_s"],
                           med["plain"]["out_ver"], med["tetris"]["out_ver"], same))
    for B, k, ratio, ov_p, ov_t, same in ratios:
        print(f"RATIO B={B} k={k} e={args.extra} T={args.temperature}: tetris / plain tok/s = {ratio:.2f}  "
              f"(out/ver {ov_p:.3f} -> {ov_t:.3f}; outputs identical: {same})")


if __name__ == "__main__":
    main()
