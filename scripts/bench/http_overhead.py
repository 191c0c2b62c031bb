#!/usr/bin/env python
"""What the HTTP front end costs: the same greedy workload through Engine.generate directly, through the
OpenAI-compatible server (openai's AsyncOpenAI, non-streamed), and streamed (SSE), on one engine, interleaved
in one run. Client, server and scheduler share one event loop (the workers are their own processes).

    python scripts/bench/http_overhead.py [--requests 16] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from minedraft.bench.runner import corpus_prompts
from minedraft.config import EngineConfig
from minedraft.engine.engine import Engine
from minedraft.serving.http.app import create_app
from minedraft.serving.http.serve import HTTPServer, bind_socket


async def main(a) -> None:
    from openai import AsyncOpenAI
    prompts = corpus_prompts(a.requests, seed=1)
    async with Engine(EngineConfig(max_batch_size=max(a.requests, 2))) as engine:
        srv = HTTPServer(create_app(engine), bind_socket("127.0.0.1:0", False))
        await srv.start()
        client = AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=600)
        model = (await client.models.list()).data[0].id
        kw = dict(max_tokens=a.max_tokens, temperature=0, extra_body={"ignore_eos": True})

        async def direct(p):
            return (await engine.generate(p, {"max_tokens": a.max_tokens, "ignore_eos": True})).text

        async def http(p):
            return (await client.completions.create(model=model, prompt=p, **kw)).choices[0].text

        async def sse(p):
            out = []
            async for c in await client.completions.create(model=model, prompt=p, stream=True, **kw):
                out.append(c.choices[0].text)
            return "".join(out)

        ways = {"Engine.generate": direct, "HTTP": http, "HTTP stream": sse}
        rates: dict[str, list[float]] = {w: [] for w in ways}
        texts = {}
        await asyncio.gather(*(direct(p) for p in prompts))  # warm-up
        for _ in range(a.repeats):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                texts[name] = await asyncio.gather(*(fn(p) for p in prompts))
                rates[name].append(a.requests * a.max_tokens / (time.perf_counter() - t0))
        same = all(texts[w] == texts["Engine.generate"] for w in ways)
        base = statistics.median(rates["Engine.generate"])
        print(f"{a.requests} concurrent greedy requests x {a.max_tokens} tokens, median of {a.repeats}; "
              f"outputs identical across the three: {same}")
        for name in ways:
            m = statistics.median(rates[name])
            print(f"  {name:16s} {m:8.1f} tokens/s  ({m / base:.2f}x direct)")
        await srv.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(p.parse_args()))
