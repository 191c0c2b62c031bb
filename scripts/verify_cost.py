#!/usr/bin/env python
"""How much a verify call costs as it scores more tokens per row, and what that allows SD to gain.

Times ModelRunner.forward on the target (one thread, as in a worker) for B rows that each already hold a
context, scoring n = 1..k+1 new tokens per row, in float32 and bfloat16; medians of --repeats timed calls.
From those times it prints ceilings that no draft can beat on this machine:

* target-alone at batch B makes B tokens per T(B, 1);
* the pipeline with two batches of B/2 is verifier-bound when drafting hides behind verifying, so with a draft
  that is *always right* it makes (B/2)(k+1) tokens per T(B/2, k+1): the best any draft could do;
* with the bundled draft's measured tokens per step E(k) (minedraft/models/README.md) it makes (B/2)E(k)
  per T(B/2, k+1).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from minedraft.config import DEFAULT_TARGET
from minedraft.workers.model_runner import ModelRunner

BUNDLED_E = {1: 1.644, 2: 2.075, 3: 2.370, 4: 2.531, 5: 2.663, 6: 2.760}  # greedy tokens/step, models README


def verify_times(path: str, dtype: str, batches: list[int], max_n: int, context: int, repeats: int, bar):
    runner = ModelRunner.from_pretrained(path, 16384, 16, "cpu", dtype)
    out = {}
    for B in batches:
        rows = list(range(B))
        for r in rows:
            runner.cache.allocate(r, context + max_n + 1)
        runner.forward(rows, [[5 + r % 7] * context for r in rows], 1)  # the context every call attends to
        for n in range(1, max_n + 1):
            times = []
            for i in range(repeats + 2):
                t = time.perf_counter()
                runner.forward(rows, [[7] * n for _ in rows], n)
                dt = time.perf_counter() - t
                for r in rows:
                    runner.cache.truncate(r, context)  # roll back: every call sees the same context
                if i >= 2:  # two warm-up calls
                    times.append(dt)
            out[B, n] = statistics.median(times) * 1e3
            bar.update(1)
        for r in rows:
            runner.cache.free(r)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--batch", type=int, default=16, help="concurrent requests (the pipeline splits them in two)")
    ap.add_argument("--max-k", type=int, default=6)
    ap.add_argument("--context", type=int, default=48, help="tokens already cached per row")
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    B, H = a.batch, a.batch // 2
    bar = tqdm(total=len(a.dtypes) * 2 * (a.max_k + 1), desc="verify calls", unit="setting")
    res = {dt: verify_times(a.target, dt, [H, B], a.max_k + 1, a.context, a.repeats, bar) for dt in a.dtypes}
    bar.close()
    for dt, T in res.items():
        print(f"\n{dt}: verify call time in ms (median of {a.repeats}), by tokens scored per row")
        print(f"{'rows':>5s}" + "".join(f"{n:>8d}" for n in range(1, a.max_k + 2)))
        for rows in (H, B):
            print(f"{rows:5d}" + "".join(f"{T[rows, n]:8.2f}" for n in range(1, a.max_k + 2)))
        ar = B / T[B, 1]
        print(f"target-alone B={B}: {ar * 1e3:.0f} tok/s")
        print(f"{'k':>3s} {'perfect draft':>15s} {'bundled draft':>15s}   (pipeline ceiling, two batches of "
              f"{H}, x target-alone)")
        for k in range(1, a.max_k + 1):
            perfect = H * (k + 1) / T[H, k + 1] / ar
            bundled = H * BUNDLED_E[k] / T[H, k + 1] / ar if k in BUNDLED_E else float("nan")
            print(f"{k:3d} {perfect:14.2f}x {bundled:14.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
