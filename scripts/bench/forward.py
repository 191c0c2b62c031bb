#!/usr/bin/env python
"""The target's forward pass in isolation (ModelRunner on one thread, as in a worker): what a verify call costs,
what ragged rows add, a model-runner change against an earlier revision, and tensor-parallel weight memory.

    python scripts/bench/forward.py cost [--target DIR] [--draft-report JSON]   # verify cost and SD's ceiling
    python scripts/bench/forward.py ragged [--batch 32] [--target DIR]          # dense vs ragged verify forward
    python scripts/bench/forward.py ragged-verify [--batch 16] [--target DIR]   # forward + alignment + sampler
    python scripts/bench/forward.py rev --rev REV [--plan]                      # ModelRunner now vs at REV
    python scripts/bench/forward.py tp-memory [MODEL_DIR] [--tp 1 2 4]         # weight bytes per TP rank

`python scripts/bench/forward.py COMMAND --help` gives each command's flags and what it prints.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import json
import multiprocessing as mp
import os
import random
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from minedraft.config import DEFAULT_TARGET
from minedraft.runner import model_runner as current
from minedraft.runner.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[2]
RAW = argparse.RawDescriptionHelpFormatter


def parser(name: str, fn) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"forward.py {name}", description=fn.__doc__, formatter_class=RAW)


def prime(runner, rows: list[int], context: int, room: int) -> None:
    """Give each row a cached context of `context` tokens, with room for `room` more."""
    for r in rows:
        runner.cache.allocate(r, context + room)
    runner.forward(rows, [[5 + r % 7] * context for r in rows], 1)


def timed_verify(runner, rows: list[int], n: int, context: int) -> float:
    """Seconds for one forward scoring n tokens per row, then rolled back so every call sees the same context."""
    t = time.perf_counter()
    runner.forward(rows, [[7] * n for _ in rows], n)
    dt = time.perf_counter() - t
    for r in rows:
        runner.cache.truncate(r, context)
    return dt


# -- cost ------------------------------------------------------------------------------------------------------
def tokens_per_step(report_path: str | None) -> dict[int, float]:
    """E(k): from a trained draft's report.json (scripts/train/smollm2_draft.py eval), else the bundled pair's
    as measured when it was trained (minedraft/models/training_report.json)."""
    if report_path:
        report = json.loads(Path(report_path).read_text())
        return {int(k): v["tokens_per_step"] for k, v in report["acceptance"].items()}
    report = json.loads((Path(DEFAULT_TARGET).parent / "training_report.json").read_text())
    return {m["k"]: m["tokens_per_step"] for m in report["measurements"]["speculative"]}


def cost(argv) -> int:
    """How much a verify call costs as it scores more tokens per row, and what that allows SD to gain.

Times ModelRunner.forward on the target (one thread) for B rows that each already hold a context, scoring
n = 1..k+1 new tokens per row, per dtype; medians of --repeats timed calls. From those times it prints ceilings
that no draft can beat on this machine:

* target-alone at batch B makes B tokens per T(B, 1);
* the pipeline with two batches of B/2 is verifier-bound when drafting hides behind verifying, so with a draft
  that is *always right* it makes (B/2)(k+1) tokens per T(B/2, k+1): the best any draft could do;
* with the draft's measured tokens per step E(k) it makes (B/2)E(k) per T(B/2, k+1)."""
    ap = parser("cost", cost)
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
    res = {}
    for dt in a.dtypes:
        runner = ModelRunner.from_pretrained(a.target, 16384, 16, "cpu", dt)
        T = res[dt] = {}
        for rows in ([H, B] if H != B else [B]):
            ids = list(range(rows))
            prime(runner, ids, a.context, a.max_k + 1)
            for n in range(1, a.max_k + 2):
                times = [timed_verify(runner, ids, n, a.context) for _ in range(a.repeats + 2)][2:]  # 2 warm-ups
                T[rows, n] = statistics.median(times) * 1e3
            for r in ids:
                runner.cache.free(r)
        print(f"{dt} done", file=sys.stderr, flush=True)
    E = tokens_per_step(a.draft_report)
    for dt, T in res.items():
        print(f"\n{dt}: verify call time in ms (median of {a.repeats}), by tokens scored per row")
        print(f"{'rows':>5s}" + "".join(f"{n:>8d}" for n in range(1, a.max_k + 2)))
        for rows in sorted({H, B}):
            print(f"{rows:5d}" + "".join(f"{T[rows, n]:8.2f}" for n in range(1, a.max_k + 2)))
        ar = B / T[B, 1]
        print(f"target-alone B={B}: {ar * 1e3:.0f} tok/s")
        print(f"{'k':>3s} {'perfect draft':>15s} {'this draft':>15s}   (pipeline ceiling, two batches of "
              f"{H}, x target-alone)")
        for k in range(1, a.max_k + 1):
            perfect = H * (k + 1) / T[H, k + 1] / ar
            measured = H * E[k] / T[H, k + 1] / ar if k in E else float("nan")
            print(f"{k:3d} {perfect:14.2f}x {measured:14.2f}x")
    return 0


