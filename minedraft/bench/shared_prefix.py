"""`minedraft bench --workload shared-prefix`: prefix caching on against off, in one run, on the same engine
settings and prompts (docs/BENCHMARKS.md "Prefix caching").

Three workloads, each run with prefix caching on and off, alternating which goes first, medians over --repeats:
* system: requests that share a long system prompt (--prefix tokens) and differ in a short suffix (--suffix
  tokens), one at a time (--concurrency), so time to first token is the prefill alone;
* chat: --chats conversations of --turns turns each, every turn resending the whole history (the system prompt,
  earlier questions and the replies the engine gave) plus a new question;
* distinct: --batch concurrent requests with nothing in common, for the cost of caching when nothing is shared.
Reported: time to first token (median), output tokens/s, prompt tokens the verifier computed, prefix-cache hit
rate. Greedy outputs with caching on are checked against caching off ("same").
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from ..config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig
from ..engine.engine import Engine
from ..sampling_params import SamplingParams


def _text_ids(tok, n: int, seed: int) -> list[int]:
    """n token ids of running text from Python's documentation (ships with every Python)."""
    from pydoc_data.topics import topics
    pages = [t for t in topics.values() if len(t.split()) > 200]
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(rng.choice(pages) + "\n")
    return ids[:n]


def _median(xs):
    return statistics.median(xs) if xs else 0.0


async def _system(engine, prefix, suffixes, params, concurrency):
    sem = asyncio.Semaphore(concurrency)

    async def one(s):
        async with sem:
            return await engine.generate(prefix + s, params)
    return await asyncio.gather(*(one(s) for s in suffixes))


async def _chat(engine, prefix, questions, params):
    async def conv(qs):
        hist, out = list(prefix), []
        for q in qs:
            r = await engine.generate(hist + q, params)
            out.append(r)
            hist += q + r.token_ids
        return out
    runs = await asyncio.gather(*(conv(qs) for qs in questions))
    return [r for conv_results in runs for r in conv_results]


async def _distinct(engine, prompts, params):
    return await asyncio.gather(*(engine.generate(p, params) for p in prompts))


async def _measure(cfg: EngineConfig, work: dict, args) -> dict:
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    out = {}
    async with Engine(cfg) as engine:
        await engine.generate(work["warm"], params)  # loads, first-call costs; shares nothing with the rest
        for name in ("system", "chat", "distinct"):
            before = engine.stats()
            t0 = time.perf_counter()
            if name == "system":
                res = await _system(engine, work["prefix"], work["suffixes"], params, args.concurrency)
            elif name == "chat":
                res = await _chat(engine, work["prefix"], work["questions"], params)
            else:
                res = await _distinct(engine, work["distinct"], params)
            wall = time.perf_counter() - t0
            after = engine.stats()
            d = {k: after[k] - before[k] for k in ("prefill_tokens", "prefix_cache_queries", "prefix_cache_hits")}
            out[name] = {"ttft_ms": 1e3 * _median([r.stats.ttft_s for r in res]),
                         "tok_s": sum(len(r.token_ids) for r in res) / wall,
                         "prefill": d["prefill_tokens"],
                         "hit": d["prefix_cache_hits"] / d["prefix_cache_queries"] if d["prefix_cache_queries"] else 0,
                         "ids": [r.token_ids for r in res]}
    return out


