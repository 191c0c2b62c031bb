"""Resident memory (RSS) of the drafter and verifier right after an Engine starts, for the bundled pair and a pulled
real pair: `python scripts/bench/worker_memory.py [--model smollm2-135m] [--kv-cache-tokens N]`.

Prints one line per worker (its RSS and peak RSS from /proc) and their sum; the KV cache is allocated (and zeroed,
so resident) when a worker loads, so the figure includes it."""

from __future__ import annotations

import argparse
import asyncio
import json


def rss_mb(pid: int) -> tuple[float, float, float, float]:
    """RSS, peak RSS, and the RSS split into anonymous memory and mapped files (weights read through mmap), MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            fields[k] = v.strip()
    kb = lambda k: int(fields[k].split()[0]) / 1024  # noqa: E731
    return kb("VmRSS"), kb("VmHWM"), kb("RssAnon"), kb("RssFile")


async def measure(kw: dict) -> dict:
    from minedraft import Engine, EngineConfig
    async with Engine(EngineConfig(**kw)) as engine:
        out = {}
        for p in engine.procs:
            rss, peak, anon, mapped = rss_mb(p.pid)
            out[p.name] = {"rss_mb": round(rss), "peak_mb": round(peak), "anon_mb": round(anon),
                           "file_mb": round(mapped)}
        out["total_rss_mb"] = sum(v["rss_mb"] for v in out.values())
        out["kv_cache_tokens"] = engine.config.kv_cache_tokens
        if engine.config.sizing is not None:
            out["sizing"] = engine.config.sizing.summary(engine.config.kv_cache_memory_fraction)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a pulled pair's name (models pull), else the bundled pair")
    ap.add_argument("--draft", default=None, help="the draft (default: the pair's own)")
    ap.add_argument("--kv-cache-tokens", type=int, default=None, help="default: the engine's")
    a = ap.parse_args()
    kw = {}
    if a.model:
        from minedraft.models.hub import resolve_model
        kw["target"], kw["draft"] = resolve_model(a.model, a.draft)
    elif a.draft:
        kw["draft"] = a.draft
    if a.kv_cache_tokens is not None:
        kw["kv_cache_tokens"] = a.kv_cache_tokens
    print(json.dumps(asyncio.run(measure(kw))))


if __name__ == "__main__":
    main()
