#!/usr/bin/env python
"""The batched sampler against the per-row code it replaced, side by side in one run (one thread, CPU).

Per verify step: acceptance of B rows of k sampled drafts (old: one sampling.accept call per row with its own
torch.Generator; new: batch_sampling.verify_batch, one sync). Per draft position: sampling B draft tokens
(old: sampling.sample_draft per row; new: batch_sampling.sample_draft_step). Old and new alternate within
each repeat so machine noise hits both alike; medians are printed. With --forward, the bundled target's
verify forward at the same B and k is timed too, to show what share of a verify step sampling is.

    python scripts/bench/sampler.py --batch 32 --k 4 --vocab 2048 49152
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minedraft.sampling.batch_sampling import RowParams, sample_draft_step, verify_batch
from minedraft.sampling.reference import accept, make_generator, sample_draft
from minedraft.sampling_params import SamplingParams


def old_verify(drafts, q, logits, params, gens):
    return [accept(drafts[b], q[b], logits[b], params[b], gens[b]) for b in range(len(drafts))]


def old_draft(logits, params, gens):
    out = [sample_draft(logits[b], params[b], gens[b]) for b in range(logits.shape[0])]
    return [t for t, _ in out], torch.stack([q for _, q in out])


def bench_one(B: int, k: int, V: int, params: SamplingParams, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, k + 1, V, generator=g) * 3
    dlogits = logits[:, :k] + torch.randn(B, k, V, generator=g)
    plist = [params] * B
    rp = RowParams.of(plist, list(range(B)))
    pos = torch.full((B,), 40, dtype=torch.long)
    draw = torch.zeros(B, dtype=torch.long)
    toks, qs = [], []
    for i in range(k):
        t, q, _ = sample_draft_step(dlogits[:, i], rp, pos + i, draw)
        toks.append(t)
        qs.append(q)
    drafts_t, q = torch.stack(toks, 1), torch.stack(qs, 1)
    drafts = drafts_t.tolist()
    counts = torch.full((B,), k)
    gens = [make_generator(s, 1) for s in range(B)]
    times = {"verify old": [], "verify new": [], "draft old": [], "draft new": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        old_verify(drafts, q, logits, plist, gens)
        t1 = time.perf_counter()
        verify_batch(logits, drafts_t, counts, q, RowParams.of(plist, list(range(B))), pos)
        t2 = time.perf_counter()
        old_draft(dlogits[:, 0], plist, gens)
        t3 = time.perf_counter()
        sample_draft_step(dlogits[:, 0], RowParams.of(plist, list(range(B))), pos, draw)[0].tolist()
        t4 = time.perf_counter()
        for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[name].append(dt * 1e3)
    return {n: statistics.median(v) for n, v in times.items()}


def forward_ms(B: int, k: int, repeats: int) -> float:
    from minedraft.config import DEFAULT_TARGET
    from minedraft.runner.model_runner import ModelRunner
    runner = ModelRunner.from_pretrained(DEFAULT_TARGET, 65536, 16)
    rids = list(range(B))
    for r in rids:
        runner.cache.allocate(r, 256)
    runner.forward(rids, [[5] * 40 for _ in rids], 1)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward(rids, [[7] * (k + 1) for _ in rids], k + 1)
        ts.append((time.perf_counter() - t0) * 1e3)
        for r in rids:
            runner.cache.truncate(r, 40)
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--vocab", type=int, nargs="+", default=[2048, 49152])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--forward", action="store_true", help="also time the bundled target's verify forward")
    a = p.parse_args()
    torch.set_num_threads(1)
    settings = [("t=1.0", SamplingParams(temperature=1.0)),
                ("t=0.8 top_p=0.95", SamplingParams(temperature=0.8, top_p=0.95))]
    print(f"B={a.batch} k={a.k}, one thread, median of {a.repeats} (ms)")
    print(f"{'vocab':>6} {'sampling':18} {'verify old':>10} {'verify new':>10} {'speed-up':>8} "
          f"{'draft old':>9} {'draft new':>9} {'speed-up':>8}")
    for V in a.vocab:
        for name, params in settings:
            m = bench_one(a.batch, a.k, V, params, a.repeats)
            print(f"{V:>6} {name:18} {m['verify old']:>10.2f} {m['verify new']:>10.2f} "
                  f"{m['verify old'] / m['verify new']:>7.1f}x {m['draft old']:>9.2f} {m['draft new']:>9.2f} "
                  f"{m['draft old'] / m['draft new']:>7.1f}x")
    if a.forward:
        print(f"bundled target verify forward, B={a.batch}, {a.k + 1} tokens per row: "
              f"{forward_ms(a.batch, a.k, a.repeats):.2f} ms")


if __name__ == "__main__":
    main()
