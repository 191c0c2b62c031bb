#!/usr/bin/env python
"""What a ragged verify step costs beside a dense one with the same number of scored tokens: the runner's
forward (packed logits), the left-alignment of ragged rows, and verify_batch, on one thread, the two batches
alternating within each repeat. Dense: k = 1 draft per row; ragged: 0..3 drafts per row, B drafts in all (a
Tetris step at capacity B).

    python scripts/ragged_verify.py --target ~/.cache/minedraft/models/smollm2-135m [--batch 16] [--repeats 21]
"""

import argparse
import random
import statistics
import time

import torch

from minedraft.spec.batch_sampling import RowParams, verify_batch
from minedraft.config import DEFAULT_TARGET
from minedraft.sampling_params import SamplingParams
from minedraft.workers.model_runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=21)
    a = ap.parse_args()
    torch.set_num_threads(1)
    runner = ModelRunner.from_pretrained(a.target, 65536, 16)
    B, ctx = a.batch, 60
    rids = list(range(B))
    for r in rids:
        runner.cache.allocate(r, 256)
    runner.forward(rids, [[5] * ctx for _ in rids], 1)
    rng = random.Random(0)
    ragged = [rng.choice([0, 0, 1, 1, 1, 2, 3]) for _ in rids]
    while sum(ragged) != B:
        ragged = [rng.choice([0, 0, 1, 1, 1, 2, 3]) for _ in rids]
    cases = {"dense k=1": [1] * B, "ragged 0..3": ragged}
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


if __name__ == "__main__":
    main()
