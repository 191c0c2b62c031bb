#!/usr/bin/env python
"""How much a verify call costs as it scores more tokens per row, and what that allows SD to gain.

Times ModelRunner.forward on the target (one thread, as in a worker) for B rows that each already hold a
context, scoring n = 1..k+1 new tokens per row, in float32 and bfloat16; medians of --repeats timed calls.
From those times it prints ceilings that no draft can beat on this machine:

* target-alone at batch B makes B tokens per T(B, 1);
* the pipeline with two batches of B/2 is verifier-bound when drafting hides behind verifying, so with a draft
  that is *always right* it makes (B/2)(k+1) tokens per T(B/2, k+1): the best any draft could do;
* with the bundled draft's measured tokens per step E(k) (minedraft/models/training_report.json) it makes
  (B/2)E(k) per T(B/2, k+1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from minedraft.config import DEFAULT_TARGET
from minedraft.workers.model_runner import ModelRunner

def bundled_tokens_per_step() -> dict[int, float]:
    """E(k) of the bundled pair as measured when it was trained (minedraft/models/training_report.json)."""
    report = json.loads((Path(DEFAULT_TARGET).parent / "training_report.json").read_text())
    return {m["k"]: m["tokens_per_step"] for m in report["measurements"]["speculative"]}


def draft_tokens_per_step(report_path: str) -> dict[int, float]:
    """E(k) from a trained draft's report.json (scripts/train_smollm2_draft.py eval)."""
    report = json.loads(Path(report_path).read_text())
    return {int(k): v["tokens_per_step"] for k, v in report["acceptance"].items()}


def prime(runner: ModelRunner, rows: list[int], context: int, room: int) -> None:
    """Give each row a cached context of `context` tokens, with room for `room` more."""
    for r in rows:
        runner.cache.allocate(r, context + room)
    runner.forward(rows, [[5 + r % 7] * context for r in rows], 1)


def timed_verify(runner: ModelRunner, rows: list[int], n: int, context: int) -> float:
    """Seconds for one forward scoring n tokens per row, then rolled back so every call sees the same context."""
    t = time.perf_counter()
    runner.forward(rows, [[7] * n for _ in rows], n)
    dt = time.perf_counter() - t
    for r in rows:
        runner.cache.truncate(r, context)
    return dt


def verify_times(path: str, dtype: str, batches: list[int], max_n: int, context: int, repeats: int, bar):
    runner = ModelRunner.from_pretrained(path, 16384, 16, "cpu", dtype)
    out = {}
    for B in batches:
        rows = list(range(B))
        prime(runner, rows, context, max_n)
        for n in range(1, max_n + 1):
            times = [timed_verify(runner, rows, n, context) for _ in range(repeats + 2)][2:]  # 2 warm-ups
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
    ap.add_argument("--draft-report", default=None, metavar="JSON",
                    help="a trained draft's report.json for E(k) (default: the bundled pair's training report)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    B, H = a.batch, a.batch // 2
    bar = tqdm(total=len(a.dtypes) * 2 * (a.max_k + 1), desc="verify calls", unit="setting")
    res = {dt: verify_times(a.target, dt, [H, B], a.max_k + 1, a.context, a.repeats, bar) for dt in a.dtypes}
    bar.close()
    E = draft_tokens_per_step(a.draft_report) if a.draft_report else bundled_tokens_per_step()
    for dt, T in res.items():
        print(f"\n{dt}: verify call time in ms (median of {a.repeats}), by tokens scored per row")
        print(f"{'rows':>5s}" + "".join(f"{n:>8d}" for n in range(1, a.max_k + 2)))
        for rows in (H, B):
            print(f"{rows:5d}" + "".join(f"{T[rows, n]:8.2f}" for n in range(1, a.max_k + 2)))
        ar = B / T[B, 1]
        print(f"target-alone B={B}: {ar * 1e3:.0f} tok/s")
        print(f"{'k':>3s} {'perfect draft':>15s} {'this draft':>15s}   (pipeline ceiling, two batches of "
              f"{H}, x target-alone)")
        for k in range(1, a.max_k + 1):
            perfect = H * (k + 1) / T[H, k + 1] / ar
            bundled = H * E[k] / T[H, k + 1] / ar if k in E else float("nan")
            print(f"{k:3d} {perfect:14.2f}x {bundled:14.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
