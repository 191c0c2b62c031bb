#!/usr/bin/env python
"""What a ragged verify batch costs: the bundled target's forward over B rows at a 40-token context with
(a) k + 1 = 4 new tokens per row, (b) Tetris-like ragged rows (1..7 tokens, about as many tokens in all),
(c) 7 tokens per row (every row at k + e + 1). One thread; the three alternate within each repeat.

    python scripts/ragged_forward.py [--batch 32] [--repeats 15] [--target DIR]
"""

import argparse
import random
import statistics
import time

import torch

from minedraft.config import DEFAULT_TARGET
from minedraft.workers.model_runner import ModelRunner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--target", default=DEFAULT_TARGET)
    a = p.parse_args()
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


if __name__ == "__main__":
    main()
