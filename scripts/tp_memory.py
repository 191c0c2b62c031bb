#!/usr/bin/env python
"""Weight bytes each tensor-parallel rank would hold for a model, against the whole model.

    python scripts/tp_memory.py [MODEL_DIR] [--tp 2 4]

Loads each rank's shard exactly as a rank process does (tensor_parallel.load_sharded: meta skeleton, only the
rank's slices read from safetensors), each in a fresh process, and prints its parameter bytes and how much that
process's resident set grew while loading (imports excluded). No process group is needed: collectives only run
in forward.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource

import torch

from minedraft.config import DEFAULT_TARGET
from minedraft.workers.tensor_parallel import Shard, load_sharded, param_bytes


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _rank(path: str, rank: int, world: int, out) -> None:
    torch.set_num_threads(1)
    before = rss_mb()
    m = load_sharded(path, Shard(rank, world))
    out.put((param_bytes(m), rss_mb() - before))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


if __name__ == "__main__":
    raise SystemExit(main())