async def _bench(args) -> list[str]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    rng = random.Random(args.seed)
    prefix = _text_ids(tok, args.prefix, 1)
    work = {"prefix": prefix, "warm": _text_ids(tok, 64, 2),
            "suffixes": [_text_ids(tok, args.suffix, 100 + i) for i in range(args.requests)],
            "questions": [[_text_ids(tok, args.suffix, 200 + 10 * c + t) for t in range(args.turns)]
                          for c in range(args.chats)],
            # a numbered first line: no two distinct prompts (and none of them and the rest) share a first block,
            # even when they start on the same documentation page
            "distinct": [(tok.encode(f"Note {i}: ") + _text_ids(tok, 96, 300 + i))[:rng.randint(32, 96)]
                         for i in range(args.batch)]}
    need = args.prefix + args.turns * (args.suffix + args.max_tokens) + 8
    runs: dict[bool, list[dict]] = {True: [], False: []}
    total, t0 = 2 * args.repeats, time.monotonic()
    for rep in range(args.repeats):
        for caching in ((True, False) if rep % 2 == 0 else (False, True)):
            cfg = EngineConfig(target=args.target, draft=args.draft, mode=args.mode, k=args.k,
                               prefix_caching=caching, max_prompt_tokens=need, max_tokens_limit=args.max_tokens,
                               max_batch_size=max(args.batch, args.chats, args.concurrency),
                               kv_cache_tokens=args.kv_cache_tokens)
            m = await _measure(cfg, work, args)
            runs[caching].append(m)
            done = sum(map(len, runs.values()))
            eta = (time.monotonic() - t0) / done * (total - done)  # every run does the same work
            print(f"repeat {rep} caching={'on' if caching else 'off'} ({done}/{total} runs, about {eta / 60:.1f} min "
                  "left): " + ", ".join(f"{w} ttft {m[w]['ttft_ms']:.0f} ms {m[w]['tok_s']:.1f} tok/s" for w in m),
                  flush=True)
    lines = [f"{'workload':<10} {'caching':<8} {'TTFT p50 ms':>12} {'tok/s':>8} {'prefill tok':>12} {'hit rate':>9}"]
    for w in ("system", "chat", "distinct"):
        for caching in (False, True):
            rows = [r[w] for r in runs[caching]]
            lines.append(f"{w:<10} {'on' if caching else 'off':<8} {_median([r['ttft_ms'] for r in rows]):>12.1f} "
                         f"{_median([r['tok_s'] for r in rows]):>8.1f} {_median([r['prefill'] for r in rows]):>12.0f} "
                         f"{_median([r['hit'] for r in rows]):>9.2f}")
    lines.append("")
    for w in ("system", "chat", "distinct"):
        on = [r[w] for r in runs[True]]
        off = [r[w] for r in runs[False]]
        same = sum(a == b for x, y in zip(on, off) for a, b in zip(x["ids"], y["ids"]))
        total = sum(len(x["ids"]) for x in on)
        ttft = _median([r['ttft_ms'] for r in off]) / _median([r['ttft_ms'] for r in on])
        lines.append(f"{w}: TTFT off/on = {ttft:.2f}x"
                     f", tok/s on/off = {_median([r['tok_s'] for r in on]) / _median([r['tok_s'] for r in off]):.3f}"
                     f", greedy outputs equal with and without caching: {same}/{total}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minedraft bench --workload shared-prefix",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("shared-prefix",), default="shared-prefix")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--model", default=None, help="a named pair (e.g. smollm2-135m) instead of --target/--draft")
    p.add_argument("--mode", default="minedraft", choices=("minedraft", "sequential", "autoregressive"))
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prefix", type=int, default=1000, help="shared system prompt, tokens (default: 1000)")
    p.add_argument("--suffix", type=int, default=20, help="each request's own part / question, tokens (default: 20)")
    p.add_argument("--requests", type=int, default=8, help="system workload: requests (default: 8)")
    p.add_argument("--concurrency", type=int, default=1, help="system workload: requests at once (default: 1)")
    p.add_argument("--chats", type=int, default=4, help="chat workload: conversations at once (default: 4)")
    p.add_argument("--turns", type=int, default=3, help="chat workload: turns per conversation (default: 3)")
    p.add_argument("--batch", type=int, default=16, help="distinct workload: concurrent requests (default: 16)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default: 32)")
    p.add_argument("--repeats", type=int, default=2, help="runs per setting, order alternating (default: 2)")
    p.add_argument("--kv-cache-tokens", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.model:
        from ..models.hub import resolve_model
        args.target, args.draft = resolve_model(args.model)
    try:
        lines = asyncio.run(_bench(args))
    except ValueError as e:
        print(f"minedraft bench: error: {e}")
        return 2
    print()
    print("\n".join(lines))
    return 0