# -- ragged ----------------------------------------------------------------------------------------------------
def ragged(argv) -> int:
    """What a ragged verify batch costs: the target's forward over B rows at a 40-token context with (a) k + 1 = 4
new tokens per row, (b) Tetris-like ragged rows (1..7 tokens, about as many tokens in all), (c) 7 tokens per row
(every row at k + e + 1). One thread; the three alternate within each repeat."""
    ap = parser("ragged", ragged)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    runner = ModelRunner.from_pretrained(a.target, 65536, 16)
    rids = list(range(a.batch))
    for r in rids:
        runner.cache.allocate(r, 256)
    runner.forward(rids, [[5] * 40 for _ in rids], 1)
    rng = random.Random(0)
    feeds = {"dense k+1=4": [[7] * 4 for _ in rids],
             "ragged 1..7": [[7] * (rng.choice([0, 1, 2, 3, 5, 6]) + 1) for _ in rids],
             "all 7": [[7] * 7 for _ in rids]}
    times = {n: [] for n in feeds}
    for _ in range(a.repeats):
        for name, feed in feeds.items():
            t0 = time.perf_counter()
            runner.forward(rids, feed, max(map(len, feed)))
            times[name].append((time.perf_counter() - t0) * 1e3)
            for r in rids:
                runner.cache.truncate(r, 40)
    for name, feed in feeds.items():
        print(f"{name:12s} {sum(map(len, feed)):4d} tokens  {statistics.median(times[name]):7.2f} ms")
    return 0


def ragged_verify(argv) -> int:
    """What a ragged verify step costs beside a dense one with the same number of scored tokens: the runner's
forward (packed logits), the left-alignment of ragged rows, and verify_batch, on one thread, the two batches
alternating within each repeat. Dense: k = 1 draft per row; ragged: 0..3 drafts per row, B drafts in all (a
Tetris step at capacity B)."""
    from minedraft.sampling_params import SamplingParams
    from minedraft.sampling.batch_sampling import RowParams, verify_batch
    ap = parser("ragged-verify", ragged_verify)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=21)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    runner = ModelRunner.from_pretrained(a.target, 65536, 16)
    B, ctx = a.batch, 60
    rids = list(range(B))
    for r in rids:
        runner.cache.allocate(r, 256)
    runner.forward(rids, [[5] * ctx for _ in rids], 1)
    rng = random.Random(0)
    counts_ragged = [rng.choice([0, 0, 1, 1, 1, 2, 3]) for _ in rids]
    while sum(counts_ragged) != B:
        counts_ragged = [rng.choice([0, 0, 1, 1, 1, 2, 3]) for _ in rids]
    cases = {"dense k=1": [1] * B, "ragged 0..3": counts_ragged}
    rp = RowParams.of([SamplingParams()] * B, [0] * B)
    pos0 = torch.full((B,), ctx + 1)
    times = {n: {"forward": [], "align": [], "verify_batch": []} for n in cases}
    for _ in range(a.repeats):
        for name, counts in cases.items():
            K = max(counts)
            ct = torch.tensor(counts)
            t0 = time.perf_counter()
            rows, index = runner.forward(rids, [[7] * (c + 1) for c in counts], K + 1, packed=True)
            t1 = time.perf_counter()
            if min(counts) < K:  # as the verifier does
                index = index.gather(1, (K - ct[:, None] + torch.arange(K + 1)[None, :]).clamp(max=K))
            t2 = time.perf_counter()
            drafts = torch.tensor([[7] * c + [0] * (K - c) for c in counts]).view(B, K)
            verify_batch(rows, drafts, ct, None, rp, pos0, index)
            t3 = time.perf_counter()
            for r in rids:
                runner.cache.truncate(r, ctx)
            for key, dt in zip(("forward", "align", "verify_batch"), (t1 - t0, t2 - t1, t3 - t2)):
                times[name][key].append(dt * 1e3)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    for name, m in med.items():
        print(f"{name:12s} " + "  ".join(f"{k} {v:7.2f} ms" for k, v in m.items()))
    dense, rag = (sum(m.values()) for m in med.values())
    print(f"RATIO ragged / dense step = {rag / dense:.3f} (+{rag - dense:.1f} ms)")
    return 0


