#!/usr/bin/env python
"""Is the target alone batch-invariant in a given dtype? The bound on what greedy SD can promise.

Greedy speculative decoding scores a request's tokens inside batches whose make-up changes from step to step.
Its output can be token-for-token the target's only if the target's own greedy output does not depend on what
else shares the batch. This script decodes the same prompts with the target alone (mode=autoregressive)
twice, all at once and one at a time, per dtype, and counts the requests whose outputs are identical.
"""

from __future__ import annotations

import argparse
import asyncio

import minedraft
from minedraft import Engine, EngineConfig, SamplingParams
from minedraft.bench.runner import corpus_prompts
from minedraft.config import DEFAULT_TARGET


async def outputs(cfg: EngineConfig, prompts, params, together: bool):
    async with Engine(cfg) as engine:
        if together:
            res = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        else:
            res = [await engine.generate(p, params) for p in prompts]
    return [r.token_ids for r in res]


async def run(args):
    prompts = corpus_prompts(args.requests, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for dtype in args.dtypes:
        cfg = EngineConfig(target=args.target, mode="autoregressive", dtype=dtype,
                           max_batch_size=args.requests, max_tokens_limit=args.max_tokens)
        batched = await outputs(cfg, prompts, params, True)
        alone = await outputs(cfg, prompts, params, False)
        same = sum(a == b for a, b in zip(batched, alone))
        print(f"{dtype:9s} target alone, batch of {args.requests} vs one at a time: "
              f"{same}/{args.requests} requests identical", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "float16", "bfloat16"])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    minedraft.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
