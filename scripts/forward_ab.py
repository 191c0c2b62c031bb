#!/usr/bin/env python
"""A/B of ModelRunner.forward: the working tree against an earlier git revision, in one process.

Both runners load the same model and are timed in alternation (one call each, then the next), so drift and
other load on the box hit both alike; medians over --calls. Use it to back a claim that a model-runner change
is faster: `python scripts/forward_ab.py --rev HEAD~1`.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from minedraft.config import DEFAULT_TARGET
from minedraft.workers import model_runner as current
from verify_cost import prime, timed_verify  # scripts/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [(8, 80, 1), (8, 80, 4), (16, 80, 4), (8, 300, 4)]  # rows, cached context, tokens scored per row


def load_revision(rev: str):
    """minedraft/workers/model_runner.py as it was at rev, importable beside the current one."""
    src = subprocess.run(["git", "show", f"{rev}:minedraft/workers/model_runner.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    src = src.replace("from ..", "from minedraft.")  # its relative imports, made absolute
    path = Path(tempfile.mkdtemp()) / "model_runner_at_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("model_runner_at_rev", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD", help="git revision to compare against (default: HEAD)")
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--calls", type=int, default=150)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    mods = {a.rev: load_revision(a.rev), "working tree": current}
    lines = []
    for B, ctx, n in tqdm(SETTINGS, desc="settings"):
        runners = {name: m.ModelRunner.from_pretrained(a.target, 16384, 16, "cpu", a.dtype) for name, m in mods.items()}
        rows = list(range(B))
        for r in runners.values():
            prime(r, rows, ctx, n)
        times = {name: [] for name in runners}
        for it in range(a.calls + 5):
            for name, r in runners.items():
                dt = timed_verify(r, rows, n, ctx)
                if it >= 5:
                    times[name].append(dt)
        old, new = (statistics.median(times[name]) * 1e3 for name in mods)
        lines.append(f"B={B:<3d} context={ctx:<4d} n={n}: {a.rev} {old:7.2f} ms   working tree {new:7.2f} ms   "
                     f"{old / new:.2f}x")
    print(f"\nModelRunner.forward, {a.dtype}, median of {a.calls} alternating calls:")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
