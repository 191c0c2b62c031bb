#!/usr/bin/env python
"""A/B of ModelRunner._plan (the index tensors built before every forward): the working tree against an earlier git
revision (its model_runner.py and paged_kv.py), in one process, timed in alternation; medians over --calls.

    python scripts/plan_ab.py --rev 3f907e9
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minedraft.config import DEFAULT_TARGET
from minedraft.workers import model_runner as current
from verify_cost import prime  # scripts/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]


def load(rev: str, path: str, name: str):
    """A module of minedraft as it was at rev, importable beside the current one."""
    src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.replace("from ..", "from minedraft.")
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(src)
    spec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default="HEAD~1")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=80)
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    torch.set_num_threads(1)
    old = load(a.rev, "minedraft/workers/model_runner.py", "model_runner_at_rev")
    old.PagedKVCache = load(a.rev, "minedraft/cache/paged_kv.py", "paged_kv_at_rev").PagedKVCache
    model = current.load_causal_lm(DEFAULT_TARGET)
    runners = {"now": current.ModelRunner(model, 16384), a.rev: old.ModelRunner(model, 16384)}
    rows = list(range(a.batch))
    times = {n: [] for n in runners}
    for r in runners.values():
        prime(r, rows, a.context, 8)
    for _ in range(a.calls):
        for n, r in runners.items():
            t = time.perf_counter()
            r._plan(rows, [[7]] * a.batch, 1)
            times[n].append(time.perf_counter() - t)
    med = {n: statistics.median(v) * 1e6 for n, v in times.items()}
    print(f"_plan, B={a.batch}, one new token per row, context {a.context}, median of {a.calls}: "
          + ", ".join(f"{n} {v:.1f} us" for n, v in med.items()))
    print(f"ratio {a.rev} / now = {med[a.rev] / med['now']:.2f}")


if __name__ == "__main__":
    main()