# -- rev -------------------------------------------------------------------------------------------------------
def package_at(rev: str):
    """The package as it was at a git revision, importable beside the current one as `minedraft_at_rev` (its
    modules import each other relatively, so the old tree stays self-consistent whatever its layout)."""
    tar = subprocess.run(["git", "archive", rev, "--", ":(glob)minedraft/**/*.py"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    tmp = Path(tempfile.mkdtemp())
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(tmp, filter="data")
    pkg = tmp / "minedraft_at_rev"
    (tmp / "minedraft").rename(pkg)
    spec = importlib.util.spec_from_file_location("minedraft_at_rev", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["minedraft_at_rev"] = mod  # submodules and dataclasses look the package up here
    spec.loader.exec_module(mod)
    return mod


def rev(argv) -> int:
    """ModelRunner now against an earlier git revision, in one process, one thread: both runners load the same
model and are timed in alternation (one call each, then the next), so drift and other load on the box hit both
alike; medians over --calls. Default: the forward at four (rows, cached context, tokens per row) settings.
--plan: ModelRunner._plan alone (the index tensors built before every forward) at --batch rows, one new token,
--context cached. Use it to back a claim that a model-runner change is faster."""
    ap = parser("rev", rev)
    ap.add_argument("--rev", default="HEAD", help="git revision to compare against (default: HEAD)")
    ap.add_argument("--module", default="workers.model_runner", help="the runner's module at REV")
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--calls", type=int, default=150)
    ap.add_argument("--plan", action="store_true", help="time ModelRunner._plan instead of the forward")
    ap.add_argument("--batch", type=int, default=16, help="--plan: rows")
    ap.add_argument("--context", type=int, default=80, help="--plan: cached tokens per row")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    package_at(a.rev)
    mods = {a.rev: importlib.import_module(f"minedraft_at_rev.{a.module}"), "now": current}
    settings = [(a.batch, a.context, 1)] if a.plan else [(8, 80, 1), (8, 80, 4), (16, 80, 4), (8, 300, 4)]
    lines = []
    for B, ctx, n in settings:
        runners = {name: m.ModelRunner.from_pretrained(a.target, 16384, 16, "cpu", a.dtype) for name, m in mods.items()}
        rows = list(range(B))
        for r in runners.values():
            prime(r, rows, ctx, n)
        times = {name: [] for name in runners}
        for it in range(a.calls + 5):
            for name, r in runners.items():
                if a.plan:
                    t = time.perf_counter()
                    r._plan(rows, [[7]] * B, 1)
                    dt = time.perf_counter() - t
                else:
                    dt = timed_verify(r, rows, n, ctx)
                if it >= 5:
                    times[name].append(dt)
        old, new = (statistics.median(times[name]) * 1e3 for name in mods)
        lines.append(f"B={B:<3d} context={ctx:<4d} n={n}: {a.rev} {old:7.3f} ms   now {new:7.3f} ms   "
                     f"{a.rev} / now = {old / new:.2f}")
    what = "ModelRunner._plan" if a.plan else "ModelRunner.forward"
    print(f"{what}, {a.dtype}, median of {a.calls} alternating calls:")
    print("\n".join(lines))
    return 0


# -- tp-memory -------------------------------------------------------------------------------------------------
def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _rank(path: str, rank: int, world: int, out) -> None:
    from minedraft.runner.tensor_parallel import Shard, load_sharded, param_bytes
    torch.set_num_threads(1)
    before = rss_mb()
    m = load_sharded(path, Shard(rank, world))
    out.put((param_bytes(m), rss_mb() - before))


def tp_memory(argv) -> int:
    """Weight bytes each tensor-parallel rank would hold for a model, against the whole model. Loads each rank's
shard exactly as a rank process does (tensor_parallel.load_sharded: meta skeleton, only the rank's slices read
from safetensors), each in a fresh process, and prints its parameter bytes and how much that process's resident
set grew while loading (imports excluded). No process group is needed: collectives only run in forward."""
    ap = parser("tp-memory", tp_memory)
    ap.add_argument("model", nargs="?", default=DEFAULT_TARGET)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    a = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    whole = None
    for n in a.tp:
        for r in range(n):
            q = ctx.Queue()
            p = ctx.Process(target=_rank, args=(a.model, r, n, q))
            p.start()
            b, grew = q.get()
            p.join()
            whole = whole or (b if n == 1 else None)
            share = f" ({b / whole:.3f} of tp=1)" if whole else ""
            print(f"tp={n} rank {r}: {b / 2**20:8.2f} MiB of weights{share}, RSS +{grew:.1f} MiB while loading")
    return 0


COMMANDS = {"cost": cost, "ragged": ragged, "ragged-verify": ragged_verify, "rev": rev, "tp-memory": tp_memory}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RAW)
    ap.add_argument("command", choices=COMMANDS)
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the command's flags (COMMAND --help lists them)")
    a = ap.parse_args(argv)
    return COMMANDS[a.command](a.args)


if __name__ == "__main__":
    raise SystemExit(main())
